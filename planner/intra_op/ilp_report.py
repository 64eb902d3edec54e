"""Reports of an ILP solution: the forward pass's collectives and a JSON form (autopar shard)."""

from __future__ import annotations

from collections import defaultdict

from planner.cost.model import reshard_steps
from planner.intra_op.sharding_problem import ShardingProblem, ShardingSolution


def forward_collectives(problem: ShardingProblem, sol: ShardingSolution) -> list[str]:
    """Every collective the forward pass of the solution runs (edge reshards and the
    strategies' own), in graph order."""
    out: list[str] = []
    by_dst = defaultdict(list)
    for e in problem.edges:
        by_dst[e.dst].append(e)
    for n in problem.nodes:
        for e in by_dst[n.name]:
            src = sol.choices[e.src].outputs[e.src_output]
            dst = sol.choices[e.dst].inputs[e.dst_input]
            out += [
                name for _, name, _ in reshard_steps(e.nbytes, list(src), list(dst), problem.mesh)
            ]
        out += list(sol.choices[n.name].fwd_collectives)
    return out


def solution_to_dict(problem: ShardingProblem, sol: ShardingSolution) -> dict:
    """JSON form: per node its strategy and placements (as in the Plan's shardings[]) with
    costs, then totals, memory and solver statistics."""
    incoming: dict[str, float] = defaultdict(float)
    for (_, dst), cost in sol.reshard_by_edge.items():
        incoming[dst] += cost
    nodes = []
    for n in problem.nodes:
        s = sol.choices[n.name]
        nodes.append(
            {
                "node": n.name,
                "module": n.module,
                "kind": n.kind,
                "layer": n.layer,
                "strategy": s.name,
                "params": {p: list(pl) for p, pl in s.params},
                "inputs": [list(pl) for pl in s.inputs],
                "outputs": [list(pl) for pl in s.outputs],
                "compute_s": s.compute_s,
                "comm_s": s.comm_s,
                "grad_sync_s": s.grad_sync_s,
                "reshard_in_s": incoming[n.name],
                "param_elems": s.param_elems,
                "saved_bytes": s.saved_bytes,
            }
        )
    stats = sol.stats
    return {
        "mesh": {"shape": list(sol.mesh_shape), "axis_names": list(problem.mesh.axis_names)},
        "objective_s": sol.objective_s,
        "breakdown": sol.breakdown,
        "memory": sol.memory,
        "memory_budget": problem.memory_budget,
        "solver": {
            "name": stats.solver,
            "status": stats.status,
            "gap": stats.gap,
            "variables": stats.variables,
            "constraints": stats.constraints,
            "build_s": stats.build_s,
            "solve_s": stats.solve_s,
            "nodes": stats.nodes,
            "unique_nodes": stats.unique_nodes,
            "dedup_groups": stats.dedup_groups,
        },
        "nodes": nodes,
    }
