"""Each collective and the memory model against hand calculation."""

import pytest

from planner.cluster.mesh import LogicalMesh
from planner.cluster.profile import parse_profile
from planner.cost.memory import model_state_bytes
from planner.cost.model import CostModel
from planner.graph.opgraph import OpNode, TensorMeta
from planner.parallel.checkpointing import activation_bytes

# Round numbers so the hand calculations are easy to read.
PROFILE = {
    "name": "round",
    "device": {
        "name": "gpu",
        "memory_bytes": 80 * 2**30,
        "peak_flops": {"bf16": 100e12, "fp32": 10e12},
        "memory_bandwidth": 1e12,
    },
    "nodes": 2,
    "devices_per_node": 4,
    "links": {
        "intra_node": {"bandwidth": 100e9, "latency": 1e-5},
        "inter_node": {"bandwidth": 40e9, "latency": 1e-4},
    },
    "efficiency": {"matmul": 0.5, "memory": 0.5, "comm": 1.0},
}


@pytest.fixture
def cm():
    return CostModel(parse_profile(PROFILE), "bf16")


@pytest.fixture
def mesh():
    # 2 x 4 over both nodes: dp (size 2) crosses nodes, tp (size 4) stays in a node.
    return LogicalMesh.contiguous(parse_profile(PROFILE), 0, (2, 4))


def test_mesh_axes_pick_the_tier(mesh):
    dp, tp = mesh.axes
    assert (tp.size, tp.bandwidth, tp.latency, tp.crosses_nodes) == (4, 100e9, 1e-5, False)
    # dp groups {i, i+4}: one device per node, four groups share each node's 40 GB/s.
    assert (dp.size, dp.bandwidth, dp.latency, dp.crosses_nodes) == (2, 10e9, 1e-4, True)
    assert mesh.groups(0) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.groups(1) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_collectives_by_hand(cm, mesh):
    tp, dp = mesh.axis("tp"), mesh.axis("dp")
    b = 1e9
    assert cm.all_reduce(b, tp) == pytest.approx(2 * 3 * 1e-5 + 2 * 3 / 4 * b / 100e9)
    assert cm.all_gather(b, tp) == pytest.approx(3 * 1e-5 + 3 / 4 * b / 100e9)
    assert cm.reduce_scatter(b, tp) == pytest.approx(3 * 1e-5 + 3 / 4 * b / 100e9)
    assert cm.all_to_all(b, tp) == pytest.approx(3 * 1e-5 + 3 / 4 * b / 100e9)
    assert cm.all_reduce(b, dp) == pytest.approx(2 * 1e-4 + 2 * 1 / 2 * b / 10e9)
    link = cm.p2p_axis(0, 4)
    assert cm.send_recv(b, link) == pytest.approx(1e-4 + b / 10e9)
    assert cm.send_recv(b, cm.p2p_axis(0, 1)) == pytest.approx(1e-5 + b / 100e9)
    one = LogicalMesh.contiguous(cm.cluster, 0, (1, 1)).axis("tp")
    assert cm.all_reduce(b, one) == 0.0


def test_comm_efficiency_scales_bandwidth():
    profile = dict(PROFILE, efficiency={"matmul": 0.5, "memory": 0.5, "comm": 0.5})
    slow = CostModel(parse_profile(profile))
    axis = LogicalMesh.contiguous(slow.cluster, 0, (1, 4)).axis("tp")
    assert slow.all_gather(1e9, axis) == pytest.approx(3e-5 + 0.75 * 1e9 / 50e9)


def test_measured_collectives_replace_the_formula():
    profile = dict(
        PROFILE,
        measured={
            "collectives": {
                "intra_node": {
                    "all_reduce": [
                        {"group_size": 4, "bytes": 1_000_000, "seconds": 0.001},
                        {"group_size": 4, "bytes": 3_000_000, "seconds": 0.002},
                    ]
                }
            }
        },
    )
    cm = CostModel(parse_profile(profile))
    tp = LogicalMesh.contiguous(cm.cluster, 0, (1, 4)).axis("tp")
    assert cm.all_reduce(2_000_000, tp) == pytest.approx(0.0015)  # interpolated
    assert cm.all_reduce(5_000_000, tp) == pytest.approx(0.003)  # extrapolated on the slope
    assert cm.all_gather(2_000_000, tp) == pytest.approx(3e-5 + 0.75 * 2e6 / 100e9)


