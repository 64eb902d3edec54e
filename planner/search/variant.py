"""One configuration of the search evaluated: predict() with the balanced partition of the
layers and with the stage DP's (over pp x v chunks with interleaving); each that fits is a
Candidate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planner.cost.model import CostModel
from planner.cost.schedule_v import V_SHAPED
from planner.evaluate.config import ParallelConfig, split_layers
from planner.evaluate.layer_table import LayerTable
from planner.evaluate.predict import GraphFacts, Prediction, predict
from planner.executable import MODULE_FAMILIES, runs
from planner.inter_op.stage_inputs import dp_ranges, stage_costs
from planner.inter_op.v_split import v_ranges
from planner.parallel import checkpointing, data, expert, fp8, offload, pipeline
from planner.parallel.registry import store_of
from planner.parallel.tensor import MEGATRON_KINDS
from planner.request import PlanningInputs
from planner.search.bounds import (
    fits_nowhere,
    memory_floor,
    partial_recompute_floor,
    step_lower_bound,
)
from planner.search.space import SearchOptions

if TYPE_CHECKING:
    from planner.search.search import SearchRun


@dataclass(frozen=True)
class Candidate:
    step_time_s: float
    key: tuple
    config: ParallelConfig
    layout: str
    mbs: int
    ranges: tuple[tuple[int, int], ...] | None
    peak_memory: int
    prediction: Prediction


@dataclass(frozen=True)
class VariantContext:
    """What every variant of one (mesh, micro-batch, layout) shares."""

    inputs: PlanningInputs
    facts: GraphFacts
    table: LayerTable
    kind: str
    options: SearchOptions
    cm: CostModel
    cp: int = 1  # context parallelism's degree (the table is one cp rank's)
    cp_comm: str = "all_gather"  # its sequence exchange
    fp8: str | None = None  # the fp8 recipe the table was priced with (planner.parallel.fp8)
    ep: int = 1  # expert parallelism's degree (the table is one ep rank's)
    etp: int = 0  # expert tp: 1 with the ep groups over dp x tp (planner.parallel.expert)
    # (schedule, chunks, ZeRO level, checkpointing, dp_shard) an evaluated schedule dominates: the
    # zero-bubble schedule fitted with the same chunks, so interleaved 1F1B (the same stage
    # times, a fill and drain at least as long) cannot be faster there.
    dominated: set[tuple] = field(default_factory=set)


def fitting_variants(
    ctx: VariantContext, run: SearchRun, mesh: tuple, m: int, mbs: int, schedule, v
):
    """Yield a candidate (or None when it does not fit) per evaluation of the ZeRO, HSDP and
    checkpointing variants of one configuration that can win (the others counted, skipped).
    `run`: the search's state, read and counted through its methods (the bar, the
    counters, the ZeRO-3 and p2p bounds)."""
    pp, dp, tp = mesh
    allowed = pipeline.zero_stages_for(schedule, ctx.options.zero_stages)
    allowed = expert.zero_levels(allowed, ctx.ep, ctx.inputs.training.runtime)
    training, capacity = ctx.inputs.training, ctx.inputs.cluster.usable_memory_bytes
    zeros = [z for grp in data.zero_groups(dp, allowed) for z in grp]  # offload's among them
    groups = data.on_device_groups(dp, allowed, training.runtime, pp, m, ctx.ep)
    on_device = [z for grp in groups for z in grp]
    ckpts = checkpointing.searched(ctx.options.checkpointing)
    ckpts = tuple(c for c in ckpts if checkpointing.schedule_refusal(schedule, c) is None)
    if not ckpts or fp8.schedule_refusal(ctx.fp8, schedule):
        return
    ckpts = tuple(c for c in ckpts if store_of(c) is None or _stores_activations(ctx, tp, c))
    if not ckpts:  # a store pinned where it cannot run (a per-node layout, no host link)
        return
    any_cfg = ParallelConfig(
        *(dp, tp, pp, m, schedule, v),
        cp=ctx.cp,
        cp_comm=ctx.cp_comm,
        fp8=ctx.fp8,
        ep=ctx.ep,
        etp=ctx.etp,
    )
    precision = (training.dtype, training.optimizer)
    floor = memory_floor(ctx.table, any_cfg, *precision, on_device, ckpts, training.runtime)
    offloads = _offload_options(ctx, mesh, zeros)
    run.prune((len(zeros) - len(on_device)) * len(ckpts))  # ZeRO-3 where ZeRO-2 dominates
    if floor > capacity or offloads == (True,):
        run.prune(len(on_device) * len(ckpts))  # no ZeRO level or checkpointing fits
    else:
        if (yield from _on_device(ctx, run, mesh, m, mbs, schedule, v, groups, ckpts)):
            return
    if True in offloads and not ctx.options.layerwise_zero:  # only adds time: tried where
        # nothing else fits
        for ckpt in ckpts:
            cfg = ParallelConfig(
                dp, tp, pp, m, schedule, v, 3, ckpt, 0, ctx.cp, ctx.cp_comm, True, ctx.fp8
            )
            found = _evaluated(ctx, run, cfg, mbs, run.work_of(ctx.table, ckpt))
            yield from found
            if any(c is not None for c in found):
                return


def _stores_activations(ctx: VariantContext, tp: int, mode: str) -> bool:
    """Whether an activation store can run here: the cluster holds it (a host link, for
    activation offload), and the executor's path for this layout runs it (its capability
    row: the module path takes Megatron's layouts, any at tp 1, of the families with stage
    modules)."""
    store = store_of(mode)
    modules = (ctx.kind in MEGATRON_KINDS or tp == 1) and ctx.inputs.model.family in MODULE_FAMILIES
    path = "modules" if modules else "graph"
    return store.refusal(ctx.inputs.cluster) is None and runs(path, store.capability)


def _offload_options(ctx: VariantContext, mesh: tuple, zeros: list[int]) -> tuple[bool, ...]:
    """(False,) where CPU offload cannot run or is pinned off; (True,) where it is pinned on;
    else both (planner.parallel.offload). FSDP2 runs it on the executor's module path:
    Megatron's layouts (any at tp 1) of the families with stage modules."""
    _pp, dp, tp = mesh
    pinned = ctx.options.offload
    runs = (
        3 in zeros
        and ctx.ep == 1  # (expert weights without a ZeRO group would stay on the device)
        and offload.refusal(3, dp, ctx.inputs.cluster) is None
        and (ctx.kind in MEGATRON_KINDS or tp == 1)
        and ctx.inputs.model.family in MODULE_FAMILIES
    )
    if pinned is False or not runs:
        return (False,)
    return (True,) if pinned else (False, True)


