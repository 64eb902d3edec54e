import json

import pytest

from planner.cluster.profile import load_cluster
from planner.cost.schedules import bubble_fraction, inflight_microbatches, pipeline_time
from planner.errors import InputError
from planner.evaluate.config import ParallelConfig, split_layers
from planner.evaluate.estimate import evaluate
from planner.intra_op.megatron import tensor_parallel_layout
from planner.models import ModelSpec, resolve
from planner.plan import Plan, TrainingSettings
from planner.request import model_ref
from tests.conftest import traced

SMALL = {"layers": 4, "hidden": 256, "heads": 4}


def _estimate(dp, tp, pp, m, *, nodes=1, cluster="dgx-a100-80g", batch=32, seq=64, **kw):
    profile = load_cluster(cluster, nodes)
    config = ParallelConfig(dp=dp, tp=tp, pp=pp, microbatches=m, **kw)
    training = TrainingSettings(global_batch_size=batch, seq_len=seq)
    graph = traced("gpt-350m", config.microbatch_size(batch), seq, **SMALL)
    resolved = resolve(ModelSpec(name="gpt-350m", config=SMALL))
    return evaluate(graph, profile, training, config, model_ref(resolved, seq)), graph


def test_megatron_layout_of_a_gpt_block(small_gpt):
    layouts = tensor_parallel_layout(small_gpt, 4)
    block = {n.module: layouts[n.name] for n in small_gpt.nodes if n.layer == 1}
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert block[f"blocks.1.attn.{proj}"].strategy == "col"
    assert block["blocks.1.attn.out_proj"].strategy == "row"
    assert block["blocks.1.mlp.fc1"].strategy == "col"
    assert block["blocks.1.mlp.fc2"].strategy == "row"
    attention = next(
        layouts[n.name] for n in small_gpt.nodes if n.layer == 1 and n.kind == "attention"
    )
    assert attention.strategy == "heads"
    assert block["blocks.1.ln_1"].strategy == "replicate"
    layer_nodes = [layouts[n.name] for n in small_gpt.nodes if n.layer == 1]
    fwd = [c for lay in layer_nodes for c in lay.fwd_comm]
    bwd = [c for lay in layer_nodes for c in lay.bwd_comm]
    # Megatron: two all-reduces forward (attention out, MLP out), two backward (their inputs).
    assert [c[0] for c in fwd] == ["all_reduce", "all_reduce"]
    assert [c[0] for c in bwd] == ["all_reduce", "all_reduce"]
    assert block["blocks.1.mlp.fc1"].params == {
        "blocks.1.mlp.fc1.weight": "S(0)",
        "blocks.1.mlp.fc1.bias": "S(0)",
    }
    assert block["blocks.1.mlp.fc2"].params["blocks.1.mlp.fc2.weight"] == "S(1)"


def test_plan_is_valid_and_round_trips():
    plan, graph = _estimate(2, 2, 2, 4, zero=1, checkpointing=True)
    covered = [layer for st in plan.stages for layer in range(*st.layers)]
    assert covered == list(range(graph.num_layers))
    ranks = [r for st in plan.stages for r in st.ranks]
    assert sorted(ranks) == list(range(8))
    assert plan.mesh.shape == [2, 2, 2]
    assert all(st.predicted.memory.total <= 80 * 2**30 for st in plan.stages)
    assert Plan.from_json(plan.to_json()) == plan
    sharded = {s.node: s for s in plan.stages[0].shardings}
    fc1 = next(s for name, s in sharded.items() if s.strategy == "col")
    assert all(len(p) == 2 for p in fc1.params.values())  # one placement per (dp, tp) axis


