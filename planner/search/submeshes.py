"""The search's per-stage pass: after the uniform-mesh search, Alpa's stage-submesh DP
(planner.inter_op.submesh_dp) for the best uniform plans' settings, each stage choosing its
submesh, its (dp, tp) there, its ZeRO level, HSDP and checkpointing; the splits the DP finds
are predicted exactly (planner.evaluate.submeshes, which prices one mesh as predict() does)
and kept only when faster than the best uniform plan, so the pass is never slower.

What the pass varies and what it keeps: the layer split (at most MAX_GROUPS cut points), each
stage's submesh size, (dp, tp), ZeRO level, HSDP and checkpointing (none, selective,
alternate selective, full), with the layout kind's table at the stage's micro-batch (the
pipeline micro-batch over its dp); kept from each of the best uniform plans (`FAMILIES`
distinct ones): the micro-batch count, the layout kind and fp8. The 1F1B schedule (GPipe's
time with more memory adds nothing), one chunk per device, no context or expert parallelism
or offload. Only the tables the uniform search built: an ILP layout it did not solve for a
(micro-batch, tp) is not solved here (solving them cost 0.6-1.2 s on the GPT suite and found
nothing more there or on Wide-ResNet-6.8B). Clusters up to MAX_DEVICES (Alpa's scale; the
DP's work per t_max grows with devices x cut points^2)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import pairwise, product

import numpy as np

from planner.cost.memory import bytes_per_param
from planner.errors import InputError
from planner.evaluate.config import ParallelConfig
from planner.evaluate.submeshes import (
    PerStagePrediction,
    StageMesh,
    predict_per_stage,
    stage_config,
    to_plan_per_stage,
)
from planner.inter_op.stage_dp import StageCosts
from planner.inter_op.stage_inputs import stage_costs
from planner.inter_op.submesh_dp import (
    SubmeshOption,
    assign_submeshes,
    one_f_one_b_inflight,
    place,
    submesh_sizes,
    undominated,
)
from planner.parallel import checkpointing, data, fp8, pipeline
from planner.parallel.tensor import heads_refusal
from planner.search.space import MAX_MICROBATCH_SIZE
from planner.search.variant import shards

MAX_DEVICES = 64
MAX_STAGES = 16
MAX_GROUPS = 24  # layer boundaries the DP may cut at (planner.search.submeshes._group_cuts)
FAMILIES = 2  # distinct settings of the best uniform plans the pass is run for
SCHEDULE = "1f1b"
# The DP's t_max steps: within 1% of its own optimum (planner.inter_op.submesh_dp), whose
# terms are themselves bounds of predict()'s; the splits it returns are predicted exactly.
TOLERANCE = 1e-2


@dataclass(frozen=True)
class Family:
    microbatches: int
    layout: str
    fp8: str | None


# Per stage: checkpointing as a stage DP prices it (whole layers; partial checkpointing and
# the activation stores are per-device choices of the uniform search).
STAGE_CHECKPOINTING = (False, checkpointing.SELECTIVE, checkpointing.ALTERNATE, True)


def searched(options, num_devices: int) -> bool:
    """Whether the search runs the pass: per-stage plans not pinned off, no mesh pinned, a
    cluster within MAX_DEVICES, and either plans the executor cannot run allowed or the
    pass pinned (executable searches leave it out unless asked: it takes up to 22% of
    a search's time, bench/results/submeshes.md, for margins of 0-4.4% there, and the
    executor runs only some of its plans: executor.submesh_pipeline)."""
    return (
        "per_stage" in options.stage_meshes
        and options.mesh is None
        and (not options.executable_only or options.stage_meshes == ("per_stage",))
        and 2 <= num_devices <= MAX_DEVICES
        and SCHEDULE in options.schedules
        and (options.virtual_stages is None or 1 in options.virtual_stages)
    )


def check_pin(options) -> None:
    """Per-stage plans pinned where the search may not return them: a mesh pin is one
    mesh."""
    if options.stage_meshes != ("per_stage",):
        return
    if options.mesh is not None:
        raise InputError("search.stage_meshes", "per_stage with a mesh pinned", "uniform")


def families(candidates) -> list[Family]:
    """The settings of the best uniform candidates the pass keeps, best first."""
    out: list[Family] = []
    for c in candidates:
        cfg = c.config
        if cfg.cp > 1 or cfg.ep > 1:
            continue
        fam = Family(cfg.microbatches, fp8.split_kind(c.layout)[0], cfg.fp8)
        if fam not in out:
            out.append(fam)
        if len(out) == FAMILIES:
            break
    return out


def per_stage_search(run, candidates, required: bool = False) -> PerStagePrediction | None:
    """The fastest per-stage plan over the families of `candidates` (sorted, best first)
    that fits and beats the best of them (`required`: that fits), or None. It may have every
    stage alike: a layer split the uniform search's stage DP did not find (its DP balances
    the slowest stage; this one prices the whole step)."""
    if not candidates:
        return None
    best_uniform = candidates[0].step_time_s
    best: PerStagePrediction | None = None
    # at most twice the best uniform plan's pipeline depth (and 4): the DP's work grows with
    # the stage count, and the per-stage plans that won on Alpa's suites (bench/results/
    # submeshes.md) were no deeper than the uniform ones
    depth = max(4, 2 * candidates[0].config.pp)
    for fam in families(candidates):
        found = _search_family(run, fam, depth)
        if found is None or not found.prediction.fits_in_memory:
            continue
        if best is None or found.step_time_s < best.step_time_s:
            best = found
    if best is not None and (required or best.step_time_s < best_uniform * (1 - 1e-9)):
        return best
    return None


@dataclass(frozen=True)
class _Option:
    config: ParallelConfig  # the stage's, priced as one of 2 stages (pp set when placed)
    layout: str
    mbs: int


def _search_family(run, fam: Family, depth: int) -> PerStagePrediction | None:
    inputs, options = run.inputs, run.options
    cluster, training = inputs.cluster, inputs.training
    m = fam.microbatches
    if training.global_batch_size % m:
        return None
    micro = training.global_batch_size // m  # samples per pipeline micro-batch
    allowed_mbs = options.microbatch_sizes or range(1, MAX_MICROBATCH_SIZE + 1)
    per_node, nodes = cluster.devices_per_node, cluster.nodes
    max_tp = min(per_node, options.max_tp or per_node)
    zeros = pipeline.zero_stages_for(SCHEDULE, options.zero_stages)
    ckpts = [c for c in STAGE_CHECKPOINTING if c in options.checkpointing]
    if True in ckpts or checkpointing.PARTIAL in options.checkpointing:
        ckpts = sorted(set(ckpts) | {True}, key=STAGE_CHECKPOINTING.index)
    picks: list[_Option] = []
    dp_options: list[SubmeshOption] = []
    cuts: list[int] = []  # set by the first table (every table has the same positions)
    data_terms: dict[tuple, tuple] = {}  # checkpointing leaves them as they are
    if options.executable_only and fam.layout != "megatron":
        max_tp = 1  # the executor runs per-stage plans on the module path: Megatron's layout
    for size in submesh_sizes(nodes, per_node):
        tp = 1
        while tp <= min(size, max_tp):
            dp = size // tp
            ok = size % tp == 0 and micro % dp == 0 and micro // dp in allowed_mbs
            ok = ok and heads_refusal(inputs.model.config or {}, tp) is None
            table = _table(run, fam, tp, micro // dp) if ok else None
            for zero in (zeros if dp > 1 else (0,)) if table is not None else ():
                hybrid = shards(options, dp, tp, zero, per_node)
                if options.executable_only:  # no HSDP stage has run against the reference
                    hybrid = [h for h in hybrid if h == 0]
                for shard, ckpt in product(hybrid, ckpts):
                    cfg = stage_config(dp, tp, 2, m, SCHEDULE, zero, ckpt, fam.fp8, shard)
                    costs = stage_costs(table, cfg, training, cluster, run.cm)
                    picks.append(_Option(cfg, _kind(fam, tp), micro // dp))
                    cuts = cuts or _group_cuts(table.num_positions)
                    if (dp, tp, zero, shard) not in data_terms:
                        data_terms[dp, tp, zero, shard] = _data_terms(run, table, cfg, cuts)
                    terms = data_terms[dp, tp, zero, shard]
                    dp_options.append(_option(run, size, len(picks) - 1, costs, terms, cuts))
            tp *= 2
    dp_options = undominated(dp_options)
    max_stages = min(MAX_STAGES, depth, options.max_pp or MAX_STAGES, m)
    # The step pays the largest of the stages' once-a-step terms; the DP can sum them (an
    # upper bound) or leave them out (a lower one, as Alpa's DP does): both splits are
    # predicted, the faster kept.
    best = None
    inflight = one_f_one_b_inflight(m)
    for weigh_once in (True, False):
        priced = dp_options if weigh_once else [_without_once(o) for o in dp_options]
        found = assign_submeshes(
            priced, cluster.num_devices, m, inflight, max_stages=max_stages, tolerance=TOLERANCE
        )
        run.count_evaluated(1)
        if found is None:
            continue
        chosen = [picks[priced[i].key] for i in found.options]
        ranges = [(cuts[a], cuts[b]) for a, b in found.ranges]
        predicted = _predicted(run, fam, chosen, ranges)
        if predicted is not None and (best is None or predicted.step_time_s < best.step_time_s):
            best = predicted
    return best


def _without_once(option: SubmeshOption) -> SubmeshOption:
    return replace(option, once=np.zeros_like(option.once))


def _predicted(run, fam: Family, chosen: list[_Option], ranges) -> PerStagePrediction | None:
    """The exact prediction of stages on these options, placed on the cluster."""
    cluster, training = run.inputs.cluster, run.inputs.training
    sizes = [o.config.dp * o.config.tp for o in chosen]
    firsts = place(sizes, cluster.nodes, cluster.devices_per_node)
    if firsts is None:  # Alpa's shapes always tile; kept as a check, not a path
        return None
    stage_meshes = [
        StageMesh(
            first,
            replace(o.config, pp=len(chosen)),
            o.layout,
            o.mbs,
            _table(run, fam, o.config.tp, o.mbs),
        )
        for first, o in zip(firsts, chosen, strict=True)
    ]
    facts = run.facts_at(stage_meshes[0].microbatch_size)
    return predict_per_stage(facts, cluster, training, stage_meshes, ranges)


def _group_cuts(n: int) -> list[int]:
    """Where stages may start: every layer up to MAX_GROUPS layers, beyond that every g-th
    (Alpa clusters operators into layers for its DP likewise); the DP's work grows with the
    square of their count."""
    step = -(-n // MAX_GROUPS)
    return [*range(0, n, step), n]


def _grouped(values, cuts: list[int]) -> list[float]:
    """Per-layer values summed between consecutive cuts (the DP's layers)."""
    return [float(sum(values[a:b])) for a, b in pairwise(cuts)]


def _data_terms(run, table, cfg, cuts: list[int]) -> tuple[np.ndarray, ...]:
    """Per range of layers: (ZeRO-3's collectives per micro-batch, the gradient sync and
    tensor-parallel gradient sync once a step, the optimizer step, the forward + backward
    compute, the backward compute), each summed per layer (FSDP2's unit: one message per
    layer) as SubmeshOption.additive sums stage times; and the sends at its two ends (this
    side's share of the boundary activation at the cut, over the slowest link two stages
    may meet on: between nodes on a cluster of several; the submeshes' places are not
    known yet)."""
    cluster, training, cm = run.inputs.cluster, run.inputs.training, run.cm
    per = bytes_per_param(training.dtype, training.optimizer)
    axes = data.data_axes(cluster, 0, cfg)  # the same links at any aligned submesh
    ins, out, pre = table.inside, table.outside, table.before_layers

    def per_layer(name: str) -> tuple[list[float], float, float]:
        return list(ins[name]), pre[name], sum(out[name]) - pre[name]

    def spans(values: tuple[list[float], float, float]) -> np.ndarray:
        layers, head, tail = values
        return SubmeshOption.additive(0, None, _summed(_grouped(layers, cuts), head, tail)).time

    def data_spans(what: str) -> np.ndarray:
        layers, head, tail = per_layer("params")
        timed = [_data_time(cm, axes, p, per, cfg, what, training.optimizer) for p in layers]
        ends = [_data_time(cm, axes, p, per, cfg, what, training.optimizer) for p in (head, tail)]
        return spans((timed, *ends))

    zero3 = data_spans("zero3") if cfg.zero == 3 and cfg.dp > 1 else None
    sync = data_spans("sync") + spans(per_layer("step_comm"))
    compute = spans(per_layer("fwd")) + spans(per_layer("bwd"))
    n = len(cuts) - 1
    link = cm.p2p_axis(0, cluster.devices_per_node if cluster.nodes > 1 else 1)
    send = np.array([cm.send_recv(table.cut_bytes[c] / cfg.tp, link) for c in cuts])
    k, j = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    sends = np.where(k > 0, send[k], 0.0) + np.where(j < n, send[j], 0.0)
    return zero3, sync, data_spans("optimizer"), compute, spans(per_layer("bwd")), sends


def _option(run, size: int, key, costs, terms, cuts: list[int]) -> SubmeshOption:
    """The option's stage terms per range of layers, the data-parallel ones (terms) priced
    on the stage's sums as predict() prices them (planner.evaluate.predict.stage_figures):
    per micro-batch ZeRO-3's collectives exposed under the stage's compute; once a step its
    gradient sync exposed under its backward (as the first stage, the least hidden) and its
    optimizer step, summed over the stages where the step takes the largest (an upper bound;
    the plan is predicted exactly after); the sends at its two ends (_data_terms)."""
    overlap = run.inputs.cluster.efficiency.overlap
    grouped = replace(
        costs,
        layer_time=_grouped(costs.layer_time, cuts),
        layer_static=_grouped(costs.layer_static, cuts),
        layer_act=_grouped(costs.layer_act, cuts),
        stage_overhead=0.0,
    )
    option = SubmeshOption.additive(size, key, grouped)
    *data_terms, sends = terms
    time = option.time + sends
    finite = np.isfinite(time)
    zero3, sync, optimizer, compute, backward = (
        None if t is None else np.where(finite, t, 0.0) for t in data_terms
    )
    if zero3 is not None:
        time = time + zero3 - overlap * np.minimum(zero3, compute)
    once = sync - overlap * np.minimum(sync, backward) + optimizer
    return SubmeshOption(size, key, time, once, option.static, option.acts, option.capacity)


def _summed(layers: list[float], head: float, tail: float) -> StageCosts:
    """Per-layer values as StageCosts' times, to sum them over ranges like stage times."""
    return StageCosts(layer_time=layers, first_time=head, last_time=tail)


def _data_time(cm, axes, params: float, per, cfg, what: str, optimizer: str) -> float:
    """One layer's (`params` elements) ZeRO-3 collectives per micro-batch, gradient sync or
    optimizer step, on the stage's (shard, replicate) axes."""
    (axis, replicate), params = axes, int(params)
    if what == "zero3":
        return data.zero3_comm(cm, axis, params, per, params, replicate)
    if what == "sync":
        return data.gradient_sync(cm, axis, params, per, cfg.zero, params, replicate)
    return data.optimizer_step_time(params, cfg.zero, cfg.shard_degree, optimizer, cm.mem_rate)


def _kind(fam: Family, tp: int) -> str:
    return fam.layout if tp > 1 else "megatron"


def _table(run, fam: Family, tp: int, mbs: int):
    """The family's layout's table on tp at this micro-batch, or None where it has none (an
    ILP layout not solved for it, a Megatron kind not searched at this tp)."""
    kind = _kind(fam, tp)
    if kind == "ilp" and (mbs, tp) not in run.layouts.solved:
        return None
    if tp > 1 and kind not in ("ilp", *run.kinds(tp)):
        return None
    return run.layouts.table(fp8.table_kind(kind, fam.fp8), mbs, tp)


def not_executable_lines(plan) -> list[str]:
    return [
        "No executable plan with stages on their own submeshes (search.stage_meshes "
        f"per_stage): the best one found is not run by the executor: "
        f"{plan.not_executable_reason}.",
    ]


def none_fits_lines(cluster) -> list[str]:
    return [
        "No plan with stages on their own submeshes fits (search.stage_meshes per_stage): "
        f"the stage-submesh DP found no split of the layers over {cluster.num_devices} "
        "devices whose stages fit in memory with the best uniform plans' settings.",
    ]


def plan_on_submeshes(
    result,
    shapes: list[tuple[int, int]],
    microbatches: int,
    zero: int = 0,
    checkpointing: bool | str = False,
    ranges: list[tuple[int, int]] | None = None,
):
    """The Plan of stages on the given submeshes, (dp, tp) each in pipeline order, placed as
    the pass places them, with Megatron's layouts, 1F1B over `microbatches`, one ZeRO level
    and checkpointing for all; `ranges`: the layer positions of each stage (default: equal
    shares). `result`: a search's (planner.search.search.SearchResult), whose layouts and
    tables are reused. For pinning a split the pass would not choose on its own (tests of
    the executor, comparisons)."""
    layouts = result.layouts
    inputs = layouts.inputs
    cluster, training = inputs.cluster, inputs.training
    micro, left = divmod(training.global_batch_size, microbatches)
    if left or any(micro % dp for dp, _ in shapes):
        raise InputError(
            "stage_meshes",
            f"{shapes} with {microbatches} micro-batches of a batch of "
            f"{training.global_batch_size}",
            "each stage's dp dividing the pipeline micro-batch",
        )
    firsts = place([dp * tp for dp, tp in shapes], cluster.nodes, cluster.devices_per_node)
    if firsts is None:
        raise InputError("stage_meshes", f"{shapes}", f"submeshes tiling {cluster.name}")
    meshes = []
    for first, (dp, tp) in zip(firsts, shapes, strict=True):
        cfg = stage_config(dp, tp, len(shapes), microbatches, SCHEDULE, zero, checkpointing, None)
        table = layouts.table("megatron", micro // dp, tp)
        meshes.append(StageMesh(first, cfg, "megatron", micro // dp, table))
    if ranges is None:
        n, p = meshes[0].table.num_positions, len(shapes)
        bounds = [n * s // p for s in range(p + 1)]
        ranges = list(pairwise(bounds))
    facts = inputs.facts_at(meshes[0].microbatch_size)
    found = predict_per_stage(facts, cluster, training, meshes, ranges)
    return per_stage_plan(found, layouts, result.plan.search.solver)


def per_stage_plan(found: PerStagePrediction, layouts, solver: str, uniform_best_s=None):
    """The Plan of a per-stage prediction, laid out from the search's layouts."""
    inputs = layouts.inputs
    return to_plan_per_stage(
        found,
        layouts.graph,
        layouts.get,
        inputs.cluster,
        inputs.training,
        inputs.model,
        tokens_per_sample=inputs.tokens_per_sample,
        solver=solver,
        uniform_best_s=uniform_best_s,
    )
