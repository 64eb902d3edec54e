"""Layouts copied between identical layers (planner.intra_op.layout_map) equal the layouts
worked out node by node: Megatron's propagation, the ILP's layouts and the ideal bound's, and
the cost tables priced from them, for every family with repeated blocks and at several tp."""

import math

import pytest

from planner.cluster.mesh import LogicalMesh
from planner.cluster.profile import load_cluster
from planner.cost.model import CostModel
from planner.evaluate.layer_table import build_table
from planner.intra_op.ilp import solve
from planner.intra_op.ilp_layouts import ilp_layouts
from planner.intra_op.megatron import tensor_parallel_layout
from planner.intra_op.sharding_problem import ShardingProblem
from planner.placements import shard
from planner.search.bounds import ideal_layouts
from tests.conftest import traced

GRAPHS = {
    "gpt": lambda: traced("gpt-350m", batch=2, seq=32, layers=7, hidden=64, heads=4, vocab=256),
    "llama": lambda: traced(
        "llama3-8b", batch=1, seq=32, layers=6, hidden=64, heads=4, kv_heads=2, ffn_hidden=128
    ),
    "moe": lambda: traced("moe-380m", batch=2, seq=32, layers=6, hidden=64, heads=4, experts=4),
}
CLUSTER = load_cluster("dgx-a100-80g")


def _full(layouts, graph) -> dict:
    return {n.name: layouts[n.name] for n in graph.nodes}


def _table(graph, layouts, tp):
    mesh = LogicalMesh.contiguous(CLUSTER, 0, (1, tp))
    return build_table(graph, layouts, CostModel(CLUSTER, "bf16"), mesh)[0].to_json()


@pytest.mark.parametrize("family", sorted(GRAPHS))
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["plain", "sequence-parallel"])
def test_megatron_copies_equal_propagating_every_node(family, tp, sp):
    graph = GRAPHS[family]()
    copied = tensor_parallel_layout(graph, tp, sequence_parallel=sp)
    each = tensor_parallel_layout(graph, tp, copy_layers=False, sequence_parallel=sp)
    assert len(copied.own) < len(graph.nodes) // 2  # most layers were copied, not propagated
    assert _full(copied, graph) == _full(each, graph)
    assert _table(graph, copied, tp) == _table(graph, _full(each, graph), tp)
    # a copied node's strategy is read from its source layer, without building the copy
    fresh = tensor_parallel_layout(graph, tp, sequence_parallel=sp)
    strategies = {n.name: fresh.strategy(n.name) for n in graph.nodes}
    assert not fresh._built
    assert strategies == {name: lay.strategy for name, lay in _full(each, graph).items()}


@pytest.mark.parametrize("family", sorted(GRAPHS))
@pytest.mark.parametrize("tp", [2, 4])
def test_ilp_copies_equal_building_every_node(family, tp):
    graph = GRAPHS[family]()
    mesh = LogicalMesh.contiguous(CLUSTER, 0, (1, tp))
    problem = ShardingProblem(graph, mesh, CostModel(CLUSTER, "bf16"), memory_budget=math.inf)
    solution = solve(problem, "highs", 60.0)
    copied = ilp_layouts(problem, solution)
    each = ilp_layouts(problem, solution, copy_layers=False)
    assert len(copied.own) < len(graph.nodes) // 2
    assert _full(copied, graph) == each
    assert _table(graph, copied, tp) == _table(graph, each, tp)


@pytest.mark.parametrize("family", sorted(GRAPHS))
def test_ideal_layouts_are_every_node_split(family):
    graph = GRAPHS[family]()
    ideal = ideal_layouts(graph, 4)
    for node in graph.nodes:
        lay = ideal[node.name]
        assert (lay.compute_shards, lay.saved_shards, lay.fwd_comm, lay.bwd_comm) == (4, 4, [], [])
        assert lay.params == {p: shard(0) for p in node.params}
