"""Sequence parallelism (planner/parallel/sequence.py, Megatron's layout with the residual
stream sharded on the sequence): the layout's collectives are those of Korthikanti et al.
2022 (section 4.2.2), its activations are smaller, the search takes it where it wins and
leaves it where the cluster's reduce-scatter and all-gather cost more than its all-reduce.
The executor runs it against the single-process reference (tests/executor/test_execute.py,
cases pp2xtp2-sequence-parallel and dp2xtp2-sequence-parallel-zero3-ckpt)."""

import pytest

from planner.cluster.mesh import LogicalMesh
from planner.cluster.profile import Measured, MeasuredPoint, load_cluster
from planner.cost.model import CostModel
from planner.errors import InputError
from planner.evaluate.layer_table import build_table
from planner.intra_op.megatron import tensor_parallel_layout
from planner.request import resolve_request
from planner.search.search import search
from planner.search.space import SearchOptions, pinned_options
from tests.conftest import traced

GRAPHS = {
    "gpt": lambda: traced("gpt-350m", batch=2, seq=64, layers=3, hidden=128, heads=8, vocab=512),
    "llama": lambda: traced(
        "llama3-8b", batch=2, seq=64, layers=3, hidden=128, heads=8, kv_heads=4, ffn_hidden=256
    ),
}


def _collectives(layouts, nodes, field):
    out = {}
    for n in nodes:
        for name, nbytes in getattr(layouts[n.name], field):
            out.setdefault(name, []).append(nbytes)
    return out


@pytest.mark.parametrize("family", sorted(GRAPHS))
@pytest.mark.parametrize("tp", [2, 4])
def test_each_layer_trades_its_all_reduces_for_a_reduce_scatter_and_an_all_gather(family, tp):
    graph = GRAPHS[family]()
    plain = tensor_parallel_layout(graph, tp)
    sp = tensor_parallel_layout(graph, tp, sequence_parallel=True)
    layer = graph.layer_nodes[1]
    hidden_bytes = next(n for n in layer if n.kind == "norm").outputs[0].nbytes  # [b, s, h]
    # Without: one all-reduce of [b, s, h] forward and one backward per attention and MLP.
    assert _collectives(plain, layer, "fwd_comm") == {"all_reduce": [hidden_bytes] * 2}
    assert _collectives(plain, layer, "bwd_comm") == {"all_reduce": [hidden_bytes] * 2}
    # With: forward all-gather before and reduce-scatter after each block, the transposes
    # backward; no all-reduce of activations, the norms' weight gradients once per step.
    for field in ("fwd_comm", "bwd_comm"):
        got = _collectives(sp, layer, field)
        assert got == {"all_gather": [hidden_bytes] * 2, "reduce_scatter": [hidden_bytes] * 2}
    norms = [n for n in layer if n.kind == "norm"]
    assert len(norms) == 2
    for n in norms:
        assert sp[n.name].outputs == ["S(1)"] and sp[n.name].compute_shards == tp
        # one per parameter (GPT's LayerNorm: weight and bias), as DTensor reduces them
        assert sp[n.name].step_comm == [("all_reduce", p.nbytes) for p in n.params.values()]
    # The tensor a layer hands to the next is a sequence shard.
    last = layer[-1]
    assert sp[last.name].outputs[0] == "S(1)" and plain[last.name].outputs[0] == "R"


@pytest.mark.parametrize("family", sorted(GRAPHS))
def test_activations_shrink_and_the_analytic_comm_time_is_unchanged(family):
    graph, tp = GRAPHS[family](), 4
    cluster = load_cluster("dgx-a100-80g")
    mesh = LogicalMesh.contiguous(cluster, 0, (1, tp))
    cm = CostModel(cluster, "bf16")
    plain = build_table(graph, tensor_parallel_layout(graph, tp), cm, mesh)[0]
    sp = build_table(graph, tensor_parallel_layout(graph, tp, sequence_parallel=True), cm, mesh)[0]
    # Layer 1's norms, residual adds and the tensors between blocks are kept 1/tp.
    assert sp.inside["saved"][1] < plain.inside["saved"][1]
    assert sp.layer_inputs[1] * tp == plain.layer_inputs[1]
    # Ring reduce-scatter + all-gather move the bytes of one ring all-reduce in as many hops.
    for field in ("comm_fwd", "comm_bwd"):
        assert sp.inside[field][1] == pytest.approx(plain.inside[field][1], rel=1e-9)
    assert sp.inside["fwd"][1] < plain.inside["fwd"][1]  # norms on 1/tp of the tokens


def _gpt_inputs(cluster, memory_gib=None, seq=1024):
    if memory_gib is not None:
        device = cluster.device.model_copy(update={"memory_bytes": int(memory_gib * 2**30)})
        cluster = cluster.model_copy(update={"device": device})
    training = {"global_batch_size": 16, "seq_len": seq, "dtype": "bf16"}
    return resolve_request({"name": "gpt-350m"}, cluster, training).trace()


