"""The search space: which meshes, micro-batch sizes, schedules, ZeRO levels, checkpointing
and tensor-parallel layouts the search considers, and what a user pinned.

Meshes: pp x dp x tp = devices, pp <= layers, tp groups within a node or spanning whole nodes
(planner.parallel.tensor.fits_links); micro-batch sizes divide the per-replica batch (up to
32). Each dimension's values and pruning rules live in its planner.parallel module.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from planner.cluster.profile import ClusterProfile
from planner.cost.schedule_v import V_SHAPED
from planner.errors import InputError
from planner.executable import runs
from planner.parallel.checkpointing import modes, schedule_refusal
from planner.parallel.context import dominated
from planner.parallel.data import hybrid_refusal
from planner.parallel.fp8 import schedule_refusal as fp8_schedule_refusal
from planner.parallel.pipeline import SEARCHED_SCHEDULES, zero_refusal
from planner.parallel.registry import exchanges, store_of
from planner.parallel.tensor import (
    LAYOUT_KINDS,
    fits_links,
    heads_refusal,
    layout_kinds,
    tp_layout_name,
)
from planner.parallel_dims import Combination, ParallelDims, pinned_grid
from planner.vocab import FP8_RECIPES, STAGE_MESHES, ZERO_LEVELS

MAX_MICROBATCH_SIZE = 32  # default upper bound of the micro-batch sizes tried


@dataclass(frozen=True)
class SearchOptions:
    microbatch_sizes: tuple[int, ...] | None = None  # default: divisors of the batch, <= 32
    schedules: tuple[str, ...] = SEARCHED_SCHEDULES
    virtual_stages: tuple[int, ...] | None = None  # default: planner.parallel.pipeline's range
    zero_stages: tuple[int, ...] = ZERO_LEVELS
    # False, "selective", ..., "partial", the activation stores, True (full)
    checkpointing: tuple = field(default_factory=modes)
    layouts: tuple[str, ...] = LAYOUT_KINDS
    max_tp: int | None = None  # default: no cap (tp groups may span nodes)
    max_pp: int | None = None  # default: no cap (a framework that pipelines in code: 1)
    top_k: int = 5
    workers: int = 1  # processes for ILP solves and cost tables (CLI default: default_workers)
    solver: str = "highs"
    ilp_time_limit: float = 60.0
    time_limit: float | None = None  # whole search, s: past it, the best plan found so far
    # only plans the executor runs (planner.executable); False: the best plan under the cost
    # model, whatever runs it
    executable_only: bool = True
    # pin the rank grid (pp, dp x cp, tp) (planner.parallel_dims); default: every valid one
    mesh: tuple[int, int, int] | None = None
    dp_shard: int | None = None  # pin HSDP's shard degree (0: all of dp); default: searched
    cp: int | None = None  # pin context parallelism's degree; default: searched (long sequences)
    cp_comm: str | None = None  # pin its sequence exchange; default: each the heads allow
    offload: bool | None = None  # pin CPU offload on or off; default: where nothing else fits
    fp8: tuple[str | None, ...] | None = None  # pin fp8's recipe (None: none); default searched
    ep: int | None = None  # pin expert parallelism's degree; default: searched (MoE models)
    etp: int | None = None  # pin expert tp 1 (ep over dp x tp); default: searched beside tp
    # pin layer-wise ZeRO (planner.parallel.data) on or off; default: searched beside ZeRO-3
    layerwise_zero: bool | None = None
    # every stage on one (dp, tp) mesh, and/or each stage on its own submesh (Alpa's
    # inter-operator pass, planner.search.submeshes: plans the executor does not run yet)
    stage_meshes: tuple[str, ...] = STAGE_MESHES


def runtime_options(options: SearchOptions, runtime) -> SearchOptions:
    """The ZeRO levels and tensor-parallel layouts the runtime runs (planner.runtime); a
    pinned one it does not run is refused naming the pin."""
    zeros = tuple(z for z in options.zero_stages if runtime.refusal(z) is None)
    if not zeros:
        why = runtime.refusal(options.zero_stages[0])
        raise InputError("search.zero", why, f"ZeRO {', '.join(map(str, runtime.zero_levels))}")
    layouts = tuple(k for k in options.layouts if tp_layout_name(k) in runtime.tp_layouts)
    if not layouts:
        raise InputError(
            "search.tp_layout",
            f"{runtime.name} runs Megatron's tensor-parallel layout, not the ILP's per-node one",
            "tp_layout megatron",
        )
    if (zeros, layouts) == (options.zero_stages, options.layouts):
        return options
    return replace(options, zero_stages=zeros, layouts=layouts)


def executable_options(options: SearchOptions, mode: str | None) -> SearchOptions | None:
    """The options a layout's candidates are searched with, given how the executor would
    run it (`mode`, planner.executable): with only executable plans wanted, none where it
    cannot run, and in graph mode what graph mode runs (planner.executable.RUNS); None
    where the pins leave none of it."""
    if not options.executable_only or mode == "modules":
        return options
    if mode is None:
        return None
    zeros = tuple(z for z in options.zero_stages if runs(mode, f"zero{z}"))
    # (fp8: the search's recipes, SearchRun.recipes)
    checkpointing = tuple(
        c
        for c in options.checkpointing
        if (store := store_of(c)) is None or runs(mode, store.capability)
    )
    offload = options.offload if runs(mode, "cpu_offload") else False
    if not zeros or not checkpointing or (options.offload and not offload):  # pinned on
        return None
    # hybrid sharding searched only where the path runs it (a pin stays, and is refused)
    shard = 0 if options.dp_shard is None and not runs(mode, "hsdp") else options.dp_shard
    return replace(
        options, zero_stages=zeros, dp_shard=shard, checkpointing=checkpointing, offload=offload
    )


def default_workers() -> int:
    """One process per CPU core this process may run on, up to 8."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


