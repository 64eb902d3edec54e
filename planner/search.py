"""The whole search: trace -> per (micro-batch, tp) a tensor-parallel layout (the intra-op ILP,
and Megatron's as a second candidate) -> per mesh (pp, dp, tp) and training options the stage
DP -> the evaluator -> the best Plan, its top-k alternatives and an explanation.

Search space (executable by default, DESIGN.md): all stages share one logical mesh (dp, tp);
pp x dp x tp = devices; tp groups fit in a node or span whole nodes; micro-batch sizes divide
the per-replica batch (up to 32); schedules
1F1B and interleaved 1F1B (2 chunks per device); ZeRO 0-3 on dp; per-layer checkpointing.
Pruning rules, each exact under the cost model:
- ZeRO-1 communicates as much as ZeRO-0 (reduce-scatter + all-gather = all-reduce) and shards
  the optimizer step, so it is never slower; ZeRO-2 takes the same time with less memory, so
  it is tried only when ZeRO-1 does not fit, and ZeRO-0 only when 1 and 2 are excluded.
  ZeRO-3 trades per-micro-batch gathers (overlapped with compute) for the gradient sync, so
  it is always evaluated too;
- checkpointing only adds time, so it is tried only when no ZeRO level fits without it;
- GPipe takes the same time as 1F1B with more activation memory, so it never wins.
Both the stage DP's partition and the balanced one are evaluated (the DP minimises the
pipeline time, the evaluator adds the data-parallel sync and the optimizer step).
Results are deterministic: candidates are ordered by predicted step time, then by a fixed
key; ILP solves may run in a process pool and are collected by key, not completion order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context

from planner.cluster import ClusterProfile
from planner.cost_model import CostModel
from planner.errors import AutoparError, InputError
from planner.estimate import ParallelConfig, evaluate, node_costs, split_layers
from planner.executable import executable
from planner.graph import OpGraph, cluster_layers, graph_at, rescale_batch
from planner.ilp import InfeasibleError, ShardingProblem, solve
from planner.layouts import ilp_layouts
from planner.limits import MAX_DEVICES
from planner.megatron import NodeLayout, tensor_parallel_layout
from planner.memory import bytes_per_param, state_bytes_per_param
from planner.mesh import LogicalMesh
from planner.plan import Alternative, ModelRef, Plan, SearchInfo, TrainingSettings
from planner.schedules import inflight_microbatches
from planner.stage_dp import StageCosts, partition_stages

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class SearchOptions:
    microbatch_sizes: tuple[int, ...] | None = None  # default: divisors of the batch, <= 32
    schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b")
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    checkpointing: tuple[bool, ...] = (False, True)
    layouts: tuple[str, ...] = ("ilp", "megatron")
    max_tp: int | None = None  # default: no cap (tp groups may span nodes)
    top_k: int = 5
    workers: int = 1
    solver: str = "highs"
    ilp_time_limit: float = 60.0
    executable_only: bool = False  # only strategies the executor implements today
    mesh: tuple[int, int, int] | None = None  # pin (pp, dp, tp); default: every valid mesh


@dataclass(frozen=True)
class Candidate:
    step_time_s: float
    key: tuple
    config: ParallelConfig
    layout: str
    mbs: int
    ranges: tuple[tuple[int, int], ...] | None
    peak_memory: int
    plan: Plan = field(compare=False)


@dataclass
class SearchResult:
    plan: Plan
    candidates: list[Candidate]
    ilp_calls: int
    ilp_max_vars: int


class NoFeasiblePlan(AutoparError):
    def __init__(self, lines: list[str]):
        self.explanation = lines
        super().__init__(" ".join(lines))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pinned_options(
    mesh: tuple[int, int, int] | list[int] | None = None,
    schedule: str | None = None,
    zero: int | None = None,
    checkpointing: bool | None = None,
    microbatch_size: int | None = None,
) -> dict:
    """SearchOptions fields for the parts of a plan a user pins (None: searched)."""
    out: dict = {}
    if mesh is not None:
        out["mesh"] = tuple(mesh)
    if schedule is not None:
        out["schedules"] = (schedule,)
    if zero is not None:
        out["zero_stages"] = (zero,)
    if checkpointing is not None:
        out["checkpointing"] = (checkpointing,)
    if microbatch_size is not None:
        if microbatch_size <= 0:
            raise InputError("microbatch_size", f"{microbatch_size}", "an integer >= 1")
        out["microbatch_sizes"] = (microbatch_size,)
    return out


def meshes(cluster: ClusterProfile, num_layers: int, max_tp: int | None) -> list[tuple[int, ...]]:
    """(pp, dp, tp) with pp * dp * tp = devices and pp <= layers; tp groups either fit in a
    node or span whole nodes (so every group sees the same links)."""
    n = cluster.num_devices
    dpn = cluster.devices_per_node
    out = []
    for pp in _divisors(n):
        if pp > num_layers:
            continue
        for tp in _divisors(n // pp):
            if max_tp is not None and tp > max_tp:
                continue
            if dpn % tp == 0 or tp % dpn == 0:
                out.append((pp, n // pp // tp, tp))
    return out


# --- tensor-parallel layouts, cached and optionally solved in worker processes -------------
def _solve_ilp(args: tuple) -> tuple[dict[str, NodeLayout] | None, int]:
    graph_json, cluster_json, dtype, attention, optimizer, tp, solver, limit, only = args
    from planner.cluster import parse_profile

    graph = OpGraph.from_json(graph_json)
    cluster = parse_profile(cluster_json)
    return _ilp_layouts(graph, cluster, dtype, attention, optimizer, tp, solver, limit, only)


def _ilp_layouts(graph, cluster, dtype, attention, optimizer, tp, solver, limit, only=False):
    mesh = LogicalMesh.contiguous(cluster, 0, (1, tp))
    cm = CostModel(cluster, dtype, attention=attention)
    # Time-optimal tensor parallelism; memory is handled by pp, ZeRO and checkpointing
    # outside, and checked exactly by the evaluator.
    problem = ShardingProblem(
        graph,
        mesh,
        cm,
        memory_budget=math.inf,
        optimizer=optimizer,
        zero=False,
        executable_only=only,
    )
    try:
        solution = solve(problem, solver, limit)
    except InfeasibleError:
        return None, 0
    return ilp_layouts(problem, solution), solution.stats.variables


class _Layouts:
    def __init__(
        self, base: OpGraph, second: OpGraph | None, cluster, training, options, progress: Progress
    ):
        self.base, self.second = base, second
        self.cluster, self.training, self.options = cluster, training, options
        self.progress = progress
        self.graphs: dict[int, OpGraph] = {}
        self.cache: dict[tuple[str, int, int], dict[str, NodeLayout] | None] = {}
        self.ilp_calls = 0
        self.ilp_max_vars = 0

    def graph(self, mbs: int) -> OpGraph:
        if mbs not in self.graphs:
            self.graphs[mbs] = cluster_layers(graph_at(self.base, self.second, mbs))
        return self.graphs[mbs]

    def prepare(self, keys: list[tuple[int, int]]) -> None:
        """Solve the ILP for every (micro-batch size, tp) up front, in parallel if asked."""
        todo = [(mbs, tp) for mbs, tp in keys if tp > 1 and "ilp" in self.options.layouts]
        t = self.training
        args = [
            (
                self.graph(mbs).to_json(),
                self.cluster.model_dump(mode="json"),
                t.dtype,
                t.attention,
                t.optimizer,
                tp,
                self.options.solver,
                self.options.ilp_time_limit,
                self.options.executable_only,
            )
            for mbs, tp in todo
        ]
        if self.options.workers > 1 and len(todo) > 1:
            with ProcessPoolExecutor(self.options.workers, mp_context=get_context("fork")) as ex:
                results = []
                for i, res in enumerate(ex.map(_solve_ilp, args)):
                    results.append(res)
                    self.progress("tensor-parallel layouts (ILP)", i + 1, len(todo))
        else:
            results = []
            for i, (mbs, tp) in enumerate(todo):
                results.append(
                    _ilp_layouts(
                        self.graph(mbs),
                        self.cluster,
                        t.dtype,
                        t.attention,
                        t.optimizer,
                        tp,
                        self.options.solver,
                        self.options.ilp_time_limit,
                        self.options.executable_only,
                    )
                )
                self.progress("tensor-parallel layouts (ILP)", i + 1, len(todo))
        for (mbs, tp), (layouts, nvars) in zip(todo, results, strict=True):
            self.cache[("ilp", mbs, tp)] = layouts
            self.ilp_calls += 1
            self.ilp_max_vars = max(self.ilp_max_vars, nvars)

    def get(self, kind: str, mbs: int, tp: int) -> dict[str, NodeLayout] | None:
        if tp == 1:
            kind = "megatron"  # nothing to choose on a 1-wide tp axis
        key = (kind, mbs, tp)
        if key not in self.cache:
            graph = self.graph(mbs)
            layout = tensor_parallel_layout(graph, tp)
            if self.options.executable_only and not all(
                executable(n.kind, layout[n.name].strategy) for n in graph.nodes
            ):
                layout = None  # e.g. Megatron's split of MoE experts: not executable yet
            self.cache[key] = layout
        return self.cache[key]


# --- stage partition from per-layer costs ---------------------------------------------------
def _dp_ranges(graph, costs, layouts, cfg: ParallelConfig, training, cluster, cm):
    """The stage DP over this configuration's per-layer time and memory."""
    n = max(graph.num_layers, 1)
    state = state_bytes_per_param(training.dtype, training.optimizer, cfg.zero, cfg.dp)
    time_l, static_l, act_l = [0.0] * n, [0.0] * n, [0.0] * n
    first = [0.0, 0.0, 0.0]
    last = [0.0, 0.0, 0.0]
    seen_layer = False
    inputs = graph.layer_input_bytes
    for node in graph.nodes:
        c = costs[node.name]
        t = c.fwd + c.bwd + c.comm_fwd + c.comm_bwd
        lay = layouts[node.name]
        params = sum(
            m.numel // (cfg.tp if lay.params.get(p, "R").startswith("S") else 1)
            for p, m in node.params.items()
            if p not in node.shared_params
        )
        if node.layer is not None:
            seen_layer = True
            time_l[node.layer] += t + ((c.fwd + c.comm_fwd) if cfg.checkpointing else 0.0)
            static_l[node.layer] += params * state
            act_l[node.layer] += 0 if cfg.checkpointing else c.saved
        else:
            bucket = last if seen_layer else first
            bucket[0] += t
            bucket[1] += params * state
            bucket[2] += c.saved
    if cfg.checkpointing:
        for i in range(n):
            act_l[i] += inputs[i]
    mid = graph.cut_bytes[n // 2] if n > 1 else 0
    p2p = 2 * cm.send_recv(mid / cfg.tp, cm.p2p_axis(0, cfg.dp * cfg.tp)) if cfg.pp > 1 else 0
    reserve = max(act_l) if cfg.checkpointing else 0.0
    costs_in = StageCosts(
        layer_time=time_l,
        layer_static=static_l,
        layer_act=act_l,
        first_time=first[0],
        last_time=last[0],
        first_static=first[1],
        last_static=last[1],
        first_act=first[2],
        last_act=last[2],
        stage_overhead=p2p,
        capacity=cluster.device.memory_bytes - reserve,
    )
    inflight = [
        inflight_microbatches(cfg.schedule, s, cfg.pp, cfg.microbatches) for s in range(cfg.pp)
    ]
    part = partition_stages(costs_in, cfg.pp, cfg.microbatches, inflight)
    return list(part.ranges) if part else None


# --- the search ------------------------------------------------------------------------------
def search(
    graph: OpGraph,
    cluster: ClusterProfile,
    training: TrainingSettings,
    model: ModelRef,
    *,
    tokens_per_sample: int | None = None,
    options: SearchOptions | None = None,
    progress: Progress | None = None,
    second_trace: OpGraph | None = None,
) -> SearchResult:
    """Plan training of the model traced in `graph`. With `second_trace` (the same model at
    another batch size) every micro-batch size is extrapolated exactly; without it the graph
    is rescaled linearly (exact for models whose work is proportional to the batch)."""
    started = time.perf_counter()
    options = options or SearchOptions()
    say = progress or (lambda _step, _done, _total: None)
    graph = cluster_layers(graph)
    num_layers = max(graph.num_layers, 1)
    gb = training.global_batch_size
    layouts = _Layouts(graph, second_trace, cluster, training, options, say)
    cm = CostModel(cluster, training.dtype, attention=training.attention)
    mesh_list = meshes(cluster, num_layers, options.max_tp)
    if options.mesh is not None:
        if tuple(options.mesh) not in mesh_list:
            pp, dp, tp = options.mesh
            raise InputError(
                "mesh",
                f"{pp}x{dp}x{tp} is not a mesh this search can use on {cluster.num_devices} "
                f"devices ({cluster.devices_per_node} per node) and {num_layers} layers",
                "pp x dp x tp equal to the device count, pp <= layers, tp within a node or "
                "whole nodes; one of " + ", ".join("x".join(map(str, m)) for m in mesh_list),
            )
        mesh_list = [tuple(options.mesh)]
    combos = []
    for pp, dp, tp in mesh_list:
        if gb % dp:
            continue
        sizes = options.microbatch_sizes or [b for b in range(1, 33) if (gb // dp) % b == 0]
        for mbs in sizes:
            if gb % (dp * mbs) == 0:
                combos.append((pp, dp, tp, mbs))
    layouts.prepare(sorted({(mbs, tp) for _, _, tp, mbs in combos}))
    candidates: list[Candidate] = []
    evaluated = 0
    cost_cache: dict[tuple, dict] = {}
    for idx, (pp, dp, tp, mbs) in enumerate(combos):
        say("pipeline and data-parallel options", idx + 1, len(combos))
        g = layouts.graph(mbs)
        m = gb // (dp * mbs)
        mesh = LogicalMesh.contiguous(cluster, 0, (dp, tp))
        for kind in options.layouts:
            lay = layouts.get(kind, mbs, tp)
            if lay is None or (tp == 1 and kind != options.layouts[0]):
                continue
            ckey = (kind if tp > 1 else "megatron", mbs, tp, dp)
            if ckey not in cost_cache:
                cost_cache[ckey] = node_costs(g, lay, cm, mesh)
            costs = cost_cache[ckey]
            for schedule in options.schedules:
                v = 2 if schedule == "interleaved_1f1b" else 1
                if v > 1 and (pp == 1 or num_layers < pp * v):
                    continue
                if options.executable_only and kind != "megatron" and tp > 1 and pp * v > 1:
                    continue  # a per-node tp layout runs only on one stage (graph mode)
                ctx = _Context(
                    g, costs, lay, kind, cluster, training, model, options, tokens_per_sample, cm
                )
                for found in _fitting_variants(ctx, pp, dp, tp, m, mbs, schedule, v):
                    evaluated += found[1]
                    if found[0] is not None:
                        candidates.append(found[0])
    if not candidates:
        raise NoFeasiblePlan(_not_fit_lines(graph, cluster, training, model, tokens_per_sample))
    candidates.sort(key=lambda c: (round(c.step_time_s, 12), c.key))
    best = candidates[0]
    g = layouts.graph(best.mbs)
    lay = layouts.get(best.layout, best.mbs, best.config.tp)
    solver = f"{options.solver} ILP per (micro-batch, tp) + stage DP"
    plan = evaluate(
        g,
        cluster,
        training,
        best.config,
        model,
        tokens_per_sample=tokens_per_sample,
        layouts=lay,
        ranges=list(best.ranges) if best.ranges else None,
        solver=solver,
        started=started,
        tp_layout=_tp_layout(best.layout),
    )
    alternatives = _alternatives(candidates, options.top_k)
    info = SearchInfo(
        time_s=time.perf_counter() - started,
        solver=solver,
        ilp_calls=layouts.ilp_calls,
        ilp_max_vars=layouts.ilp_max_vars,
        candidates_evaluated=evaluated,
    )
    plan = plan.model_copy(
        update={
            "alternatives": alternatives,
            "search": info,
            "explanation": plan.explanation + _why(best, candidates),
        }
    )
    return SearchResult(plan, candidates, layouts.ilp_calls, layouts.ilp_max_vars)


@dataclass(frozen=True)
class _Context:
    """What every variant of one (mesh, micro-batch, layout) shares."""

    graph: OpGraph
    costs: dict
    layouts: dict[str, NodeLayout]
    kind: str
    cluster: ClusterProfile
    training: TrainingSettings
    model: ModelRef
    options: SearchOptions
    tokens: int | None
    cm: CostModel


def _fitting_variants(ctx: _Context, pp, dp, tp, m, mbs, schedule, v):
    """Yield (candidate or None, evaluations) for the ZeRO/checkpointing variants of one
    configuration that can win (see the pruning rules in the module docstring)."""
    order = (1, 2, 0) if dp > 1 else (0,)
    groups = [[z for z in order if z in ctx.options.zero_stages]]
    if dp > 1 and 3 in ctx.options.zero_stages:
        groups.append([3])
    groups = [grp for grp in groups if grp] or [[0]]
    for ckpt in ctx.options.checkpointing:
        fitted_any = False
        for zeros in groups:
            for zero in zeros:
                cfg = ParallelConfig(
                    dp=dp,
                    tp=tp,
                    pp=pp,
                    microbatches=m,
                    schedule=schedule,
                    virtual_stages=v,
                    zero=zero,
                    checkpointing=ckpt,
                )
                found = list(_variant(ctx, cfg, mbs))
                yield from found
                if any(c is not None for c, _ in found):
                    fitted_any = True
                    break  # later stages of this group are never faster
        if fitted_any:
            return  # checkpointing only adds time


def _tp_layout(kind: str) -> str:
    return "megatron" if kind == "megatron" else "per_node"


def _variant(ctx: _Context, cfg: ParallelConfig, mbs: int):
    """Evaluate one configuration with the balanced and the stage-DP partition."""
    range_options: list = [None]
    if cfg.pp > 1 and cfg.virtual_stages == 1:
        dp_ranges = _dp_ranges(
            ctx.graph, ctx.costs, ctx.layouts, cfg, ctx.training, ctx.cluster, ctx.cm
        )
        if dp_ranges and dp_ranges != split_layers(max(ctx.graph.num_layers, 1), cfg.pp):
            range_options.append(dp_ranges)
    for ranges in range_options:
        plan = evaluate(
            ctx.graph,
            ctx.cluster,
            ctx.training,
            cfg,
            ctx.model,
            tokens_per_sample=ctx.tokens,
            layouts=ctx.layouts,
            costs=ctx.costs,
            ranges=ranges,
            detail=False,
            tp_layout=_tp_layout(ctx.kind),
        )
        if not plan.predicted.fits_in_memory:
            yield None, 1
            continue
        key = (
            cfg.pp,
            cfg.dp,
            cfg.tp,
            mbs,
            cfg.schedule,
            cfg.zero,
            cfg.checkpointing,
            ctx.kind,
            tuple(ranges or ()),
        )
        candidate = Candidate(
            plan.predicted.step_time_s,
            key,
            cfg,
            ctx.kind,
            mbs,
            tuple(ranges) if ranges else None,
            plan.predicted.peak_memory_bytes,
            plan,
        )
        yield candidate, 1


def _summary(c: Candidate) -> str:
    cfg = c.config
    parts = [
        f"pp{cfg.pp} dp{cfg.dp} tp{cfg.tp}",
        f"mbs {c.mbs} x {cfg.microbatches}",
        cfg.schedule,
        f"zero{cfg.zero}",
    ]
    if cfg.checkpointing:
        parts.append("ckpt")
    if cfg.tp > 1:
        parts.append(f"{c.layout} tp layout")
    if c.ranges:
        parts.append("DP stages")
    return ", ".join(parts)


def _alternatives(candidates: list[Candidate], k: int) -> list[Alternative]:
    out, seen = [], set()
    for c in candidates[1:]:
        cfg = c.config
        shape = (cfg.pp, cfg.dp, cfg.tp, cfg.schedule, cfg.microbatches)
        if shape in seen:
            continue
        seen.add(shape)
        out.append(
            Alternative(
                summary=_summary(c),
                mesh=[cfg.pp, cfg.dp, cfg.tp],
                schedule=cfg.schedule,
                microbatches=cfg.microbatches,
                step_time_s=c.step_time_s,
                peak_memory_bytes=c.peak_memory,
            )
        )
        if len(out) >= k:
            break
    return out


def _why(best: Candidate, candidates: list[Candidate]) -> list[str]:
    lines = [f"Chosen: {_summary(best)}, out of {len(candidates)} fitting candidates."]
    bc = best.config
    other = next(
        (
            c
            for c in candidates[1:]
            if (c.config.pp, c.config.dp, c.config.tp) != (bc.pp, bc.dp, bc.tp)
        ),
        None,
    )
    if other is None:
        return lines
    a, b = best.plan.predicted, other.plan.predicted
    gain = (b.step_time_s - a.step_time_s) / b.step_time_s
    lines.append(
        f"Next best mesh: {_summary(other)} at {b.step_time_s:.3f} s per step ({gain:.1%} slower)."
    )

    def clearly_less(x: float, y: float) -> bool:
        """Lower by at least 2% and by at least 1% of the step time."""
        return x < 0.98 * y and y - x > 0.01 * a.step_time_s

    reasons = []
    if a.bubble_fraction + 0.01 < b.bubble_fraction:
        reasons.append(
            f"a smaller pipeline bubble ({a.bubble_fraction:.1%} vs {b.bubble_fraction:.1%})"
        )
    if clearly_less(a.comm_s, b.comm_s):
        reasons.append(f"less exposed communication ({a.comm_s:.3f} s vs {b.comm_s:.3f} s)")
    ba, bb = a.breakdown, b.breakdown
    if clearly_less(ba.get("stage_compute_s", 0), bb.get("stage_compute_s", 0)):
        reasons.append("less compute per micro-batch on the slowest stage")
    if clearly_less(a.peak_memory_bytes, b.peak_memory_bytes) and not reasons:
        reasons.append("the same speed class with less memory")
    if reasons:
        lines.append("It wins by " + "; ".join(reasons) + ".")
    else:
        lines.append(
            "The two are within the cost model's noise; the tie is broken by a "
            "fixed order (fewer pipeline stages, then less data parallelism)."
        )
    return lines


def _not_fit_lines(graph, cluster, training, model, tokens) -> list[str]:
    per = bytes_per_param(training.dtype, training.optimizer)
    state = graph.param_count * (per.weights + per.grads + per.optimizer)
    cap = cluster.device.memory_bytes
    n = cluster.num_devices
    lines = [
        f"No configuration fits: the model's parameters, gradients and optimizer state alone "
        f"take {state / 2**30:.1f} GiB ({state / n / 2**30:.2f} GiB per device if spread over "
        f"all {n} devices) against {cap / 2**30:.1f} GiB per device, before activations.",
    ]
    tried = cluster.nodes
    for factor in (2, 4, 8, 16, 32, 64):
        if cluster.nodes * factor * cluster.devices_per_node > MAX_DEVICES:
            break
        bigger = cluster.with_nodes(cluster.nodes * factor)
        tried = bigger.nodes
        if _fits_somewhere(graph, bigger, training, model, tokens):
            lines.append(
                f"The smallest cluster that fits has {bigger.nodes} nodes "
                f"({bigger.num_devices} devices of {cluster.device.name})."
            )
            return lines
    lines.append(f"It does not fit on {tried} nodes either.")
    return lines


def _fits_somewhere(graph, cluster, training, model, tokens) -> bool:
    """A quick feasibility probe: Megatron layout, ZeRO-3, checkpointing, micro-batch 1."""
    n = max(graph.num_layers, 1)
    g1 = rescale_batch(graph, 1)
    for pp, dp, tp in meshes(cluster, n, None):
        if training.global_batch_size % dp:
            continue
        cfg = ParallelConfig(
            dp=dp,
            tp=tp,
            pp=pp,
            microbatches=training.global_batch_size // dp,
            zero=3 if dp > 1 else 0,
            checkpointing=True,
        )
        plan = evaluate(g1, cluster, training, cfg, model, tokens_per_sample=tokens, detail=False)
        if plan.predicted.fits_in_memory:
            return True
    return False