def test_resharding_by_hand(cm, mesh):
    tp, dp = mesh.axis("tp"), mesh.axis("dp")
    b = 8e8
    assert cm.reshard(b, ["R", "S(0)"], ["R", "R"], mesh) == pytest.approx(cm.all_gather(b, tp))
    assert cm.reshard(b, ["R", "P"], ["R", "R"], mesh) == pytest.approx(cm.all_reduce(b, tp))
    assert cm.reshard(b, ["R", "P"], ["R", "S(1)"], mesh) == pytest.approx(cm.reduce_scatter(b, tp))
    assert cm.reshard(b, ["R", "S(0)"], ["R", "S(1)"], mesh) == pytest.approx(
        cm.all_to_all(b / 4, tp)
    )
    assert cm.reshard(b, ["R", "R"], ["S(0)", "S(1)"], mesh) == 0.0
    # Partial on tp while dp shards the batch: reduce the dp-local half, then gather on dp.
    expected = cm.all_reduce(b / 2, tp) + cm.all_gather(b, dp)
    assert cm.reshard(b, ["S(0)", "P"], ["R", "R"], mesh) == pytest.approx(expected)


def test_roofline_compute(cm):
    matmul = OpNode(
        name="mm",
        op="aten.linear.default",
        kind="linear",
        fwd_flops=10**12,
        bwd_flops=2 * 10**12,
        bytes_read=10**6,
        bytes_written=10**6,
    )
    t = cm.node_time(matmul)
    assert t.fwd == pytest.approx(1e12 / 50e12)
    assert t.bwd == pytest.approx(2e12 / 50e12)
    assert cm.node_time(matmul, shards=4).fwd == pytest.approx(1e12 / 4 / 50e12)
    add = OpNode(
        name="add",
        op="aten.add.Tensor",
        kind="elementwise",
        bytes_read=2 * 10**9,
        bytes_written=10**9,
    )
    assert cm.node_time(add).fwd == pytest.approx(3e9 / 0.5e12)
    view = OpNode(
        name="v",
        op="aten.view.default",
        kind="reshape",
        is_view=True,
        outputs=[TensorMeta(shape=[4], dtype="float32")],
    )
    assert cm.node_time(view).fwd == 0.0


def test_math_attention_costs_the_score_matrix():
    q = TensorMeta(shape=[2, 8, 1024, 64], dtype="bfloat16")
    node = OpNode(
        name="a",
        op="aten.scaled_dot_product_attention.default",
        kind="attention",
        inputs=[q, q, q],
        fwd_flops=4 * 2 * 8 * 1024 * 1024 * 64,
    )
    flash = CostModel(parse_profile(PROFILE), "bf16", attention="flash")
    math = CostModel(parse_profile(PROFILE), "bf16", attention="math")
    scores = 2 * 8 * 1024 * 1024 * 2
    assert flash.attention_scores_bytes(node) == 0
    assert math.attention_scores_bytes(node) == scores
    extra = math.node_time(node).fwd - flash.node_time(node).fwd
    assert extra == pytest.approx(4 * scores / 0.5e12)


P = 1_000_000


def test_memory_dp_only_by_hand():
    # Mixed-precision Adam, no ZeRO: 2 + 2 + 12 bytes per parameter on every replica.
    assert model_state_bytes(P, "bf16", "adamw", zero=0, dp=8) == (2 * P, 2 * P, 12 * P)
    assert model_state_bytes(P, "fp32", "adamw", zero=0, dp=8) == (4 * P, 4 * P, 8 * P)
    assert model_state_bytes(P, "fp32", "sgd", zero=0, dp=8) == (4 * P, 4 * P, 0)