def pinned_options(
    mesh: tuple[int, int, int] | list[int] | None = None,
    schedule: str | None = None,
    zero: int | None = None,
    checkpointing: bool | str | None = None,
    microbatch_size: int | None = None,
    tp_layout: str | None = None,
    virtual_stages: int | None = None,
    sequence_parallel: bool | None = None,
    dp_shard: int | None = None,
    cp: int | None = None,
    cp_comm: str | None = None,
    cpu_offload: bool | None = None,
    fp8: str | None = None,
    ep: int | None = None,
    stage_meshes: str | None = None,
    layerwise_zero: bool | None = None,
    etp: int | None = None,
) -> dict:
    """SearchOptions fields for the parts of a plan a user pins (None: searched)."""
    out: dict = {}
    if layerwise_zero is not None:
        if layerwise_zero and zero not in (None, 3):
            raise InputError("search.layerwise_zero", f"with ZeRO {zero}", "ZeRO 3 (search.zero)")
        if layerwise_zero and cpu_offload:
            raise InputError("search.layerwise_zero", "with CPU offload", "cpu_offload off")
        if layerwise_zero and mesh is not None and mesh[0] > 1:
            why = f"with pp {mesh[0]} (layer-wise ZeRO runs without a pipeline)"
            raise InputError("search.layerwise_zero", why, "a mesh with pp 1")
        out["layerwise_zero"] = layerwise_zero
        if layerwise_zero:
            out["zero_stages"], out["max_pp"] = (3,), 1
    if stage_meshes is not None:
        if stage_meshes not in STAGE_MESHES:
            raise InputError("search.stage_meshes", repr(stage_meshes), ", ".join(STAGE_MESHES))
        if stage_meshes == "per_stage" and mesh is not None:
            raise InputError(
                "search.stage_meshes", "per_stage with a mesh pinned", "uniform, or no mesh pin"
            )
        out["stage_meshes"] = (stage_meshes,)
    if ep is not None:
        if ep < 1:
            raise InputError("search.ep", f"{ep}", "an integer >= 1")
        out["ep"] = ep
    if etp is not None:
        if etp < 1:
            raise InputError("search.etp", f"{etp}", "1, or the tp that splits each expert")
        if etp == 1 and ep == 1:
            raise InputError("search.etp", "1 with ep 1", "ep > 1, or no ep pin")
        if mesh is not None and etp > 1 and mesh[2] != etp:
            why = f"{etp} with tp {mesh[2]} (each expert's features split over tp)"
            raise InputError("search.etp", why, f"1, or {mesh[2]}")
        if etp == 1 and sequence_parallel is False:
            why = "with sequence parallelism off (each MoE block runs on its tp rank's tokens)"
            raise InputError("search.etp", why, "sequence_parallel on")
        out["etp"] = etp
    if fp8 is not None:
        if fp8 != "off" and fp8 not in FP8_RECIPES:
            raise InputError("search.fp8", f"{fp8!r}", "off, " + ", ".join(FP8_RECIPES))
        if schedule is not None and fp8 != "off" and (why := fp8_schedule_refusal(fp8, schedule)):
            raise InputError("search.fp8", why, "off, or a schedule that runs backward whole")
        out["fp8"] = (None if fp8 == "off" else fp8,)
    if cpu_offload is not None:
        if cpu_offload and zero not in (None, 3):
            raise InputError("search.cpu_offload", f"with ZeRO {zero}", "ZeRO 3 (search.zero)")
        out["offload"] = cpu_offload
    if cp is not None:
        if cp < 1:
            raise InputError("search.cp", f"{cp}", "an integer >= 1")
        if cp > 1 and dp_shard not in (None, 0) and (mesh is None or dp_shard != mesh[1]):
            raise InputError("search.cp", "context parallelism with HSDP", "dp_shard unset")
        out["cp"] = cp
    if cp_comm is not None:
        if cp_comm not in exchanges():
            raise InputError("search.cp_comm", f"{cp_comm!r}", ", ".join(exchanges()))
        out["cp_comm"] = cp_comm
    if dp_shard is not None:
        out["dp_shard"] = _dp_shard_pin(dp_shard, mesh, zero)
    if virtual_stages is not None:
        out.update(_virtual_stages_pin(virtual_stages, schedule))
    if tp_layout is not None or sequence_parallel is not None:
        out["layouts"] = layout_kinds(tp_layout, sequence_parallel)
        if not out["layouts"]:
            raise InputError(
                "search.sequence_parallel",
                f"sequence parallelism with tp_layout {tp_layout}",
                "tp_layout megatron (sequence parallelism is a form of Megatron's layout)",
            )
    if mesh is not None:
        # the pin names every degree (world = pp x dp x cp x tp): no cp is searched inside it
        out["mesh"] = ParallelDims(mesh[0], mesh[1], cp or 1, mesh[2]).grid
        out["cp"] = cp or 1
    if schedule is not None:
        out["schedules"] = (schedule,)
    if zero is not None:
        if schedule is not None and (why := zero_refusal(schedule, zero)):
            raise InputError("search.zero", why, "ZeRO 0 to 2, or another schedule")
        out["zero_stages"] = (zero,)
    if checkpointing is not None:
        if checkpointing not in modes():
            expected = ", ".join(str(m).lower() for m in modes())
            raise InputError("search.checkpointing", f"{checkpointing!r}", expected)
        if schedule is not None and (why := schedule_refusal(schedule, checkpointing)):
            raise InputError("search.checkpointing", why, "full or partial, or another schedule")
        out["checkpointing"] = (checkpointing,)
    if microbatch_size is not None:
        if microbatch_size <= 0:
            raise InputError("search.microbatch_size", f"{microbatch_size}", "an integer >= 1")
        out["microbatch_sizes"] = (microbatch_size,)
    return out