def test_a_technique_stage_field_is_written_where_used_and_an_unknown_one_loads_when_off():
    """A plan carries a technique's stage field only where the technique is used, so a plan
    that does not use one loads in a build without it; a field this build does not know
    loads when off (false or null: written by a build with one more technique, unused) and
    is refused, named, when on."""
    from planner.parallel.registry import stage_fields

    plan, _ = _estimate(2, 2, 2, 4, zero=1)
    stage = json.loads(plan.to_json())["stages"][0]
    assert not set(stage_fields()) & set(stage)  # none used
    data = json.loads(plan.to_json())
    data["stages"][0] |= {"a_later_technique": False, "another": None}
    assert Plan.from_json(json.dumps(data)) == plan
    data["stages"][0]["a_later_technique"] = True
    with pytest.raises(InputError) as err:
        Plan.from_json(json.dumps(data))
    assert err.value.field == "plan.stages.0.a_later_technique"


def test_same_request_same_plan():
    a, _ = _estimate(2, 2, 2, 4)
    b, _ = _estimate(2, 2, 2, 4)
    da, db = json.loads(a.to_json()), json.loads(b.to_json())
    da["search"].pop("time_s"), db["search"].pop("time_s")
    assert da == db


def test_memory_per_device_by_hand_tp_pp():
    """tp=2 x pp=2: parameters per device from the Megatron layout, by hand."""
    plan, _ = _estimate(1, 2, 2, 2, nodes=1, cluster="cpu-local", batch=2)
    h, f, v, s, layers = 256, 1024, 51200, 64, 4
    layer = (3 * h * h + 3 * h) // 2 + h * h // 2 + h + (h * f + f) // 2 + f * h // 2 + h + 4 * h
    stage0 = v * h // 2 + s * h + layers // 2 * layer  # vocab-parallel wte, replicated wpe
    stage1 = layers // 2 * layer + 2 * h + v * h // 2  # ln_f and the tied head's own copy
    bf16, copy, adam = 2, 2, 12  # copy: autocast's bf16 copy of the fp32 weights
    for st, params in zip(plan.stages, (stage0, stage1), strict=True):
        assert st.predicted.memory.params == params * (bf16 + copy)
        assert st.predicted.memory.optimizer == params * adam


