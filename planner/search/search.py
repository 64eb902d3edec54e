"""The search: per (micro-batch, tp) a tensor-parallel layout (the intra-op ILP, and
Megatron's as a second candidate); per mesh (pp, dp, tp) and training options the stage DP;
predict() per candidate; to_plan() for the winner, with its top-k alternatives and why.

Pruning, each exact under the cost model, lives with its technique (planner.parallel): ZeRO
levels in data.zero_groups; checkpointing only adds time, so it is tried only when no ZeRO
level fits without it; GPipe never beats 1F1B (pipeline.SEARCHED_SCHEDULES). Both the stage
DP's partition and the balanced one are predicted (the DP minimises the pipeline time;
predict adds the data-parallel sync and the optimizer step). Results are deterministic:
candidates are ordered by predicted step time, then by a fixed key; ILP solves may run in a
process pool and are collected by key, not completion order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from planner.cluster.mesh import LogicalMesh
from planner.cost.model import CostModel
from planner.errors import AutoparError
from planner.evaluate.config import ParallelConfig, split_layers
from planner.evaluate.layer_table import LayerTable, build_table
from planner.evaluate.predict import Prediction, predict
from planner.evaluate.to_plan import to_plan
from planner.executable import GRAPH_FAMILIES, family_not_executable
from planner.inter_op.stage_inputs import dp_ranges
from planner.parallel import data, pipeline
from planner.parallel.tensor import tp_layout_name
from planner.plan import Plan, SearchInfo
from planner.request import PlanningInputs
from planner.search import explain
from planner.search.infeasible import no_executable_lines, not_fit_lines
from planner.search.layout_cache import LayoutCache, Progress
from planner.search.space import SearchOptions, combinations, mesh_list


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


@dataclass
class SearchResult:
    plan: Plan
    candidates: list[Candidate]  # every fitting one, best first
    ilp_calls: int
    ilp_max_vars: int
    layouts: LayoutCache

    def plan_for(self, candidate: Candidate) -> Plan:
        """The full Plan of any candidate (the search builds one only for the winner)."""
        return to_plan(
            candidate.prediction,
            self.layouts.graph(candidate.mbs),
            self.layouts.inputs.cluster,
            self.layouts.inputs.training,
            self.layouts.inputs.model,
            tokens_per_sample=self.layouts.inputs.tokens_per_sample,
            layouts=self.layouts.get(candidate.layout, candidate.mbs, candidate.config.tp),
            solver=self.plan.search.solver,
            tp_layout=tp_layout_name(candidate.layout),
        )


class NoFeasiblePlan(AutoparError):
    """Nothing to return: nothing fits in memory (`reason` "memory"), or, with
    executable_only, nothing the executor can run does ("executable")."""

    def __init__(self, lines: list[str], reason: str = "memory"):
        self.explanation = lines
        self.reason = reason
        super().__init__(" ".join(lines))


@dataclass(frozen=True)
class _Context:
    """What every variant of one (mesh, micro-batch, layout) shares."""

    inputs: PlanningInputs
    graph: object
    table: LayerTable
    layouts: dict
    kind: str
    options: SearchOptions
    cm: CostModel


def search(
    inputs: PlanningInputs, options: SearchOptions | None = None, progress: Progress | None = None
) -> SearchResult:
    """Plan training of the model in `inputs` on its cluster."""
    started = time.perf_counter()
    options = options or SearchOptions()
    say = progress or (lambda _step, _done, _total: None)
    cluster, training = inputs.cluster, inputs.training
    layouts = LayoutCache(inputs, options, say)
    num_layers = max(inputs.base.num_layers, 1)
    cm = CostModel(cluster, training.dtype, attention=training.attention)
    combos = combinations(
        mesh_list(cluster, num_layers, options, inputs.model.config),
        training.global_batch_size,
        options,
    )
    if options.executable_only and (why := family_not_executable(inputs.model.family)):
        raise NoFeasiblePlan([f"No executable plan: {why}."], reason="executable")
    layouts.prepare(sorted({(mbs, tp) for _, _, tp, mbs in combos}))
    graph_mode = inputs.model.family in GRAPH_FAMILIES  # runs any layout on any stages
    candidates: list[Candidate] = []
    evaluated = left_out = 0
    tables: dict[tuple, LayerTable] = {}
    for idx, (pp, dp, tp, mbs) in enumerate(combos):
        say("pipeline and data-parallel options", idx + 1, len(combos))
        g = layouts.graph(mbs)
        m = training.global_batch_size // (dp * mbs)
        for kind in options.layouts:
            lay = layouts.get(kind, mbs, tp)
            left_out += lay is None and options.executable_only
            if lay is None or (tp == 1 and kind != options.layouts[0]):
                continue
            tkey = (kind if tp > 1 else "megatron", mbs, tp)
            if tkey not in tables:
                tp_mesh = LogicalMesh.contiguous(cluster, 0, (1, tp))
                tables[tkey], _ = build_table(g, lay, cm, tp_mesh)
            ctx = _Context(inputs, g, tables[tkey], lay, kind, options, cm)
            for schedule in pipeline.searched_schedules(options.schedules, pp, m):
                v = pipeline.virtual_stages(schedule)
                if v > 1 and (pp == 1 or num_layers < pp * v):
                    continue
                if options.executable_only and kind != "megatron" and tp > 1 and not graph_mode:
                    left_out += 1  # a per-node tp layout runs in graph mode only
                    continue
                for found in _fitting_variants(ctx, pp, dp, tp, m, mbs, schedule, v):
                    evaluated += 1
                    if found is not None:
                        candidates.append(found)
    if not candidates and left_out:
        raise NoFeasiblePlan(no_executable_lines(left_out), reason="executable")
    if not candidates:
        raise NoFeasiblePlan(not_fit_lines(inputs.base, cluster, training))
    candidates.sort(key=lambda c: (round(c.step_time_s, 12), c.key))
    best = candidates[0]
    solver = f"{options.solver} ILP per (micro-batch, tp) + stage DP"
    plan = to_plan(
        best.prediction,
        layouts.graph(best.mbs),
        cluster,
        training,
        inputs.model,
        tokens_per_sample=inputs.tokens_per_sample,
        layouts=layouts.get(best.layout, best.mbs, best.config.tp),
        solver=solver,
        started=started,
        tp_layout=tp_layout_name(best.layout),
    )
    info = SearchInfo(
        time_s=time.perf_counter() - started,
        solver=solver,
        ilp_calls=layouts.ilp_calls,
        ilp_max_vars=layouts.ilp_max_vars,
        candidates_evaluated=evaluated,
    )
    plan = plan.model_copy(
        update={
            "alternatives": explain.alternatives(candidates, options.top_k),
            "search": info,
            "explanation": plan.explanation + explain.why(best, candidates),
        }
    )
    return SearchResult(plan, candidates, layouts.ilp_calls, layouts.ilp_max_vars, layouts)


def _fitting_variants(ctx: _Context, pp, dp, tp, m, mbs, schedule, v):
    """Yield a candidate (or None when it does not fit) per evaluation of the ZeRO and
    checkpointing variants of one configuration that can win."""
    groups = data.zero_groups(dp, ctx.options.zero_stages)
    for ckpt in ctx.options.checkpointing:
        fitted_any = False
        for zeros in groups:
            for zero in zeros:
                cfg = ParallelConfig(dp, tp, pp, m, schedule, v, zero, ckpt)
                found = list(_variant(ctx, cfg, mbs))
                yield from found
                if any(c is not None for c in found):
                    fitted_any = True
                    break  # later levels of this group are never faster
        if fitted_any:
            return  # checkpointing only adds time


def _variant(ctx: _Context, cfg: ParallelConfig, mbs: int):
    """Predict one configuration with the balanced and the stage-DP partition."""
    inputs = ctx.inputs
    range_options: list = [None]
    if cfg.pp > 1 and cfg.virtual_stages == 1:
        found = dp_ranges(ctx.table, cfg, inputs.training, inputs.cluster, ctx.cm)
        if found and found != split_layers(max(ctx.graph.num_layers, 1), cfg.pp):
            range_options.append(found)
    for ranges in range_options:
        pred = predict(
            ctx.graph,
            inputs.cluster,
            inputs.training,
            cfg,
            layouts=ctx.layouts,
            table=ctx.table,
            ranges=ranges,
        )
        if not pred.fits_in_memory:
            yield None
            continue
        key = (cfg.pp, cfg.dp, cfg.tp, mbs, cfg.schedule, cfg.zero, cfg.checkpointing)
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