def _dp_shard_pin(dp_shard: int, mesh, zero: int | None) -> int:
    """HSDP pinned: dp_shard ranks share one copy of the sharded state (0 or dp: all)."""
    if dp_shard < 0:
        raise InputError("search.dp_shard", f"{dp_shard}", "an integer >= 0")
    if mesh is not None and (why := hybrid_refusal(mesh[1], dp_shard, 1 if zero is None else zero)):
        raise InputError("search.dp_shard", why, "a divisor of dp, with ZeRO 1-3")
    return 0 if mesh is not None and dp_shard == mesh[1] else dp_shard


def _virtual_stages_pin(v: int, schedule: str | None) -> dict:
    """Chunks per device pinned: more than one needs a schedule that interleaves chunks (the
    search keeps only the schedules that run v chunks: pipeline.virtual_stage_counts)."""
    if v < 1:
        raise InputError("search.virtual_stages", f"{v}", "an integer >= 1")
    if schedule is not None and not virtual_stages_allowed(schedule, v):
        raise InputError(
            "search.virtual_stages",
            f"{v} with schedule {schedule}",
            "2 or more with interleaved_1f1b, any with interleaved_zero_bubble or looped_bfs, "
            "2 with zbv_zero_bubble and dualpipe_v, 1 with the other schedules",
        )
    return {"virtual_stages": (v,)}


def virtual_stages_allowed(schedule: str, v: int) -> bool:
    if schedule == "interleaved_1f1b":
        return v >= 2
    if schedule in V_SHAPED:
        return v == 2
    return schedule in ("interleaved_zero_bubble", "looped_bfs") or v == 1


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(cluster: ClusterProfile, num_layers: int, max_tp: int | None) -> list[tuple[int, ...]]:
    """(pp, dp, tp) with pp * dp * tp = devices and pp <= layers; tp groups either fit in a
    node or span whole nodes (so every group sees the same links)."""
    return grids(cluster.num_devices, cluster.devices_per_node, num_layers, max_tp)


