"""The intra-operator sharding ILP (Alpa section 4.2) for one stage on one logical mesh.

Variables
    s[v,k] in {0,1}   node v uses strategy k                        (build: _node_vars)
    e[t,a,b] in [0,1] edge t carries placement a at its source and b at its destination
                      (a, b are the distinct placements of that tensor among the
                      strategies of the two ends)                    (build: _edge_vars)
Objective (seconds per micro-batch)
    min  sum_v w_v sum_k c[v,k] s[v,k]  +  sum_t w_t sum_{a,b} R_t[a,b] e[t,a,b]
    c[v,k] = compute + own communication + per-step gradient sync / micro-batches;
    R_t[a,b] = resharding time of edge t's tensor from a to b, forward and backward;
    w = multiplicity (1, or the number of identical blocks a representative stands for).
Constraints
    one_strategy[v]:   sum_k s[v,k] = 1                              (_add_one_hot)
    edge_src[t,a]:     sum_b e[t,a,b] = sum_{k: out(k)=a} s[u,k]     (_add_edge_marginals)
    edge_dst[t,b]:     sum_a e[t,a,b] = sum_{k: in(k)=b} s[v,k]      (_add_edge_marginals)
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
import warnings

import pulp

from planner.cluster.mesh import LogicalMesh
from planner.cost.model import CostModel
from planner.errors import InputError
from planner.graph.opgraph import OpNode
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
    lower, _ = problem.min_memory()
    if lower > problem.memory_budget:
        raise InfeasibleError(explain_infeasible(problem, lower))
    rep, mult, groups = problem.representatives()
    reps = [n for n in problem.nodes if mult[n.name] > 0]
    prob = pulp.LpProblem("sharding", pulp.LpMinimize)
    s_vars = _node_vars(prob, problem, reps)
    objective = []
    for n in reps:
        w = mult[n.name]
        for k, strat in enumerate(problem.strategies[n.name]):
            objective.append((w * problem.node_cost(strat), s_vars[n.name][k]))
    _edge_vars(prob, problem, rep, mult, s_vars, objective)
    _add_one_hot(prob, reps, s_vars)
    _add_memory(prob, problem, reps, mult, s_vars)
    prob += _linear(objective)
    build_s = time.perf_counter() - started
    num_vars = len(prob.variables())
    num_cons = prob.numConstraints()
    t0 = time.perf_counter()
    engine = _engine(solver, time_limit)
    prob.solve(engine)
    solve_s = time.perf_counter() - t0
    if pulp.LpStatus[prob.status] == "Infeasible":
        raise InfeasibleError(explain_infeasible(problem, lower))
    index: dict[str, int] = {}
    for n in reps:
        values = [v.value() or 0.0 for v in s_vars[n.name]]
        index[n.name] = max(range(len(values)), key=values.__getitem__)
    # Block copies take the representative's strategy (same position in their own list);
    # costs and placements are the representative's, so they are priced without renaming.
    raw = {n.name: problem.strategies[n.name][index[rep[n.name]]] for n in problem.nodes}
    objective_s, breakdown = problem.evaluate(raw)
    status, gap = _status(prob, solver, time_limit, solve_s)
    stats = SolveStats(
        solver=solver,
        status=status,
        gap=gap,
        variables=num_vars,
        constraints=num_cons,
        build_s=build_s,
        solve_s=solve_s,
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


def _engine(solver: str, time_limit: float | None):
    if solver == "highs":
        return pulp.HiGHS(msg=False, timeLimit=time_limit)
    with warnings.catch_warnings():
        # pulp 3.3 deprecates its bundled CBC binary in favour of an external install; the
        # bundled one still works offline, which is what we need (pyproject pins pulp < 4).
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)


def _new_var(prob, name: str, cat: str = pulp.LpContinuous, low=0, up=1) -> pulp.LpVariable:
    if hasattr(prob, "add_variable"):  # pulp >= 3.3
        return prob.add_variable(name, lowBound=low, upBound=up, cat=cat)
    return pulp.LpVariable(name, lowBound=low, upBound=up, cat=cat)


def _node_vars(prob, problem: ShardingProblem, reps: list[OpNode]) -> dict[str, list]:
    out = {}
    for i, n in enumerate(reps):
        out[n.name] = [
            _new_var(prob, f"s_{i}_{k}", pulp.LpBinary)
            for k in range(len(problem.strategies[n.name]))
        ]
    return out


def _edge_vars(prob, problem, rep, mult, s_vars, objective) -> None:
    """Edge resharding terms: linear where one side has a single placement, else edge
    variables with marginal constraints."""
    # Every original edge maps onto its ends' representatives; identical mapped edges (the
    # same edge in each block copy, or between consecutive copies) add up their weights.
    merged: dict[tuple, tuple[EdgeRef, int]] = {}
    for e in problem.edges:
        key = (rep[e.src], e.src_output, rep[e.dst], e.dst_input)
        first, w = merged.get(key, (e, 0))
        merged[key] = (first, w + 1)
    for t, ((u, uo, v, vi), (e, w)) in enumerate(merged.items()):
        su, sv = problem.strategies[u], problem.strategies[v]
        src_classes = _classes([s.outputs[uo] for s in su])
        dst_classes = _classes([s.inputs[vi] for s in sv])
        cost = {(a, b): w * problem.edge_cost(e, a, b) for a in src_classes for b in dst_classes}
        if not any(cost.values()):
            continue
        if u == v:  # a block's output feeding its own copy: a per-strategy term
            for k, s in enumerate(su):
                c = cost[(s.outputs[uo], s.inputs[vi])]
                objective.append((c, s_vars[u][k]))
            continue
        if len(src_classes) == 1 or len(dst_classes) == 1:
            # One side is fixed: the cost is linear in the other side's choice.
            if len(src_classes) == 1:
                a = next(iter(src_classes))
                for k, s in enumerate(sv):
                    objective.append((cost[(a, s.inputs[vi])], s_vars[v][k]))
            else:
                b = next(iter(dst_classes))
                for k, s in enumerate(su):
                    objective.append((cost[(s.outputs[uo], b)], s_vars[u][k]))
            continue
        e_vars = {}
        for i, a in enumerate(src_classes):
            for j, b in enumerate(dst_classes):
                var = _new_var(prob, f"e_{t}_{i}_{j}")
                e_vars[(a, b)] = var
                objective.append((cost[(a, b)], var))
        for i, a in enumerate(src_classes):
            prob += (
                pulp.lpSum(e_vars[(a, b)] for b in dst_classes)
                == pulp.lpSum(s_vars[u][k] for k in src_classes[a]),
                f"edge_src_{t}_{i}",
            )
        for j, b in enumerate(dst_classes):
            prob += (
                pulp.lpSum(e_vars[(a, b)] for a in src_classes)
                == pulp.lpSum(s_vars[v][k] for k in dst_classes[b]),
                f"edge_dst_{t}_{j}",
            )


def _linear(terms: list[tuple[float, pulp.LpVariable]]) -> pulp.LpAffineExpression:
    """Sum coefficients per variable (an LpAffineExpression built from pairs keeps only the
    last coefficient of a repeated variable)."""
    coef: dict[str, float] = {}
    var: dict[str, pulp.LpVariable] = {}
    for c, v in terms:
        if c:
            coef[v.name] = coef.get(v.name, 0.0) + c
            var[v.name] = v
    return pulp.LpAffineExpression([(var[k], coef[k]) for k in coef])


def _classes(placements: list) -> dict:
    out: dict = {}
    for k, p in enumerate(placements):
        out.setdefault(p, []).append(k)
    return out


def _add_one_hot(prob, reps, s_vars) -> None:
    for i, n in enumerate(reps):
        prob += pulp.lpSum(s_vars[n.name]) == 1, f"one_strategy_{i}"


def _add_memory(prob, problem, reps, mult, s_vars) -> None:
    if math.isinf(problem.memory_budget):
        return  # no budget: time-optimal sharding
    terms = []
    for n in reps:
        for k, s in enumerate(problem.strategies[n.name]):
            terms.append((mult[n.name] * problem.node_memory(s), s_vars[n.name][k]))
    prob += _linear(terms) <= problem.memory_budget, "memory_budget"


def _status(prob, solver: str, time_limit: float | None, solve_s: float):
    status = pulp.LpStatus[prob.status]
    hit_limit = time_limit is not None and solve_s >= 0.98 * time_limit
    if solver == "highs":
        model = getattr(prob, "solverModel", None)
        try:
            info = model.getInfo()
            gap = float(info.mip_gap) if info.mip_gap < 1e30 else None
            model_status = model.modelStatusToString(model.getModelStatus())
            if "time limit" in model_status.lower():
                return "time_limit", gap
            return ("optimal" if status == "Optimal" else status.lower()), (gap or 0.0)
        except Exception:  # older highspy without these calls
            pass
    if hit_limit:
        return "time_limit", None
    return (
        "optimal" if status == "Optimal" else status.lower()
    ), 0.0 if status == "Optimal" else None


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
                CostModel(bigger, problem.cost_model.dtype, attention=problem.cost_model.attention),
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