def _best(inputs, mesh, sequence_parallel=None, checkpointing=(False, True), mbs=16):
    layouts = (
        ("megatron", "megatron_sp")
        if sequence_parallel is None
        else (("megatron_sp",) if sequence_parallel else ("megatron",))
    )
    options = SearchOptions(
        mesh=mesh, layouts=layouts, checkpointing=checkpointing, microbatch_sizes=(mbs,)
    )
    return search(inputs, options).plan


def test_sequence_parallelism_wins_where_activations_decide_and_where_memory_is_ample():
    cluster = load_cluster("dgx-a100-80g")
    ample = _gpt_inputs(cluster)
    mesh = (1, 1, 8)
    chosen = _best(ample, mesh)
    plain = _best(ample, mesh, sequence_parallel=False)
    assert chosen.sequence_parallel and not plain.sequence_parallel
    assert chosen.predicted.step_time_s < plain.predicted.step_time_s
    assert chosen.predicted.peak_memory_bytes < plain.predicted.peak_memory_bytes
    # Memory between the two peaks without checkpointing: only sequence parallelism avoids
    # recomputing the forward.
    sp_peak = _best(ample, mesh, True, (False,)).predicted.peak_memory_bytes
    plain_peak = _best(ample, mesh, False, (False,)).predicted.peak_memory_bytes
    assert sp_peak < plain_peak
    tight = _gpt_inputs(cluster, memory_gib=(sp_peak + plain_peak) / 2 / 2**30)
    chosen = _best(tight, mesh)
    assert chosen.sequence_parallel
    assert not any(st.activation_checkpointing for st in chosen.stages)
    assert _best(tight, mesh, sequence_parallel=False).stages[0].activation_checkpointing