def grids(n: int, per_node: int, num_layers: int, max_tp: int | None) -> list[tuple[int, ...]]:
    """meshes() on n devices, `per_node` of them to a node."""
    out = []
    for pp in divisors(n):
        if pp > num_layers:
            continue
        for tp in divisors(n // pp):
            if max_tp is not None and tp > max_tp:
                continue
            if fits_links(tp, per_node):
                out.append((pp, n // pp // tp, tp))
    return out


def mesh_list(
    cluster: ClusterProfile,
    num_layers: int,
    options: SearchOptions,
    model_config: dict | None = None,
) -> list[tuple]:
    """The meshes to search: every valid one, or the pinned one (checked). A tp that does
    not divide the model's heads is not valid (planner.parallel.tensor.heads_refusal)."""
    valid = [
        m
        for m in meshes(cluster, num_layers, options.max_tp)
        if heads_refusal(model_config or {}, m[2]) is None
        and (options.max_pp is None or m[0] <= options.max_pp)
    ]
    if options.mesh is not None and (why := heads_refusal(model_config or {}, options.mesh[2])):
        raise InputError("search.mesh", why, "a tp that divides the attention and key/value heads")
    if options.mesh is None:
        return valid
    if tuple(options.mesh) not in valid:
        dims = ParallelDims.of_grid(options.mesh, options.cp)
        if dims.cp > 1:  # the world's count, naming what changed where cp was inside dp
            pinned_grid((dims.pp, dims.dp, dims.tp), dims.cp, cluster.num_devices, "search.mesh")
        grids = [ParallelDims.of_grid(m, dims.cp) for m in valid if m[1] % dims.cp == 0]
        raise InputError(
            "search.mesh",
            f"{dims.mesh_pin()} is not a mesh this search can use on {cluster.num_devices} "
            f"devices ({cluster.devices_per_node} per node) and {num_layers} layers",
            "pp <= layers, tp within a node or whole nodes; one of "
            + ", ".join(g.mesh_pin() for g in grids),
        )
    return [tuple(options.mesh)]


def combinations(
    meshes_: list[tuple],
    global_batch: int,
    options: SearchOptions,
    cp_degrees: Callable[[int], tuple[int, ...]] = lambda _dp: (1,),
    cp_comms: Callable[[int, int], tuple[str, ...]] = lambda _cp, _tp: ("all_gather",),
    ep_degrees: Callable[[int, int, int], tuple[tuple[int, int], ...]] = (
        lambda _dp, _tp, _cp: ((1, 0),)
    ),
) -> list[Combination]:
    """The (mesh, micro-batch size, cp) combinations to evaluate; `cp_degrees(dp)`: the
    context-parallel degrees to try on a mesh (planner.parallel.context.cp_options),
    `cp_comms(cp, tp)` the sequence exchanges (planner.parallel.context.comm_options),
    `ep_degrees(dp, tp, cp)` expert parallelism's with its expert tp
    (planner.parallel.expert.ep_options). The
    batch is split over dp / cp replicas. A context-parallel combination whose half (cp / 2
    ranks, half the micro-batch) is also listed is left out: both run the same tokens per
    rank and the same micro-batch count, and the half gathers half the keys and values in a
    smaller group (planner.parallel.context.dominated)."""
    out = []
    for pp, dp, tp in meshes_:
        for cp in cp_degrees(dp):
            replicas = dp // cp
            if global_batch % replicas:
                continue
            sizes = options.microbatch_sizes or [
                b for b in range(1, MAX_MICROBATCH_SIZE + 1) if (global_batch // replicas) % b == 0
            ]
            for mbs in sizes:
                if global_batch % (replicas * mbs) == 0:
                    out += [
                        Combination(pp, dp, tp, mbs, cp, c, ep, etp)
                        for c in cp_comms(cp, tp)
                        for ep, etp in ep_degrees(dp, tp, cp)
                    ]
    listed = set(out)
    return [c for c in out if not dominated(c, listed)]


def microbatch_count(global_batch: int, combo: Combination) -> int:
    """Micro-batches per step of a candidate."""
    return global_batch // (combo.replicas * combo.mbs)


def check_virtual_stages(options: SearchOptions, num_layers: int) -> None:
    """A pinned chunk count the pinned mesh's layers cannot hold is the user's to change."""
    if options.virtual_stages is None or options.mesh is None:
        return
    pp = options.mesh[0]
    if all(pp * v > num_layers for v in options.virtual_stages):
        raise InputError(
            "search.virtual_stages",
            f"{max(options.virtual_stages)} chunks on each of {pp} stages need "
            f"{pp * max(options.virtual_stages)} layers; the model has {num_layers}",
            f"at most {max(num_layers // pp, 1)}",
        )
