"""The intra-operator sharding ILP (Alpa section 4.2) for one stage on one logical mesh.

Variables
    s[v,k] in {0,1}   node v uses strategy k                        (build: solve)
    e[t,a,b] in [0,1] edge t carries placement a at its source and b at its destination
                      (a, b are the distinct placements of that tensor among the
                      strategies of the two ends)                    (build: _edge_terms)
Objective (seconds per micro-batch)
    min  sum_v w_v sum_k c[v,k] s[v,k]  +  sum_t w_t sum_{a,b} R_t[a,b] e[t,a,b]
    c[v,k] = compute + own communication + per-step gradient sync / micro-batches;
    R_t[a,b] = resharding time of edge t's tensor from a to b, forward and backward;
    w = multiplicity (1, or the number of identical blocks a representative stands for).
Constraints
    one_strategy[v]:   sum_k s[v,k] = 1                              (solve)
    edge_src[t,a]:     sum_b e[t,a,b] = sum_{k: out(k)=a} s[u,k]     (_edge_terms)
    edge_dst[t,b]:     sum_a e[t,a,b] = sum_{k: in(k)=b} s[v,k]      (_edge_terms)
    memory_budget:     sum_v w_v sum_k m[v,k] s[v,k] <= M            (_add_memory)
    m[v,k] = parameter elements x bytes per parameter (weights, grads, optimizer state)
             + activation bytes saved for backward x in-flight micro-batches.
The edge constraints are the tight linearisation of s[u,.] s[v,.] (marginals), which solves
in seconds where e >= s_u + s_v - 1 does not (see shared/TORCH_NOTES.md).

Identical repeated blocks (same ops, shapes and internal edges) are deduplicated: variables
exist only for the first block of each group; its choice is reused by the others and every
cost and memory term is weighted by the group size, so the objective is that of the full
problem restricted to uniform choices. Edges between blocks map onto the representative.

The solver's word is not trusted: the objective is recomputed from the chosen strategies, and
the status says whether the time limit cut the search (gap then from HiGHS's dual bound, or
unknown with CBC).
"""

from __future__ import annotations

import math
import time

from planner.cluster.mesh import LogicalMesh
from planner.cost.model import CostModel
from planner.errors import InputError
from planner.intra_op.ilp_model import LinearModel, solve_model
from planner.intra_op.sharding_problem import (
    EdgeRef,
    InfeasibleError,
    OwnChoices,
    ShardingProblem,
    ShardingSolution,
    SolveStats,
)
from planner.vocab import SOLVERS


def solve(
    problem: ShardingProblem, solver: str = "highs", time_limit: float | None = 60.0
) -> ShardingSolution:
    if solver not in SOLVERS:
        raise InputError("search.solver", f"unknown solver {solver!r}", ", ".join(SOLVERS))
    started = time.perf_counter()
    # The least memory any assignment needs (a budget below it is explained, not solved).
    lower = problem.min_memory()[0] if math.isfinite(problem.memory_budget) else 0.0
    if lower > problem.memory_budget:
        raise InfeasibleError(explain_infeasible(problem, lower))
    rep, mult, groups = problem.representatives()
    reps = [n for n in problem.nodes if mult[n.name] > 0]
    model = LinearModel()
    s_cols = {n.name: [model.column(True) for _ in problem.strategies[n.name]] for n in reps}
    for n in reps:
        w = mult[n.name]
        for k, strat in enumerate(problem.strategies[n.name]):
            model.add_cost(s_cols[n.name][k], w * problem.node_cost(strat))
    _edge_terms(model, problem, rep, s_cols)
    for n in reps:  # one strategy per node
        model.row(s_cols[n.name], [1.0] * len(s_cols[n.name]), 1.0, 1.0)
    _add_memory(model, problem, reps, mult, s_cols)
    build_s = time.perf_counter() - started
    result = solve_model(model, solver, time_limit)
    if result.status == "infeasible":
        raise InfeasibleError(explain_infeasible(problem, lower))
    index: dict[str, int] = {}
    for n in reps:
        values = [result.values[c] for c in s_cols[n.name]]
        index[n.name] = max(range(len(values)), key=values.__getitem__)
    # Block copies take the representative's strategy (same position in their own list);
    # costs and placements are the representative's, so they are priced without renaming.
    raw = {n.name: problem.strategies[n.name][index[rep[n.name]]] for n in problem.nodes}
    objective_s, breakdown = problem.evaluate(raw)
    stats = SolveStats(
        solver=solver,
        status=result.status,
        gap=result.gap,
        variables=model.num_cols,
        constraints=model.num_rows,
        build_s=build_s,
        solve_s=result.solve_s,
        nodes=len(problem.nodes),
        unique_nodes=len(reps),
        dedup_groups=groups,
    )
    per_edge = {
        (e.src, e.dst): problem.edge_cost(
            e, raw[e.src].outputs[e.src_output], raw[e.dst].inputs[e.dst_input]
        )
        for e in problem.edges
    }
    return ShardingSolution(
        choices=OwnChoices(problem, raw),
        objective_s=objective_s,
        breakdown=breakdown,
        memory=problem.memory_of(raw),
        stats=stats,
        mesh_shape=problem.mesh.shape,
        reshard_by_edge=per_edge,
    )


