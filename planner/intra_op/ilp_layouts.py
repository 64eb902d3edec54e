"""Turn an intra-op ILP solution on a (1, tp) mesh into per-node layouts for the evaluator.

The executor applies tensor parallelism on the tp axis and FSDP/DDP on the dp axis, so the
plan search lets the ILP decide the tp axis only (dp = 1 in the ILP) and models data
parallelism and ZeRO in the evaluator. Each node's layout carries its tp placements, its
compute split, and its communication as (collective, bytes) events on the tp axis: the
strategy's own, plus the resharding of its incoming edges (forward, and the gradient's way
back), charged to the consuming node.
"""

from __future__ import annotations

from collections.abc import Mapping

from planner.cost.model import reshard_steps
from planner.intra_op.layout_map import LayoutMap
from planner.intra_op.node_layout import NodeLayout
from planner.intra_op.sharding_problem import ShardingProblem, ShardingSolution, SolveStats
from planner.placements import shard_dim

TP = 1  # axis index of tp in the ILP's (dp, tp) mesh


def _tp(placements: tuple[str, ...]) -> str:
    return placements[TP]


def ilp_layouts(
    problem: ShardingProblem, solution: ShardingSolution, copy_layers: bool = True
) -> Mapping[str, NodeLayout]:
    """Every node's layout; on a whole graph, a LayoutMap that builds one layer per distinct
    (layer group, chosen strategies, placements arriving from other layers) and lets the
    other layers take it (exact: a layer's layouts depend on nothing else)."""
    if problem.mesh.shape[0] != 1:
        raise ValueError("ilp_layouts expects a (1, tp) mesh: dp is modelled by the evaluator")
    graph = problem.graph
    whole = copy_layers and len(problem.nodes) == len(graph.nodes)
    source = _layer_sources(problem, solution) if whole else {}
    out: dict[str, NodeLayout] = {}
    for node in problem.nodes:
        if node.layer is None or source.get(node.layer, node.layer) == node.layer:
            out[node.name] = _own_layout(solution.choices[node.name])
    mesh = problem.mesh
    for e in problem.edges:
        lay = out.get(e.dst)
        if lay is None:
            continue  # a copied layer: its source layer's nodes carry the same terms
        src = list(solution.raw[e.src].outputs[e.src_output])
        dst = list(solution.raw[e.dst].inputs[e.dst_input])
        for axis, name, nbytes in reshard_steps(e.nbytes, src, dst, mesh):
            if axis == TP:
                lay.fwd_comm.append((name, int(nbytes)))
        if e.floating:
            grad_src = ["R" if p == "P" else p for p in src]
            grad_dst = ["R" if p == "P" else p for p in dst]
            for axis, name, nbytes in reshard_steps(e.nbytes, grad_dst, grad_src, mesh):
                if axis == TP:
                    lay.bwd_comm.append((name, int(nbytes)))
    _broadcast_grads(problem, out)
    return LayoutMap(graph, out, source) if whole else out


def _broadcast_grads(problem: ShardingProblem, out: dict[str, NodeLayout]) -> None:
    """A replicated tensor broadcast against a tp-split one (a position embedding added to
    batch-split tokens) gets a partial gradient on tp. DTensor keeps it partial back to the
    parameters of the replicated node that made it, which the executor then all-reduces once
    a step (graph mode): a step event per such parameter, on its producer."""
    by_name = problem.graph.by_name
    done: set[str] = set()
    for e in problem.edges:
        src, dst = out.get(e.src), out.get(e.dst)
        if src is None or dst is None or not e.floating or e.dst_input >= len(dst.inputs):
            continue
        if dst.inputs[e.dst_input] != "R" or not dst.outputs or src.strategy != "replicate":
            continue
        d = shard_dim(dst.outputs[0])
        node, producer = by_name[e.dst], by_name[e.src]
        if d is None or not node.outputs or not _broadcasts(node, e.dst_input, d):
            continue
        for name, meta in producer.params.items():
            if name not in done and src.params.get(name, "R") == "R":
                done.add(name)
                src.step_comm.append(("all_reduce", meta.nbytes))