def _on_device(
    ctx: VariantContext, run: SearchRun, mesh: tuple, m: int, mbs: int, schedule, v, groups, ckpts
):
    """fitting_variants' candidates with the model state on the device; returns whether any
    fitted."""
    pp, dp, tp = mesh
    fitted = False
    for ckpt in ckpts:
        fitted_any = settled = False
        work = run.work_of(ctx.table, ckpt)
        for zeros in groups:
            # Partial: only the level saving most memory (the fewest layers; none faster).
            for zero in sorted(zeros, reverse=True) if ckpt == checkpointing.PARTIAL else zeros:
                for shard, layerwise in _data_options(ctx, mesh, zero, ckpt):
                    cfg = ParallelConfig(
                        *(dp, tp, pp, m, schedule, v, zero, ckpt, shard, ctx.cp, ctx.cp_comm),
                        fp8=ctx.fp8,
                        ep=ctx.ep,
                        etp=ctx.etp,
                        layerwise_zero=layerwise,
                    )
                    found = _evaluated(ctx, run, cfg, mbs, work)
                    yield from found
                    if any(c is not None for c in found):
                        fitted_any = True
                        # the split chosen for time fits (predict_variant's first); a split
                        # the stage DP unbalanced to fit memory may be slower than a higher
                        # level or more checkpointing under the balanced one
                        settled = settled or found[0] is not None
                        if schedule == "interleaved_zero_bubble" and ckpt != checkpointing.PARTIAL:
                            later = zeros[zeros.index(zero) :]  # and the group's later levels
                            dominated = (
                                ("interleaved_1f1b", v, z, ckpt, shard, ctx.cp) for z in later
                            )
                            ctx.dominated.update(dominated)
                if settled or ckpt == checkpointing.PARTIAL:
                    break  # later levels of the group are never faster (partial: nor fit)
        fitted = fitted or fitted_any
        # checkpointing only adds time, so the first mode that fits ends the search here;
        # but partial checkpointing and the activation stores compete (recompute or copies)
        if settled and (ckpt != checkpointing.PARTIAL or not any(map(store_of, ckpts))):
            return True
    return fitted