def test_memory_dp_only_and_zero3_by_hand():
    plan, graph = _estimate(4, 1, 1, 1, cluster="cpu-local", batch=8)
    params = graph.param_count
    mem = plan.stages[0].predicted.memory
    assert (mem.params, mem.grads, mem.optimizer) == (4 * params, 2 * params, 12 * params)
    loss = next(n for n in graph.nodes if n.op == "aten.cross_entropy_loss.default")
    workspace = 2 * loss.inputs[0].nbytes  # its two logits-sized fp32 buffers in backward
    assert mem.activations == graph.total("saved_bytes") + workspace
    plan3, _ = _estimate(4, 1, 1, 1, cluster="cpu-local", batch=8, zero=3)
    mem3 = plan3.stages[0].predicted.memory
    layer = max(sum(n.param_bytes for n in graph.nodes if n.layer == i) // 2 for i in range(4))
    # FSDP2 gathers one layer in bf16 (MixedPrecisionPolicy): no autocast copies (DDP's 4 above)
    assert mem3.params == -(-2 * params // 4) + 2 * layer
    # one micro-batch: FSDP2 reduces each unit's gradients in its backward; the root unit's
    # (embeddings, head, final norm) after the whole backward. Held unsharded (bf16) at
    # once: the root's made first (the head's, the tied embedding's head use) and the
    # largest layer's, or at the end the position table's (used before the layers only),
    # their own shards not yet made
    root = params - sum(
        sum(n.param_bytes for n in graph.nodes if n.layer == i) // 2 for i in range(4)
    )
    shared = {name for n in graph.nodes for name in n.shared_params}
    first = next(i for i, n in enumerate(graph.nodes) if n.layer is not None)
    before = sum(
        p.numel for n in graph.nodes[:first] for name, p in n.params.items() if name not in shared
    )
    held = root - before + max(layer, before)
    sharded = -(-2 * params // 4)
    assert mem3.grads == sharded + 2 * held - sharded * held // params
    assert mem3.optimizer == -(-12 * params // 4)


def test_checkpointing_trades_memory_for_time():
    plain, _ = _estimate(8, 1, 1, 4, batch=32)
    ckpt, _ = _estimate(8, 1, 1, 4, batch=32, checkpointing=True)
    assert ckpt.predicted.peak_memory_bytes < plain.predicted.peak_memory_bytes
    assert ckpt.predicted.step_time_s > plain.predicted.step_time_s


def test_gpipe_holds_more_activations_than_1f1b():
    gpipe, _ = _estimate(2, 1, 4, 8, schedule="gpipe")
    one_f_one_b, _ = _estimate(2, 1, 4, 8, schedule="1f1b")
    assert (
        gpipe.stages[0].predicted.memory.activations
        > one_f_one_b.stages[0].predicted.memory.activations
    )
    assert gpipe.predicted.step_time_s == pytest.approx(one_f_one_b.predicted.step_time_s)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dp": 3, "tp": 1, "pp": 1, "m": 1}, "^mesh: pp x dp x cp x tp = 3"),
        ({"dp": 8, "tp": 1, "pp": 1, "m": 3}, "training.global_batch_size: 32 is not divisible"),
        (
            {"dp": 1, "tp": 1, "pp": 8, "m": 4},
            "mesh.pp: 8 pipeline chunks but the model has only 4",
        ),
        ({"dp": 8, "tp": 1, "pp": 1, "m": 1, "zero": 4}, "^zero: 4 is not a ZeRO stage"),
        ({"dp": 8, "tp": 1, "pp": 1, "m": 1, "schedule": "zigzag"}, "schedule.name: unknown"),
        ({"dp": 8, "tp": 1, "pp": 1, "m": 1, "virtual_stages": 2}, "schedule.virtual_stages"),
    ],
)
def test_bad_configurations_name_the_field(kwargs, field):
    with pytest.raises(InputError, match=field):
        _estimate(kwargs.pop("dp"), kwargs.pop("tp"), kwargs.pop("pp"), kwargs.pop("m"), **kwargs)


def test_split_layers_balanced():
    assert split_layers(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


@pytest.mark.parametrize(("p", "m"), [(4, 8), (8, 64), (2, 1)])
def test_bubble_closed_forms(p, m):
    t = 0.5
    assert pipeline_time([t] * p, m) == pytest.approx((m + p - 1) * t)
    assert bubble_fraction([t] * p, m) == pytest.approx((p - 1) / (m + p - 1))
    v = 2
    # Interleaving shrinks the bubble to (p - 1) / (v m) of the ideal time.
    span = pipeline_time([t] * p, m, v)
    assert (span - m * t) / (m * t) == pytest.approx((p - 1) / (v * m))


def test_1f1b_inflight_microbatches():
    assert [inflight_microbatches("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert inflight_microbatches("1f1b", 0, 4, 2) == 2
    assert inflight_microbatches("gpipe", 3, 4, 8) == 8
    assert inflight_microbatches("interleaved_1f1b", 0, 4, 8, 2) == pytest.approx(4 * (1 + 3 / 8))


def test_stage_activation_memory_follows_1f1b():
    """Uniform stages: stage s keeps (p - s) micro-batches of its own layers, and of its
    output (torch's pipelining holds it until the micro-batch's backward)."""
    plan, graph = _estimate(1, 1, 4, 8, schedule="1f1b", cluster="cpu-local", batch=8, seq=64)
    per_layer = [sum(n.saved_bytes for n in graph.nodes if n.layer == i) for i in range(4)]
    output = graph.layer_input_bytes  # layer s's output is layer s + 1's input
    for s in (1, 2):  # the middle stages hold one layer each and nothing outside layers
        want = (4 - s) * (per_layer[s] + output[s + 1])
        assert plan.stages[s].predicted.memory.activations == want


def test_infeasible_memory_is_reported():
    plan, _ = _estimate(4, 1, 1, 1, cluster="cpu-local", batch=4096, seq=64)
    assert not plan.predicted.fits_in_memory
    assert any("does NOT fit" in line for line in plan.explanation)