def _edge_terms(model: LinearModel, problem, rep, s_cols) -> None:
    """Edge resharding terms: linear where one side has a single placement, else edge
    variables with marginal constraints."""
    # Every original edge maps onto its ends' representatives; identical mapped edges (the
    # same edge in each block copy, or between consecutive copies) add up their weights.
    merged: dict[tuple, tuple[EdgeRef, int]] = {}
    for e in problem.edges:
        key = (rep[e.src], e.src_output, rep[e.dst], e.dst_input)
        first, w = merged.get(key, (e, 0))
        merged[key] = (first, w + 1)
    for (u, uo, v, vi), (e, w) in merged.items():
        su, sv = problem.strategies[u], problem.strategies[v]
        src_classes = _classes([s.outputs[uo] for s in su])
        dst_classes = _classes([s.inputs[vi] for s in sv])
        cost = {(a, b): w * problem.edge_cost(e, a, b) for a in src_classes for b in dst_classes}
        if not any(cost.values()):
            continue
        if u == v:  # a block's output feeding its own copy: a per-strategy term
            for k, s in enumerate(su):
                model.add_cost(s_cols[u][k], cost[(s.outputs[uo], s.inputs[vi])])
            continue
        if len(src_classes) == 1 or len(dst_classes) == 1:
            # One side is fixed: the cost is linear in the other side's choice.
            if len(src_classes) == 1:
                a = next(iter(src_classes))
                for k, s in enumerate(sv):
                    model.add_cost(s_cols[v][k], cost[(a, s.inputs[vi])])
            else:
                b = next(iter(dst_classes))
                for k, s in enumerate(su):
                    model.add_cost(s_cols[u][k], cost[(s.outputs[uo], b)])
            continue
        e_cols = {}
        for a in src_classes:
            for b in dst_classes:
                col = e_cols[(a, b)] = model.column(False)
                model.add_cost(col, cost[(a, b)])
        # Marginals: the edge's mass from placement a equals the source choosing a, and so on.
        for a, ks in src_classes.items():
            idx = [e_cols[(a, b)] for b in dst_classes] + [s_cols[u][k] for k in ks]
            model.row(idx, [1.0] * len(dst_classes) + [-1.0] * len(ks), 0.0, 0.0)
        for b, ks in dst_classes.items():
            idx = [e_cols[(a, b)] for a in src_classes] + [s_cols[v][k] for k in ks]
            model.row(idx, [1.0] * len(src_classes) + [-1.0] * len(ks), 0.0, 0.0)


def _classes(placements: list) -> dict:
    out: dict = {}
    for k, p in enumerate(placements):
        out.setdefault(p, []).append(k)
    return out


def _add_memory(model: LinearModel, problem, reps, mult, s_cols) -> None:
    if math.isinf(problem.memory_budget):
        return  # no budget: time-optimal sharding
    idx, val = [], []
    for n in reps:
        for k, s in enumerate(problem.strategies[n.name]):
            idx.append(s_cols[n.name][k])
            val.append(mult[n.name] * problem.node_memory(s))
    model.row(idx, val, -math.inf, problem.memory_budget)


def explain_infeasible(problem: ShardingProblem, lower: float) -> list[str]:
    """Which memory term overflows, by how much, and the smallest mesh that would fit."""
    _, choice = problem.min_memory()
    mem = problem.memory_of(choice)
    budget = problem.memory_budget
    terms = sorted(
        ((k, v) for k, v in mem.items() if k != "total"), key=lambda kv: kv[1], reverse=True
    )
    lines = [
        f"Does not fit: even the most memory-frugal sharding needs {_size(lower)} per "
        f"device on a {'x'.join(map(str, problem.mesh.shape))} mesh, "
        f"{_size(lower - budget)} over the {_size(budget)} budget.",
        "Largest terms: " + ", ".join(f"{k} {_size(v)}" for k, v in terms) + ".",
    ]
    fits = smallest_fitting_mesh(problem)
    if fits:
        lines.append(
            f"It fits on a {fits[0]}x{fits[1]} (dp x tp) mesh of {fits[0] * fits[1]} devices."
        )
    else:
        lines.append("It does not fit on any mesh of up to 4096 devices of this kind.")
    return lines


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def smallest_fitting_mesh(problem: ShardingProblem, limit: int = 4096) -> tuple[int, int] | None:
    cluster = problem.mesh.cluster
    n = len(problem.mesh.ranks) * 2
    while n <= limit:
        nodes = -(-n // cluster.devices_per_node)
        bigger = cluster.with_nodes(max(nodes, 1))
        for tp in sorted({d for d in (1, 2, 4, 8, 16, 32, 64) if n % d == 0}, reverse=True):
            mesh = LogicalMesh.contiguous(bigger, 0, (n // tp, tp))
            trial = ShardingProblem(
                problem.graph,
                mesh,
                CostModel(
                    bigger,
                    problem.cost_model.dtype,
                    attention=problem.cost_model.attention,
                    runtime=problem.cost_model.runtime.name,
                ),
                nodes=problem.nodes,
                microbatches=problem.microbatches,
                memory_budget=problem.memory_budget,
                inflight_microbatches=problem.inflight_microbatches,
                optimizer=problem.optimizer,
                dedup=False,
                zero=problem.zero,
            )
            if trial.min_memory()[0] <= problem.memory_budget:
                return (n // tp, tp)
        n *= 2
    return None
