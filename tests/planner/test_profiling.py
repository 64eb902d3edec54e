"""Operator profiling: the database round trip, measured times preferred over the roofline,
interpolation between measured shapes, and real timings of traced operators."""

from __future__ import annotations

import pytest

from planner.cluster.profile import load_cluster
from planner.cluster.profiling import (
    OpProfileDB,
    OpTimes,
    distinct_ops,
    inline_op_db,
    profile_nodes,
    signature,
    work,
)
from planner.cost.model import CostModel
from planner.graph.opgraph import OpNode, TensorMeta
from tests.conftest import traced


def linear(tokens: int) -> OpNode:
    return OpNode(
        name=f"linear_{tokens}",
        op="aten.linear.default",
        kind="linear",
        inputs=[TensorMeta(shape=[tokens, 1024], dtype="float32")],
        params={"w": TensorMeta(shape=[1024, 1024], dtype="float32")},
        outputs=[TensorMeta(shape=[tokens, 1024], dtype="float32")],
        fwd_flops=2 * tokens * 1024 * 1024,
        bwd_flops=4 * tokens * 1024 * 1024,
    )


def test_measured_preferred_then_interpolated_then_roofline():
    cluster = load_cluster("cpu-local")
    roofline = CostModel(cluster, "fp32")
    times = OpTimes()
    small, large = linear(1000), linear(3000)
    times.add(small.op, signature(small), work(small), 0.010, 0.020)
    times.add(large.op, signature(large), work(large), 0.030, 0.070)
    cm = CostModel(cluster, "fp32", op_times=times)
    assert (cm.node_time(small).fwd, cm.node_time(small).bwd) == (0.010, 0.020)
    assert cm.node_time(small).fwd != roofline.node_time(small).fwd
    mid = cm.node_time(linear(2000))  # halfway in work: halfway in time
    assert (mid.fwd, mid.bwd) == pytest.approx((0.020, 0.045))
    sharded = cm.node_time(large, shards=2)  # 1500 tokens' worth of work
    assert sharded.fwd == pytest.approx(0.015)
    outside = cm.node_time(linear(8000))
    assert outside.fwd == pytest.approx(roofline.node_time(linear(8000)).fwd)


def test_database_round_trip_and_cost_model_reads_the_profile_db(tmp_path):
    db = OpProfileDB(tmp_path / "ops.db")
    node = linear(1000)
    row = {"op": node.op, "signature": signature(node), "work": work(node)}
    db.put("cpu-gloo-process", "fp32", [{**row, "fwd_s": 0.5, "bwd_s": 1.5}])
    db.put("other-device", "fp32", [{**row, "fwd_s": 9.0, "bwd_s": 9.0}])
    assert db.load("cpu-gloo-process", "fp32").exact[(node.op, signature(node))] == (0.5, 1.5)
    assert len(db.load("cpu-gloo-process", "bf16")) == 0
    cluster = load_cluster("cpu-local")
    measured = inline_op_db(cluster, tmp_path / "ops.db")
    assert [r.fwd_s for r in measured.measured.op_times] == [0.5]  # its device's rows only
    assert CostModel(measured, "fp32").node_time(node).fwd == 0.5
    assert CostModel(measured, "bf16").node_time(node).fwd != 0.5  # other dtype: roofline


def test_traced_operators_are_rebuilt_and_timed():
    graph = traced(
        "gpt-350m", batch=2, seq=32, dtype="fp32", layers=2, hidden=64, heads=2, vocab=128
    )
    nodes = distinct_ops([graph])
    rows = profile_nodes(nodes, repeats=2)
    timed = {r["op"] for r in rows}
    assert {"aten.linear.default", "aten.scaled_dot_product_attention.default"} <= timed
    assert len(rows) == len(nodes)  # every distinct operator could be rebuilt
    for r in rows:
        assert r["fwd_s"] > 0
        if r["op"] == "aten.linear.default":
            assert r["bwd_s"] > 0