def _broadcasts(node, index: int, out_dim: int) -> bool:
    """Whether input `index` of an elementwise node is broadcast along output dim
    `out_dim` (absent there, or of size 1)."""
    if node.kind != "elementwise" or index >= len(node.inputs):
        return False
    out_shape, in_shape = node.outputs[0].shape, node.inputs[index].shape
    out_dim %= len(out_shape)
    aligned = out_dim - (len(out_shape) - len(in_shape))
    return aligned < 0 or (in_shape[aligned] == 1 and out_shape[out_dim] > 1)


def _tp_name(s) -> str:
    """A strategy's name on the tp axis, as plans name it ("col", "batch")."""
    return s.name.split("|")[TP].removeprefix("tp:")


def _own_layout(s) -> NodeLayout:
    return NodeLayout(
        strategy=_tp_name(s),
        compute_shards=s.compute_shards,
        saved_shards=s.compute_shards,
        fwd_comm=[(name, int(b)) for a, name, b in s.fwd_events if a == TP],
        bwd_comm=[(name, int(b)) for a, name, b in s.bwd_events if a == TP],
        step_comm=[(name, int(b)) for a, name, b in s.step_events if a == TP],
        params={p: _tp(pl) for p, pl in s.params},
        inputs=[_tp(pl) for pl in s.inputs],
        outputs=[_tp(pl) for pl in s.outputs],
    )


def _layer_sources(problem: ShardingProblem, solution: ShardingSolution) -> dict[int, int]:
    """layer -> the first layer whose layouts equal its own: same group (identical nodes and
    internal edges), the same strategy objects chosen (block copies share their
    representative's), and the same tensors arriving from outside the layer, by position."""
    graph, raw = problem.graph, solution.raw
    layer_of = {n.name: n.layer for n in problem.nodes}
    index = {n.name: i for members in graph.layer_nodes.values() for i, n in enumerate(members)}
    arriving: dict[int, list[tuple]] = {layer: [] for layer in graph.layer_nodes}
    for e in problem.edges:
        layer = layer_of[e.dst]
        if layer is not None and layer_of[e.src] != layer:
            placement = raw[e.src].outputs[e.src_output]
            arriving[layer].append((index[e.dst], e.dst_input, e.nbytes, e.floating, placement))
    first: dict[tuple, int] = {}
    out = {}
    for layer, members in sorted(graph.layer_nodes.items()):
        chosen = tuple(id(raw[n.name]) for n in members)
        key = (graph.layer_groups[layer], chosen, tuple(sorted(arriving[layer])))
        out[layer] = first.setdefault(key, layer)
    return out


def chosen_layouts(
    problem: ShardingProblem, names: Mapping[str, str], fallback: Mapping[str, str] | None = None
) -> dict[str, NodeLayout]:
    """The layouts of strategies chosen by name (a node's tp strategy, as plans name it)
    rather than by the solver, with the same terms: each strategy's own events and the
    resharding of every edge between them. Nodes not in `names` are replicated; a name the
    node does not offer on this mesh is an error, or its `fallback` name is taken."""
    choices = {}
    for node in problem.nodes:
        want = names.get(node.name, "replicate")
        offered = {_tp_name(s): s for s in problem.strategies[node.name]}
        if want not in offered and fallback is not None:
            want = fallback.get(node.name, "replicate")
        if want not in offered:
            raise ValueError(f"node {node.name} offers no strategy {want!r} on this mesh")
        choices[node.name] = problem.own(node, offered[want])
    stats = SolveStats(
        solver="chosen",
        status="optimal",
        gap=None,
        variables=0,
        constraints=0,
        build_s=0.0,
        solve_s=0.0,
        nodes=len(choices),
        unique_nodes=0,
        dedup_groups=0,
    )
    solution = ShardingSolution(choices, 0.0, {}, {}, stats, problem.mesh.shape)
    return dict(ilp_layouts(problem, solution, copy_layers=False))
