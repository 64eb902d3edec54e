"""When nothing fits: how far off the model is, and the smallest cluster that would fit."""

from __future__ import annotations

from planner.cost.memory import bytes_per_param
from planner.evaluate.config import ParallelConfig
from planner.evaluate.predict import predict
from planner.executable import GRAPH_MODE_REFUSALS
from planner.graph.batch import rescale_batch
from planner.limits import MAX_DEVICES
from planner.parallel import offload
from planner.parallel_dims import ParallelDims
from planner.search.space import meshes


def not_fit_lines(graph, cluster, training, pins: list[str] | None = None) -> list[str]:
    """Why nothing fits and what to change: the pins that rule out what would fit, the
    headroom, or the smallest cluster that fits."""
    per = bytes_per_param(training.dtype, training.optimizer)
    state = graph.param_count * (per.weights + per.grads + per.optimizer)
    cap = cluster.usable_memory_bytes
    n = cluster.num_devices
    lines = [
        f"No configuration fits: the model's parameters, gradients and optimizer state alone "
        f"take {state / 2**30:.1f} GiB ({state / n / 2**30:.2f} GiB per device if spread over "
        f"all {n} devices) against {cap / 2**30:.1f} GiB per device, before activations.",
    ]
    if pins and fits_somewhere(graph, cluster, training):
        lines.append(
            f"It fits on this cluster unpinned (ZeRO-3, full checkpointing and micro-batch 1 "
            f"on some mesh): the pinned {', '.join(pins)} rule that out; unpin them."
        )
        return lines
    kept = cluster.memory_headroom_bytes
    if kept and fits_somewhere(
        graph, cluster.model_copy(update={"memory_headroom_bytes": 0}), training
    ):
        lines.append(
            f"It would fit in the {kept / 2**30:.1f} GiB per device kept free as headroom "
            "(--memory-headroom 0, cluster.memory_headroom), at the risk of running out of "
            "memory to allocator fragmentation."
        )
        return lines
    tried = cluster.nodes
    for factor in (2, 4, 8, 16, 32, 64):
        if cluster.nodes * factor * cluster.devices_per_node > MAX_DEVICES:
            break
        bigger = cluster.with_nodes(cluster.nodes * factor)
        tried = bigger.nodes
        if fits_somewhere(graph, bigger, training):
            lines.append(
                f"The smallest cluster that fits has {bigger.nodes} nodes "
                f"({bigger.num_devices} devices of {cluster.device.name})."
            )
            return lines
    lines.append(f"It does not fit on {tried} nodes either.")
    return lines


def fits_somewhere(graph, cluster, training) -> bool:
    """A quick feasibility probe: Megatron layout, ZeRO-3, checkpointing, micro-batch 1, and
    ZeRO-3's shards in host memory where the cluster can hold them (as the search tries
    where nothing else fits: planner.parallel.offload)."""
    n = max(graph.num_layers, 1)
    g1 = rescale_batch(graph, 1)
    for pp, dp, tp in meshes(cluster, n, None):
        if training.global_batch_size % dp:
            continue
        zero = 3 if dp > 1 else 0
        hosts = (False, True) if offload.refusal(zero, dp, cluster) is None else (False,)
        for on_host in hosts:
            cfg = ParallelConfig(
                dp=dp,
                tp=tp,
                pp=pp,
                microbatches=training.global_batch_size // dp,
                zero=zero,
                checkpointing=True,
                offload=on_host,
            )
            if predict(g1, cluster, training, cfg).fits_in_memory:
                return True
    return False


def no_executable_lines(left_out: int) -> list[str]:
    """executable_only found nothing although layouts the executor cannot run were left out
    (whether those would fit is not known here, so no cluster size is suggested)."""
    refused = ", ".join(k.replace("_", " ") for k in GRAPH_MODE_REFUSALS)
    return [
        f"No executable plan: {left_out} tensor-parallel layouts were left out because the "
        "executor cannot run them as pinned (a split no module-level parallel style applies "
        f"runs in graph mode, which does not run {refused}), and nothing else fits device "
        "memory.",
        "Search with --allow-non-executable (search.executable_only = false) for the best "
        "plan under the cost model; it says why it cannot run.",
    ]


def cut_lines(limit: float | None) -> list[str]:
    return [
        f"The search was cut at its time limit of {limit:g} s before any configuration that "
        "fits was found; allow more time or pin part of the plan."
    ]


def schedule_lines(schedules: tuple[str, ...], refusals: set[str]) -> list[str]:
    """Nothing was tried: torch runs the schedules asked for with none of the pipeline depths
    and micro-batch counts the other pins leave."""
    return [
        f"No configuration could be tried: schedule {' / '.join(schedules)} runs with none of "
        "the micro-batch counts the pinned mesh and micro-batch size leave: "
        + "; ".join(sorted(refusals)[:3])
        + ". Pin a smaller micro-batch size or another schedule (search.schedules).",
    ]


def memory_pins(options) -> list[str]:
    """The pinned choices that cost memory where the search would trade it (for the
    explanation when nothing fits)."""
    pins = []
    if options.mesh is not None:
        dims = ParallelDims.of_grid(options.mesh, options.cp)
        pins.append(f"mesh {dims.mesh_pin()}" + (f" with cp {dims.cp}" if dims.cp > 1 else ""))
    if 3 not in options.zero_stages:
        pins.append("ZeRO " + "/".join(map(str, options.zero_stages)))
    if True not in options.checkpointing:
        names = {False: "off", True: "full"}
        pins.append("checkpointing " + "/".join(names.get(c, c) for c in options.checkpointing))
    if options.microbatch_sizes and 1 not in options.microbatch_sizes:
        pins.append("micro-batch size " + "/".join(map(str, options.microbatch_sizes)))
    return pins
