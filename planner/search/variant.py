"""One configuration of the search evaluated: predict() with the balanced partition of the
layers and with the stage DP's (over pp x v chunks with interleaving); each that fits is a
Candidate."""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.cost.model import CostModel
from planner.evaluate.config import ParallelConfig, split_layers
from planner.evaluate.layer_table import LayerTable
from planner.evaluate.predict import GraphFacts, Prediction, predict
from planner.inter_op.stage_inputs import dp_ranges
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
    """Predict one configuration with the balanced and the stage-DP partition."""
    inputs = ctx.inputs
    range_options: list = [None]
    if cfg.pp > 1:
        found = dp_ranges(ctx.table, cfg, inputs.training, inputs.cluster, ctx.cm)
        chunks = cfg.pp * cfg.virtual_stages
        if found and found != split_layers(max(ctx.facts.num_layers, 1), chunks):
            range_options.append(found)
    for ranges in range_options:
        pred = predict(
            ctx.facts, inputs.cluster, inputs.training, cfg, table=ctx.table, ranges=ranges
        )
        if not pred.fits_in_memory:
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