def test_memory_zero_stages_by_hand():
    # ZeRO-1 as executor.zero1 holds it: whole fp32 weights and gradients, master and states
    # split (Megatron's distributed optimizer keeps bf16 weights: its runtime's declaration)
    assert model_state_bytes(P, "bf16", "adamw", zero=1, dp=8) == (4 * P, 4 * P, 12 * P // 8)
    megatron = model_state_bytes(P, "bf16", "adamw", zero=1, dp=8, runtime="megatron")
    assert megatron == (2 * P, 4 * P, 12 * P // 8)
    assert model_state_bytes(P, "bf16", "adamw", zero=2, dp=8) == (2 * P, 2 * P // 8, 12 * P // 8)
    # ZeRO-3 also shards weights and holds one gathered layer (here 100k params) at a time.
    weights, grads, opt = model_state_bytes(
        P, "bf16", "adamw", zero=3, dp=8, largest_layer_params=100_000
    )
    assert (weights, grads, opt) == (2 * P // 8 + 2 * 100_000, 2 * P // 8, 12 * P // 8)


def test_fsdp2_gradients_accumulated_whole_by_hand():
    """Where FSDP2 accumulates gradients unsharded (torch 2.13's PipelineStage turns gradient
    sync and resharding after backward off for every backward of a pipeline; FSDPParam upcasts
    an unsharded gradient to the policy's reduce_dtype, fp32, to accumulate it), the step
    holds 4 bytes of gradient per parameter whole and, at ZeRO-3, every layer gathered in
    bf16 (2 bytes), not one: ZeRO-3 under a pipeline holds what ZeRO-2 holds."""
    state = dict(largest_layer_params=100_000)
    piped = model_state_bytes(P, "bf16", "adamw", zero=3, dp=8, pp=2, microbatches=4, **state)
    assert piped == (2 * P // 8 + 2 * P, 4 * P, 12 * P // 8)
    zero2 = model_state_bytes(P, "bf16", "adamw", zero=2, dp=8, pp=2, microbatches=1)
    assert zero2 == (2 * P, 4 * P, 12 * P // 8)
    # without a pipeline: ZeRO-2 over micro-batches reduces once, in the last backward
    accumulated = model_state_bytes(P, "bf16", "adamw", zero=2, dp=8, microbatches=2)
    assert accumulated == (2 * P, 4 * P, 12 * P // 8)
    # ZeRO-3 reduce-scatters each micro-batch's gradients: still sharded, one layer gathered
    each = model_state_bytes(P, "bf16", "adamw", zero=3, dp=8, microbatches=4, **state)
    assert each == (2 * P // 8 + 2 * 100_000, 2 * P // 8, 12 * P // 8)
    # torchtitan's pipelines (torch's schedules) likewise; without one it reduces as planned
    titan = dict(runtime="torchtitan", pp=4, microbatches=8)
    assert model_state_bytes(P, "bf16", "adamw", zero=1, dp=8, **titan)[1] == 4 * P
    titan["pp"] = 1
    assert model_state_bytes(P, "bf16", "adamw", zero=1, dp=8, **titan)[1] == 4 * P // 8
    # Megatron's distributed optimizer keeps whole fp32 main gradients anyway; no dp: no FSDP2
    megatron = model_state_bytes(P, "bf16", "adamw", zero=1, dp=8, runtime="megatron", pp=4)
    assert megatron[1] == 4 * P
    assert model_state_bytes(P, "bf16", "adamw", zero=3, dp=1, pp=2)[1] == 2 * P


def test_activation_memory_by_hand():
    assert activation_bytes(1000, 4, checkpointing=False) == 4000
    kept = activation_bytes(
        1000,
        4,
        checkpointing=True,
        checkpoint_inputs_per_microbatch=100,
        largest_layer_saved=250,
        unchecked_saved_per_microbatch=50,
    )
    assert kept == (100 + 50) * 4 + 250
    # the loss's buffers at the start of backward, everything still held; a rebuild later,
    # once the head's 40 saved bytes per micro-batch have gone: whichever is larger
    later = dict(checkpointing=True, checkpoint_inputs_per_microbatch=100, largest_layer_saved=250)
    assert (
        activation_bytes(
            1000,
            4,
            **later,
            unchecked_saved_per_microbatch=50,
            saved_after_layers=40,
            workspace=100,
        )
        == 600 - 40 + 250
    )
    assert (
        activation_bytes(
            1000,
            4,
            **later,
            unchecked_saved_per_microbatch=50,
            saved_after_layers=40,
            workspace=300,
        )
        == 600 + 300
    )


def test_measured_compute_overrides_the_roofline():
    node = OpNode(
        name="mm",
        op="aten.linear.default",
        kind="linear",
        fwd_flops=10**12,
        bwd_flops=2 * 10**12,
        inputs=[TensorMeta(shape=[8, 1024], dtype="bfloat16")],
        params={"w": TensorMeta(shape=[1024, 1024], dtype="bfloat16")},
    )
    from planner.cluster.profiling import OpTimes, signature, work

    times = OpTimes()
    times.add(node.op, signature(node), work(node), 0.123, 0.456)
    measured = CostModel(parse_profile(PROFILE), "bf16", op_times=times)
    t = measured.node_time(node)
    assert (t.fwd, t.bwd) == (0.123, 0.456)
    achieved = CostModel(parse_profile(dict(PROFILE, measured={"achieved_flops": {"bf16": 80e12}})))
    assert achieved.node_time(node).fwd == pytest.approx(1e12 / 80e12)


def test_fsdp_collectives_are_one_message_per_layer(cm, mesh):
    """FSDP2 wraps each block: ZeRO-3 gathers a layer's parameters in one all-gather (twice
    per micro-batch) and reduce-scatters its gradients in one message, ZeRO-0 (`replicate`)
    all-reduces them in one, so the latency is paid once a layer."""
    from planner.cost.memory import bytes_per_param
    from planner.parallel import data

    dp = mesh.axis("dp")
    per = bytes_per_param("bf16", "adamw")
    layers, layer = 10, 50_000_000
    w, g = layer * per.weights, layer * per.grads
    hand = layers * (2 * (1e-4 + w / 2 / 10e9) + (1e-4 + g / 2 / 10e9))
    exposed = data.zero3_exposed(cm, dp, layers * layer, per, 0.0, 0.0, layer)
    assert exposed == pytest.approx(hand)
    # Hidden under as much compute, none exposed.
    assert data.zero3_exposed(cm, dp, layers * layer, per, hand, 1.0, layer) == 0.0
    # A measured overlap o (profile-cluster: comm and compute together take comm + compute -
    # o x min of the two) exposes (1 - o) of the comm run under longer compute.
    assert data.zero3_exposed(cm, dp, layers * layer, per, 2 * hand, 0.75, layer) == (
        pytest.approx(0.25 * hand)
    )
    assert data.exposed_sync(hand, 0.75, hand / 4, 1) == pytest.approx(hand / 2 + hand / 8)
    # ZeRO-1/2: one reduce-scatter and one all-gather per layer, once per step.
    sync = data.gradient_sync(cm, dp, layers * layer, per, 2, layer)
    assert sync == pytest.approx(layers * ((1e-4 + g / 2 / 10e9) + (1e-4 + w / 2 / 10e9)))
    # ZeRO-0 (FSDP2's replicate per block): one all-reduce per layer.
    ddp = data.gradient_sync(cm, dp, layers * layer, per, 0, layer)
    assert ddp == pytest.approx(layers * (2 * 1e-4 + g / 10e9))
    # Without a layer size: DDP's 25 MiB buckets, the latency paid per bucket.
    total = layers * g
    buckets = data.gradient_sync(cm, dp, layers * layer, per, 0)
    assert buckets == pytest.approx(total / (25 * 2**20) * (2 * 1e-4) + total / 10e9)