def _data_options(ctx: VariantContext, mesh: tuple, zero: int, ckpt) -> list[tuple[int, bool]]:
    """(HSDP's dp_shard, layer-wise ZeRO) pairs to try at this ZeRO level: layer-wise ZeRO
    beside plain ZeRO-3 where it applies (planner.parallel.data), only it where pinned on."""
    pp, dp, tp = mesh
    per_node = ctx.inputs.cluster.devices_per_node
    pinned = ctx.options.layerwise_zero
    out = []
    for shard in shards(ctx.options, dp, tp, zero, per_node, ctx.cp, ctx.ep):
        why = pinned is not False and data.layerwise_refusal(
            pp,
            dp,
            zero,
            0 < shard < dp,
            False,  # (offload: the search's own pass, planner.search.variant.offloaded)
            ctx.ep,
            ckpt == checkpointing.PARTIAL,
            ctx.inputs.training.runtime,
        )
        if not pinned:
            out.append((shard, False))
        if pinned is not False and not why:
            out.append((shard, True))
    return out


def shards(
    options: SearchOptions, dp: int, tp: int, zero: int, per_node: int, cp: int = 1, ep: int = 1
) -> tuple:
    """HSDP's dp_shard values to try (0: shard over all of dp), or the user's pin; none but
    all of dp with context or expert parallelism."""
    if cp > 1 or ep > 1:
        return (0,)
    pinned = options.dp_shard
    if pinned is not None:
        if pinned in (0, dp):
            return (0,)
        return (pinned,) if zero and pinned < dp and dp % pinned == 0 else ()
    return data.shard_options(dp, tp, zero, per_node)


def _evaluated(
    ctx: VariantContext, run: SearchRun, cfg: ParallelConfig, mbs: int, work: float
) -> list:
    """predict_variant's candidates for `cfg`, or none where it is dominated, fits under no
    split, or its lower bound cannot win."""
    training, capacity = ctx.inputs.training, ctx.inputs.cluster.usable_memory_bytes
    key = (cfg.schedule, cfg.virtual_stages, cfg.zero, cfg.checkpointing, cfg.dp_shard, cfg.cp)
    if key in ctx.dominated:
        run.prune()  # the zero-bubble schedule fits here and is never slower
        return []
    # Pruned if its lower bound cannot win or it fits under no split (as if predicted not
    # to fit): the time bound first, the cheaper, which prunes most variants that fit too.
    bound = step_lower_bound(
        ctx.table,
        cfg,
        training.optimizer,
        ctx.cm.mem_rate,
        work + partial_recompute_floor(ctx.table, cfg, training, capacity),
        # (layer-wise ZeRO moves some layers' gathers to a once-a-step sync)
        zero3=None if cfg.layerwise_zero else run.zero3_of(cfg),
        p2p=run.p2p_of(ctx.table, cfg),
    )
    if run.beaten(bound) or fits_nowhere(
        ctx.table, cfg, training.dtype, training.optimizer, capacity, training.runtime
    ):
        run.prune()
        return []
    found = list(predict_variant(ctx, cfg, mbs))
    run.count_evaluated(len(found))
    return found


