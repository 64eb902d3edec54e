"""Turn an intra-op ILP solution on a (1, tp) mesh into per-node layouts for the evaluator.

The executor applies tensor parallelism on the tp axis and FSDP/DDP on the dp axis, so the
plan search lets the ILP decide the tp axis only (dp = 1 in the ILP) and models data
parallelism and ZeRO in the evaluator. Each node's layout carries its tp placements, its
compute split, and its communication as (collective, bytes) events on the tp axis: the
strategy's own, plus the resharding of its incoming edges (forward, and the gradient's way
back), charged to the consuming node.
"""

from __future__ import annotations

from planner.cost.model import reshard_steps
from planner.intra_op.node_layout import NodeLayout
from planner.intra_op.sharding_problem import ShardingProblem, ShardingSolution

TP = 1  # axis index of tp in the ILP's (dp, tp) mesh


def _tp(placements: tuple[str, ...]) -> str:
    return placements[TP]


def ilp_layouts(problem: ShardingProblem, solution: ShardingSolution) -> dict[str, NodeLayout]:
    if problem.mesh.shape[0] != 1:
        raise ValueError("ilp_layouts expects a (1, tp) mesh: dp is modelled by the evaluator")
    out: dict[str, NodeLayout] = {}
    for node in problem.nodes:
        s = solution.choices[node.name]
        out[node.name] = NodeLayout(
            strategy=s.name.split("|")[TP].removeprefix("tp:"),
            compute_shards=s.compute_shards,
            saved_shards=s.compute_shards,
            fwd_comm=[(name, int(b)) for a, name, b in s.fwd_events if a == TP],
            bwd_comm=[(name, int(b)) for a, name, b in s.bwd_events if a == TP],
            step_comm=[(name, int(b)) for a, name, b in s.step_events if a == TP],
            params={p: _tp(pl) for p, pl in s.params},
            inputs=[_tp(pl) for pl in s.inputs],
            outputs=[_tp(pl) for pl in s.outputs],
        )
    mesh = problem.mesh
    for e in problem.edges:
        src = list(solution.choices[e.src].outputs[e.src_output])
        dst = list(solution.choices[e.dst].inputs[e.dst_input])
        lay = out[e.dst]
        for axis, name, nbytes in reshard_steps(e.nbytes, src, dst, mesh):
            if axis == TP:
                lay.fwd_comm.append((name, int(nbytes)))
        if e.floating:
            grad_src = ["R" if p == "P" else p for p in src]
            grad_dst = ["R" if p == "P" else p for p in dst]
            for axis, name, nbytes in reshard_steps(e.nbytes, grad_dst, grad_src, mesh):
                if axis == TP:
                    lay.bwd_comm.append((name, int(nbytes)))
    return out
