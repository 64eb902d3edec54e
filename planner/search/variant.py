"""One configuration of the search evaluated: predict() with the balanced partition of the
layers and with the stage DP's (over pp x v chunks with interleaving); each that fits is a
Candidate."""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.cost.model import CostModel
from planner.cost.schedule_v import V_SHAPED
from planner.evaluate.config import ParallelConfig, split_layers
from planner.evaluate.layer_table import LayerTable
from planner.evaluate.predict import GraphFacts, Prediction, predict
from planner.inter_op.stage_inputs import dp_ranges, stage_costs
from planner.inter_op.v_split import v_ranges
from planner.parallel import checkpointing
from planner.request import PlanningInputs
from planner.search.space import SearchOptions


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
    # (schedule, chunks, ZeRO level, checkpointing) an evaluated schedule dominates: the
    # zero-bubble schedule fitted with the same chunks, so interleaved 1F1B (the same stage
    # times, a fill and drain at least as long) cannot be faster there.
    dominated: set[tuple] = field(default_factory=set)


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
        ckpt = checkpointing.MODES.index(cfg.checkpointing)  # sortable: none, selective, full
        key = (cfg.pp, cfg.dp, cfg.tp, mbs, cfg.schedule, cfg.zero, ckpt)
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
