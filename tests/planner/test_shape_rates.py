"""Shape-dependent matmul and attention rates (planner.cost.shape_rates) and the CUDA kernels'
saved bytes: checked against the bundled H100 table read straight from its YAML."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

from planner.cluster.mesh import LogicalMesh
from planner.cluster.profile import Efficiency, load_cluster
from planner.cost.model import CostModel
from planner.cost.shape_rates import GridRates, gemm_dims
from planner.evaluate.node_costs import node_costs
from planner.graph.tracing import trace_model
from planner.intra_op.megatron import tensor_parallel_layout
from planner.models.registry import ModelSpec, resolve


@pytest.fixture(scope="module")
def h100_yaml() -> dict:
    text = (resources.files("cluster_profiles") / "dgx-h100.yaml").read_text()
    return yaml.safe_load(text)


@pytest.fixture(scope="module")
def llama():
    """A 2-layer Llama with head dim 128 (the measured attention) at batch 2, seq 1024."""
    spec = ModelSpec(
        name="llama3-8b",
        config={"layers": 2, "hidden": 1024, "heads": 8, "kv_heads": 2, "ffn_hidden": 4096},
    )
    return trace_model(resolve(spec), 2, 1024, "bf16")


def test_grid_interpolates_in_log2_hits_points_and_clamps():
    points = [((m, k), float(m * 10 + k)) for m in (2, 8) for k in (4, 16)]
    g = GridRates(points)
    assert g.rate((2, 4)) == 24.0 and g.rate((8, 16)) == 96.0
    # halfway in log2 between 2 and 8 is 4; between 4 and 16 is 8: the mean of the corners
    assert g.rate((4, 8)) == pytest.approx((24 + 36 + 84 + 96) / 4)
    assert g.rate((1, 2)) == 24.0 and g.rate((100, 100)) == 96.0  # clamped to the grid


def test_sparse_table_takes_the_nearest_point():
    g = GridRates([((1024, 1024, 1024), 1.0), ((8192, 8192, 8192), 2.0)])
    assert g.rate((1024, 1024, 2048)) == 1.0
    assert g.rate((8192, 4096, 8192)) == 2.0


def test_gemm_dims_follow_the_weight_placement(llama):
    linear = next(n for n in llama.nodes if n.op == "aten.linear.default" and n.layer == 0)
    m = 2 * 1024
    k = linear.inputs[0].shape[-1]
    n = next(iter(linear.params.values())).shape[0]
    assert gemm_dims(linear) == (m, k, n)
    assert gemm_dims(linear, ["S(0)"], [4]) == (m, k, n // 4)  # column parallel
    assert gemm_dims(linear, ["S(1)"], [4]) == (m, k // 4, n)  # row parallel
    assert gemm_dims(linear, ["R", "S(0)"], [2, 4]) == (m // 2, k, n // 4)  # batch x column


def _measured_gemm_seconds(h100_yaml: dict, m: int, k: int, n: int) -> float:
    for p in h100_yaml["measured"]["matmuls"]:
        if p["dtype"] == "bf16" and p["shape"] == [m, k, n]:
            return 2 * m * k * n / p["flops_per_s"]
    raise AssertionError(f"{(m, k, n)} not measured")


def test_linear_time_is_the_measured_gemms(llama, h100_yaml):
    """Forward: the GEMM (m, k, n); backward: the input-gradient (m, n, k) and weight-gradient
    (n, m, k) GEMMs, each at its own measured rate."""
    cm = CostModel(load_cluster("dgx-h100"), "bf16")
    linear = next(
        n
        for n in llama.nodes
        if n.op == "aten.linear.default" and n.layer == 1 and n.outputs[0].shape[-1] == 4096
    )
    m, k, n = 2048, 1024, 4096
    t = cm.node_time(linear)
    assert t.fwd == pytest.approx(_measured_gemm_seconds(h100_yaml, m, k, n), rel=1e-3)
    want_bwd = _measured_gemm_seconds(h100_yaml, m, n, k) + _measured_gemm_seconds(
        h100_yaml, n, m, k
    )
    assert t.bwd == pytest.approx(want_bwd, rel=1e-3)


def test_thin_gemms_cost_more_than_their_share(llama):
    """Split 8 ways a GEMM runs below the whole one's rate: with the tables an 8-way
    column-parallel linear takes more than 1/8 of the whole; the scalar model says 1/8."""
    cluster = load_cluster("dgx-h100")
    tables = CostModel(cluster, "bf16")
    scalar = CostModel(cluster.model_copy(update={"measured": None}), "bf16")
    linear = next(n for n in llama.nodes if n.op == "aten.linear.default" and n.layer == 1)
    for cm, check in ((tables, lambda r: r > 0.13), (scalar, lambda r: r == pytest.approx(1 / 8))):
        whole = cm.node_time(linear).fwd
        split = cm.node_time(linear, 8, gemm_dims(linear, ["S(0)"], [8])).fwd
        assert check(split / whole), split / whole


def test_causal_attention_time_is_the_measured_one(llama, h100_yaml):
    """At a measured (batch x heads, seq) the node's time is the measured seconds (the trace's
    FLOP convention cancels); split over tp heads, the entry at fewer heads."""
    cm = CostModel(load_cluster("dgx-h100"), "bf16")
    attn = next(n for n in llama.nodes if n.kind == "attention" and n.layer == 1)
    rows = {(a["batch_heads"], a["seq"]): a for a in h100_yaml["measured"]["attention_times"]}
    t = cm.node_time(attn)
    assert t.fwd == pytest.approx(rows[(16, 1024)]["fwd_s"], rel=1e-3)
    assert t.bwd == pytest.approx(rows[(16, 1024)]["bwd_s"], rel=1e-3)
    t4 = cm.node_time(attn, 4)
    assert t4.fwd == pytest.approx(rows[(4, 1024)]["fwd_s"], rel=1e-3)


def test_rms_norm_keeps_its_input_and_rstd_on_cuda_kernels(llama):
    cuda = CostModel(load_cluster("dgx-h100"), "bf16")
    cpu = CostModel(load_cluster("cpu-local"), "bf16")
    norm = next(n for n in llama.nodes if n.op == "aten.rms_norm.default" and n.layer == 1)
    x = norm.inputs[0]
    assert cuda.saved_bytes(norm) == x.nbytes + 4 * (x.numel // x.shape[-1])
    assert cpu.saved_bytes(norm) == norm.saved_bytes > cuda.saved_bytes(norm)


def test_tables_change_tp_layer_costs_through_the_layout(llama):
    """node_costs passes each linear's local GEMM: with the tables a tp-8 layer's compute is
    more than 1/8 of the tp-1 layer's; with the scalar efficiency about 1/8 of its matmuls."""
    cluster = load_cluster("dgx-h100")
    scalar_cluster = cluster.model_copy(
        update={"measured": None, "efficiency": Efficiency(matmul=0.65)}
    )

    def layer_time(c, tp: int) -> float:
        cm = CostModel(c, "bf16")
        mesh = LogicalMesh.contiguous(c, 0, (1, tp))
        nodes = [n for n in llama.nodes if n.layer == 1 and n.kind == "linear"]
        costs = node_costs(llama, tensor_parallel_layout(llama, tp), cm, mesh, nodes=nodes)
        return sum(c.fwd + c.bwd for c in costs.values())

    assert layer_time(cluster, 8) / layer_time(cluster, 1) > 0.15
    assert layer_time(scalar_cluster, 8) / layer_time(scalar_cluster, 1) == pytest.approx(
        1 / 8, rel=0.02
    )


def test_the_ideal_bound_stays_below_every_split_under_the_tables(llama):
    """The search's ideal layout (every node split over tp, no communication) must cost no
    more than any real layout; with GEMM rates that vary by shape it takes the fastest split."""
    from planner.search.bounds import ideal_layouts

    cluster = load_cluster("dgx-h100")
    cm = CostModel(cluster, "bf16")
    for tp in (2, 8):
        mesh = LogicalMesh.contiguous(cluster, 0, (1, tp))
        nodes = [n for n in llama.nodes if n.layer == 1 and n.kind == "linear"]
        ideal = node_costs(llama, ideal_layouts(llama, tp), cm, mesh, nodes=nodes)
        real = node_costs(llama, tensor_parallel_layout(llama, tp), cm, mesh, nodes=nodes)
        for n in nodes:
            bound = ideal[n.name].fwd + ideal[n.name].bwd
            for place in ("R", "S(0)", "S(1)"):
                t = cm.node_time(n, tp, gemm_dims(n, [place], [tp]))
                assert bound <= (t.fwd + t.bwd) * (1 + 1e-12), (n.name, place)
            assert bound <= (real[n.name].fwd + real[n.name].bwd) * (1 + 1e-12)