def predict_variant(ctx: VariantContext, cfg: ParallelConfig, mbs: int):
    """Predict one configuration with the balanced and the stage-DP partition (with
    interleaving, the DP's chunks only where the balanced ones do not fit: the chunk DP for
    every interleaved variant cost the suite's search 1.6x its time; with a V-shaped schedule,
    its device-balanced split, and the balanced one only where that does not fit)."""
    inputs = ctx.inputs
    balanced = split_layers(max(ctx.facts.num_layers, 1), cfg.pp * cfg.virtual_stages)
    range_options: list = [None]
    if cfg.pp > 1 and cfg.virtual_stages == 1:
        found = dp_ranges(ctx.table, cfg, inputs.training, inputs.cluster, ctx.cm)
        if found and found != balanced:
            range_options.append(found)
    v_split = _v_split(ctx, cfg) if cfg.schedule in V_SHAPED else None
    if v_split and v_split != balanced:  # its replay is the costly part: the balanced split
        range_options = [v_split]  # only where this one does not fit
    seen: list = []  # each split is predicted once, whichever way it was reached
    while range_options:
        ranges = range_options.pop(0)
        if ranges in seen:
            continue
        seen.append(ranges)
        pred = predict(
            ctx.facts, inputs.cluster, inputs.training, cfg, table=ctx.table, ranges=ranges
        )
        if not pred.fits_in_memory:
            if ranges is not None and ranges == v_split:
                range_options.append(None)
            elif ranges is None and cfg.virtual_stages > 1:
                found = _chunk_split(ctx, cfg)
                if found and found != balanced:
                    range_options.append(found)
            yield None
            continue
        if cfg.layerwise_zero and ctx.options.layerwise_zero is None and _all_resharded(pred):
            yield None  # every layer at ZeRO-3: plain ZeRO-3's plan, evaluated beside it
            continue
        ckpt = checkpointing.modes().index(cfg.checkpointing)  # sortable: none ... full
        key = (cfg.pp, cfg.dp, cfg.tp, mbs, cfg.schedule, cfg.zero, ckpt, cfg.dp_shard, cfg.cp)
        key += (cfg.offload, cfg.fp8 or "", cfg.cp_comm, cfg.ep, cfg.etp, cfg.layerwise_zero)
        key += (ctx.kind, tuple(ranges or ()))
        yield Candidate(
            pred.step_time_s,
            key,
            cfg,
            ctx.kind,
            mbs,
            tuple(ranges) if ranges else None,
            pred.peak_memory_bytes,
            pred,
        )


def _all_resharded(pred: Prediction) -> bool:
    """Whether layer-wise ZeRO put every layer of every stage at ZeRO-3."""
    return all(
        st.resharded is None or st.resharded >= b - a
        for st, (a, b) in zip(pred.stages, pred.ranges, strict=True)
    )


def _chunk_split(ctx: VariantContext, cfg: ParallelConfig):
    """The stage DP's chunks, kept with the table per (pp, v, checkpointing): with
    interleaving it splits by time alone (every chunk's send costs the same), the same for
    every dp, ZeRO level and micro-batch count."""
    key = f"chunk_split:{cfg.pp}:{cfg.virtual_stages}:{cfg.checkpointing}"
    if key not in ctx.table.derived:
        inputs = ctx.inputs
        ctx.table.derived[key] = dp_ranges(ctx.table, cfg, inputs.training, inputs.cluster, ctx.cm)
    return ctx.table.derived[key]


def _v_split(ctx: VariantContext, cfg: ParallelConfig):
    """ZB-V's device-balanced split (planner.inter_op.v_split), kept with the table per
    (pp, checkpointing)."""
    key = f"v_split:{cfg.pp}:{cfg.checkpointing}"
    if key not in ctx.table.derived:
        inputs = ctx.inputs
        costs = stage_costs(ctx.table, cfg, inputs.training, inputs.cluster, ctx.cm)
        ctx.table.derived[key] = v_ranges(costs, cfg.pp)
    return ctx.table.derived[key]