# gloo on this project's 2-core CPU box, 2 processes: 20 timed repetitions each, medians of
# `torch.distributed` all_reduce / reduce_scatter_tensor / all_gather_into_tensor on fp32
# tensors of 64 KiB, 1 MiB and 8 MiB (what `autopar profile-cluster` records per collective).
GLOO_2 = {
    "all_reduce": [(2**16, 1.241e-3), (2**20, 1.693e-3), (2**23, 12.506e-3)],
    "reduce_scatter": [(2**16, 3.464e-3), (2**20, 2.115e-3), (2**23, 20.200e-3)],
    "all_gather": [(2**16 // 2, 0.694e-3), (2**20 // 2, 4.767e-3), (2**23 // 2, 11.265e-3)],
}


def test_sequence_parallelism_loses_where_reduce_scatter_and_all_gather_cost_more():
    points = {
        name: [MeasuredPoint(group_size=2, bytes=b, seconds=s) for b, s in rows]
        for name, rows in GLOO_2.items()
    }
    cluster = load_cluster("cpu-local")
    cluster = cluster.model_copy(update={"measured": Measured(collectives={"intra_node": points})})
    inputs = _gpt_inputs(cluster, seq=256)
    mesh = (1, 2, 2)
    chosen = _best(inputs, mesh, mbs=2)
    sp = _best(inputs, mesh, sequence_parallel=True, mbs=2)
    assert not chosen.sequence_parallel
    assert chosen.predicted.step_time_s < sp.predicted.step_time_s
    assert chosen.predicted.comm_s < sp.predicted.comm_s


def test_sequence_parallelism_pinned_where_it_cannot_apply_says_why():
    cluster = load_cluster("dgx-a100-80g")
    inputs = resolve_request(
        {"name": "moe-380m"}, cluster, {"global_batch_size": 8, "seq_len": 256}
    ).trace()
    with pytest.raises(InputError) as err:
        search(inputs, SearchOptions(mesh=(1, 4, 2), layouts=("megatron_sp",)))
    assert err.value.field == "search.sequence_parallel" and "moe model" in str(err.value)


def test_pins_name_their_field():
    assert pinned_options(sequence_parallel=True)["layouts"] == ("megatron_sp",)
    assert pinned_options(tp_layout="megatron")["layouts"] == ("megatron", "megatron_sp")
    with pytest.raises(InputError) as err:
        pinned_options(tp_layout="per_node", sequence_parallel=True)
    assert err.value.field == "search.sequence_parallel"


def test_grouped_query_k_and_v_are_column_parallel_and_a_router_is_not():
    """Grouped-query attention's k and v projections are narrow at large hidden sizes (8 kv
    heads of 128 at hidden 16,384: 1/16), yet Megatron and torchtitan shard them by kv head:
    column-parallel, the attention head-parallel. An MoE router (narrow, into a softmax)
    stays replicated."""
    from planner.cluster.profile import load_cluster
    from planner.intra_op.megatron import tensor_parallel_layout
    from planner.request import resolve_request

    cluster = load_cluster("dgx-h100")
    config = {"layers": 2, "hidden": 1024, "heads": 16, "kv_heads": 2, "ffn_hidden": 2048}
    fields = {"global_batch_size": 8, "seq_len": 64}
    llama = resolve_request({"name": "llama3-8b", "config": config}, cluster, fields)
    graph = llama.trace((1,)).at(1)
    layouts = tensor_parallel_layout(graph, 2)
    narrow = [
        n
        for n in graph.nodes
        if n.kind == "linear" and n.params and next(iter(n.params.values())).shape[0] * 4 < 1024
    ]
    assert len(narrow) == 4  # k and v of each layer
    assert {layouts[n.name].strategy for n in narrow} == {"col"}
    attention = [n for n in graph.nodes if n.kind == "attention"]
    assert {layouts[n.name].strategy for n in attention} == {"heads"}
    moe = resolve_request({"name": "moe-380m"}, cluster, fields).trace((1,)).at(1)
    moe_layouts = tensor_parallel_layout(moe, 2)
    routers = [n for n in moe.nodes if n.kind == "linear" and n.outputs[0].shape[-1] == 8]
    assert routers and all(moe_layouts[n.name].strategy == "replicate" for n in routers)
    assert all(set(moe_layouts[n.name].params.values()) == {"R"} for n in routers)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_transformers_rmsnorm_traced_op_by_op_runs_on_its_sequence_shard(model_type):
    """transformers' RMSNorm is traced as its ops (cast, pow, mean, rsqrt, the weight's
    multiply): under sequence parallelism each stays on the sequence shard (no gather for
    the mean over the hidden dim), and the weight the multiply broadcasts is all-reduced
    once per step, as the zoo's norm nodes are; Qwen3's q/k norms, on each rank's heads,
    all-reduce theirs with or without sequence parallelism."""
    from planner.graph.trace_cache import trace_model
    from planner.models import ModelSpec, resolve
    from tests.hf_configs import TINY_DECODER

    model = resolve(ModelSpec(hf_config={"model_type": model_type, **TINY_DECODER}))
    graph = trace_model(model, 2, 16, "fp32")
    tp = 2
    plain = tensor_parallel_layout(graph, tp)
    sp = tensor_parallel_layout(graph, tp, sequence_parallel=True)
    layer = graph.layer_nodes[1]
    hidden_bytes = 2 * 16 * TINY_DECODER["hidden_size"] * 4
    for field in ("fwd_comm", "bwd_comm"):
        got = _collectives(sp, layer, field)
        assert got == {"all_gather": [hidden_bytes] * 2, "reduce_scatter": [hidden_bytes] * 2}
    norms = {n.module for n in layer if "layernorm" in n.module}
    assert len(norms) == 2
    for n in layer:
        if n.module in norms:
            assert sp[n.name].outputs[0] == "S(1)" and sp[n.name].compute_shards == tp, n.name
    weighted = {n.module: n for n in layer if n.params and n.kind == "elementwise"}
    for module, n in weighted.items():
        weight = next(iter(n.params.values()))
        reduced = [("all_reduce", weight.nbytes)]
        if module in norms:  # replicated activations without sequence parallelism
            assert sp[n.name].step_comm == reduced and plain[n.name].step_comm == []
        else:  # q_norm, k_norm: head shards either way
            assert sp[n.name].step_comm == reduced == plain[n.name].step_comm
    assert len(weighted) == (4 if model_type == "qwen3" else 2)


def test_sequence_parallelism_applies_to_the_transformers_types_the_executor_runs_only():
    from planner.parallel import sequence

    assert sequence.refusal("hf", 64, 2, {"model_type": "mistral"}) is None
    assert sequence.refusal("hf", 64, 2, {"model_type": "gemma2"}) is None
    assert sequence.refusal("hf", 64, 2, {"model_type": "qwen2_moe"}) is None
    why = sequence.refusal("hf", 64, 2, {"model_type": "gpt2"})
    assert why is not None and "Hugging Face gpt2 model" in why
    assert sequence.megatron_kinds(
        ("megatron", "megatron_sp"), "hf", 64, 2, {"model_type": "qwen2"}
    ) == ["megatron", "megatron_sp"]


def test_the_search_chooses_sequence_parallelism_for_a_transformers_llama_where_it_pays():
    """The same trade on a Hugging Face Llama as on the zoo's models: with tp 8, norms and
    residuals on 1/8 of the tokens make the step faster and the activations smaller."""
    config = {
        "model_type": "llama",
        **{"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816},
        **{"num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 8},
    }
    training = {"global_batch_size": 16, "seq_len": 1024, "dtype": "bf16"}
    inputs = resolve_request({"hf_config": config}, load_cluster("dgx-a100-80g"), training).trace()
    chosen = _best(inputs, (1, 1, 8))
    plain = _best(inputs, (1, 1, 8), sequence_parallel=False)
    assert chosen.sequence_parallel and not plain.sequence_parallel
    assert chosen.predicted.step_time_s < plain.predicted.step_time_s
    assert chosen.predicted.peak_memory_bytes < plain.predicted.peak_memory_bytes
    gpt2 = {"model_type": "gpt2", "n_embd": 1024, "n_layer": 2, "n_head": 16}
    gpt2 = resolve_request(
        {"hf_config": {**gpt2, "vocab_size": 32000, "n_positions": 1024}},
        load_cluster("dgx-a100-80g"),
        training,
    ).trace()
    assert not _best(gpt2, (1, 1, 8)).sequence_parallel  # not one the executor runs
