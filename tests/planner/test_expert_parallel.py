"""Expert parallelism in the planner (planner/parallel/expert.py): searched beside keeping every
expert on every rank, priced and accounted in the plan's ledger as the GShard MoE's dispatch
says, refused by name where it cannot run."""

import math

import pytest

from autopar import api
from planner.errors import InputError

MOE = "moe-1.3b"  # 16 layers, every other one a top-2 MoE of 16 experts, hidden 768, FFN 6144
SEQ, BATCH = 1024, 64


def _plan(**pins):
    return api.plan(
        MOE, cluster="dgx-a100-80g", nodes=2, global_batch_size=BATCH, seq_len=SEQ, **pins
    )


def test_the_search_splits_experts_where_whole_copies_cost_more():
    """With DDP (ZeRO-0) every rank steps the optimizer over all 16 experts of every MoE
    layer; split over ep ranks each steps 16 / ep of them, for a few all-to-alls within a
    node: the search picks ep > 1. With ZeRO 2-3 the expert state is sharded over dp anyway
    and the all-to-alls only add time: it keeps every expert on every rank."""
    ddp = _plan(zero=0)
    assert (ddp.mesh.ep or 1) > 1
    assert any("Expert parallelism" in line for line in ddp.explanation)
    whole = _plan(zero=0, ep=1)
    assert ddp.predicted.step_time_s < whole.predicted.step_time_s
    assert ddp.predicted.peak_memory_bytes < whole.predicted.peak_memory_bytes
    sharded = _plan()
    assert sharded.stages[0].zero in (2, 3) and sharded.mesh.ep is None
    assert not any("Expert parallelism" in line for line in sharded.explanation)


def test_the_ledger_holds_the_dispatch_buffers_and_the_experts_a_rank_keeps():
    """The arithmetic from the model's definition (GShard, Lepikhin et al. 2020): each of
    the 8 MoE layers sends its [E, groups, C, hidden] buffer twice forward (dispatch,
    combine) and twice backward per micro-batch, C = ceil(capacity factor x top-k x group /
    E); a rank holds E / ep experts of 2 x hidden x FFN weights each (fp32 master copy)."""
    plan = _plan(zero=0, ep=4, mesh=(1, 16, 1), microbatch_size=2, checkpointing=False)
    experts, hidden, ffn, top_k, moe_layers = 16, 768, 8 * 768, 2, 8
    group = math.gcd(SEQ, 2048)  # tokens routed together: one sample's
    capacity = math.ceil(1.0 * top_k * group / experts)
    buffer = experts * (2 * SEQ // group) * capacity * hidden * 2  # bf16, micro-batch of 2
    m = plan.schedule.microbatches
    (ledger,) = [st.predicted.ledger for st in plan.stages]
    (a2a,) = [e for e in ledger.comm if e.kind == "all_to_all"]
    assert (a2a.axis, a2a.calls, a2a.bytes) == (
        "ep",
        4 * moe_layers * m,
        4 * moe_layers * m * buffer,
    )
    # the expert weights' gradients are all-reduced over the 4 ranks holding the same experts
    (edp,) = [e for e in ledger.comm if e.axis == "edp"]
    per_rank = moe_layers * (experts // 4) * 2 * hidden * ffn
    assert (edp.kind, edp.calls, edp.bytes) == ("all_reduce", moe_layers, per_rank * 4)
    whole = _plan(zero=0, ep=1, mesh=(1, 16, 1), microbatch_size=2, checkpointing=False)
    held = ledger.held[0].params
    assert whole.stages[0].predicted.ledger.held[0].params - held == (per_rank * 3) * 4


@pytest.mark.parametrize(
    ("pins", "says"),
    [
        ({"ep": 3}, "ep 3 does not divide the 16 experts"),
        ({"ep": 2, "zero": 1}, "ZeRO-1"),
        ({"ep": 2, "mesh": (1, 8, 2)}, "tp 1"),
    ],
)
def test_an_ep_that_cannot_run_is_refused_by_name(pins, says):
    with pytest.raises(InputError) as err:
        _plan(**pins)
    assert err.value.field == "search.ep" and says in str(err.value)


def test_a_dense_model_is_refused_expert_parallelism():
    with pytest.raises(InputError, match="expert parallelism to moe models") as err:
        api.plan("gpt-1.3b", cluster="dgx-a100-80g", global_batch_size=16, ep=2)
    assert err.value.field == "search.ep"


# transformers' Mixtral, small: dropless routing (its experts module takes the router's rows)
MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
}


def _mixtral(imbalance: float, **pins):
    return api.plan(
        hf_config=MIXTRAL,
        cluster="dgx-a100-80g",
        nodes=1,
        global_batch_size=32,
        seq_len=SEQ,
        dtype="bf16",
        expert_imbalance=imbalance,
        **pins,
    )


def test_a_stated_expert_imbalance_slows_the_busiest_rank_of_dropless_expert_parallelism():
    """With dropless routing the rank whose experts draw the most rows sets the pace: a
    stated imbalance f makes its expert GEMMs at least (f - 1) x their FLOPs at the device's
    peak longer, and its exchanges longer. Without ep every rank computes its own tokens'
    rows (top-k each, however routed): nothing changes. Capacity dispatch (the zoo's GShard)
    pads every buffer to the same size: nothing changes either."""
    pinned = {"mesh": (1, 8, 1), "zero": 0, "microbatch_size": 4}
    even, skewed = _mixtral(1.0, ep=8, **pinned), _mixtral(2.0, ep=8, **pinned)
    assert even.request.training.expert_imbalance == 1.0  # the default, left out of the JSON
    assert "expert_imbalance" not in even.to_json()
    assert skewed.request.training.expert_imbalance == 2.0
    # the busiest rank's extra rows: 4 samples x SEQ tokens x top-2 per layer and micro-batch,
    # three GEMMs of hidden x FFN, 2 FLOPs each forward and 4 backward; one micro-batch here
    rows = 4 * SEQ * 2 * MIXTRAL["num_hidden_layers"]
    flops = rows * 3 * MIXTRAL["hidden_size"] * MIXTRAL["intermediate_size"] * (2 + 4)
    peak = 312e12  # A100 bf16 dense (datasheet)
    slower = skewed.predicted.step_time_s - even.predicted.step_time_s
    assert slower >= (2.0 - 1) * flops / peak
    assert any("busiest rank routed 2x" in line for line in skewed.explanation)
    assert not any("busiest rank routed" in line for line in even.explanation)
    whole = _mixtral(1.0, ep=1, **pinned).predicted.step_time_s
    assert _mixtral(8.0, ep=1, **pinned).predicted.step_time_s == whole
    gshard = {"mesh": (1, 16, 1), "zero": 0, "ep": 4}
    step = [
        api.plan(
            MOE,
            cluster="dgx-a100-80g",
            nodes=2,
            global_batch_size=BATCH,
            seq_len=SEQ,
            expert_imbalance=f,
            **gshard,
        ).predicted.step_time_s
        for f in (1.0, 4.0)
    ]
    assert step[0] == step[1]


def test_the_search_weighs_expert_parallelism_against_the_stated_imbalance():
    """Under DDP, splitting the experts saves each rank their optimizer steps and wins when
    the routing is balanced; with every row on one rank (f = ep) it loses."""
    balanced = _mixtral(1.0, mesh=(1, 8, 1), zero=0)
    assert (balanced.mesh.ep or 1) > 1
    assert (_mixtral(8.0, mesh=(1, 8, 1), zero=0).mesh.ep or 1) < balanced.mesh.ep


def test_an_expert_imbalance_below_one_is_refused_by_name():
    with pytest.raises(InputError) as err:
        _mixtral(0.5)
    assert err.value.field == "training.expert_imbalance"


# Mixtral-8x7B's layer shapes, two layers, at 64K tokens: context parallelism over a node
MIXTRAL_LONG = {
    **MIXTRAL,
    **{"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32},
    **{"num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 65536},
}


def _mixtral_8x7b_layers(nodes: int, batch: int, seq: int, **pins):
    return api.plan(
        hf_config=MIXTRAL_LONG,
        cluster="dgx-h100",
        nodes=nodes,
        global_batch_size=batch,
        seq_len=seq,
        dtype="bf16",
        **pins,
    )


def _long(**pins):
    return _mixtral_8x7b_layers(1, 1, 65536, cp=8, **pins)


def test_expert_parallelism_is_drawn_from_the_context_parallel_ranks():
    """One sequence over 8 GPUs: dp 1, cp 8. With DDP every rank would step all 8 experts'
    optimizer state (61.7 GiB predicted); the search splits them over the 8 cp ranks, each
    routing its 8,192 tokens: each token all-to-all sends a rank's rows, tokens x top-2 x
    hidden in bf16 (a whole sequence's would be 8 times that). With ZeRO free, sharding the
    state over the cp ranks costs no all-to-alls and the search keeps the experts whole."""
    ddp = _long(zero=0)
    assert (ddp.mesh.dims.dp, ddp.mesh.cp, ddp.mesh.ep) == (1, 8, 8)
    whole = _long(zero=0, ep=1)
    assert ddp.predicted.step_time_s < whole.predicted.step_time_s
    assert ddp.predicted.peak_memory_bytes < whole.predicted.peak_memory_bytes
    (ledger,) = [st.predicted.ledger for st in ddp.stages]
    a2a = [e for e in ledger.comm if e.kind == "all_to_all"]
    tokens, layers, experts = 65536 // 8, 2, 8
    rows = tokens * 2 * 4096 * 2
    counts = layers * 8 * experts  # one int64 per expert, forward only
    assert {e.axis for e in a2a} == {"ep"}
    assert sum(e.calls for e in a2a) == layers * (1 + 4)
    assert sum(e.bytes for e in a2a) == layers * 4 * rows + counts
    sharded = _long()
    assert sharded.stages[0].zero in (2, 3) and sharded.mesh.ep is None


def test_ep_and_cp_groups_nest_or_are_refused_by_name():
    """ep groups are whole cp groups or parts of one (the executor's mesh splits the dp x cp
    ranks both ways); otherwise the refusal names both."""
    from planner.parallel.expert import mesh_refusal

    assert mesh_refusal(8, 4, 8, cp=2) is None  # two whole cp groups per ep group
    assert mesh_refusal(8, 2, 8, cp=4) is None  # two ep groups per cp group
    assert "ep 6 and cp 4" in mesh_refusal(12, 6, 24, cp=4)


def test_megatrons_layout_splits_each_experts_features_over_tp():
    """Expert tensor parallelism in Megatron's layout (Megatron-Core's default expert tp =
    tp): per MoE layer of transformers' Mixtral at tp 2, the gate/up grouped matmul is split
    by its output features and the down one by its input features, each on half the FLOPs;
    the weights [E, 2F, H] and [E, H, F] are held split on F; the experts' output (a partial
    sum) is all-reduced once in forward, and their two float inputs' gradients, the tokens
    and the router's weights, once each in backward."""
    from planner.graph.tracing import trace_model
    from planner.intra_op.megatron import tensor_parallel_layout
    from planner.models import ModelSpec, resolve

    batch, seq, hidden, top_k, fp32 = 2, 16, MIXTRAL["hidden_size"], 2, 4
    graph = trace_model(resolve(ModelSpec(hf_config=MIXTRAL)), batch, seq, "fp32")
    layouts = tensor_parallel_layout(graph, 2)
    experts = sorted({n.module for n in graph.nodes if n.kind == "grouped_mm"})
    assert len(experts) == MIXTRAL["num_hidden_layers"]
    for module in experts:
        nodes = [n for n in graph.nodes if n.module and n.module.startswith(module)]
        mms = [n for n in nodes if n.kind == "grouped_mm"]
        assert [layouts[n.name].strategy for n in mms] == ["cols", "contract"]
        assert [layouts[n.name].compute_shards for n in mms] == [2, 2]
        held = {k: v for n in nodes for k, v in layouts[n.name].params.items()}
        assert held == {f"{module}.gate_up_proj": "S(1)", f"{module}.down_proj": "S(2)"}
        fwd = [c for n in nodes for c in layouts[n.name].fwd_comm]
        bwd = sorted(c for n in nodes for c in layouts[n.name].bwd_comm)
        tokens = batch * seq
        assert fwd == [("all_reduce", tokens * hidden * fp32)]
        assert bwd == sorted(
            [("all_reduce", tokens * hidden * fp32), ("all_reduce", tokens * top_k * fp32)]
        )


def test_the_search_splits_experts_over_ep_beside_tp():
    """Mixtral-8x7B's layers on 16 H100 at tp 2: with DDP the search splits the experts over
    ep ranks as well as their features over tp (less time and memory than ep 1); with ZeRO
    free it shards their state instead and keeps ep 1."""

    def plan(**pins):
        return _mixtral_8x7b_layers(
            2, 16, 4096, sequence_parallel=True, mesh=(1, 8, 2), etp=2, **pins
        )

    ddp, whole = plan(zero=0), plan(zero=0, ep=1)
    assert ddp.mesh.dims.tp == 2 and (ddp.mesh.ep or 1) > 1 and ddp.mesh.etp is None
    assert ddp.predicted.step_time_s < whole.predicted.step_time_s
    assert ddp.predicted.peak_memory_bytes < whole.predicted.peak_memory_bytes
    assert plan().mesh.ep is None


def test_experts_are_priced_split_over_tp_only_where_the_layout_splits_them():
    """Transformers' experts of F features are split over a tp dividing F; otherwise, and
    for the zoo's GShard experts, each tp rank holds them whole: their expert weights at ep
    2 then cost 1/2 of the elements, not 1/(2 tp)."""
    from planner.parallel.expert import ExpertLayers

    routed = ExpertLayers([1000], [0.0], [0], experts=8, routed=True, features=14336)
    assert (routed.split(8), routed.split(1)) == (8, 1)
    odd = ExpertLayers([1000], [0.0], [0], experts=8, routed=True, features=6)
    assert odd.split(4) == 1
    assert ExpertLayers([1000], [0.0], [0], experts=8, features=14336).split(8) == 1


def test_expert_tp_1_runs_each_moe_block_on_its_token_shard():
    """Expert tp 1 in Megatron's layout with sequence parallelism (Megatron-Core's MoE
    parallel folding): every node of transformers' Mixtral MoE block computes 1 / tp of the
    tokens with whole weights, nothing gathered into or out of it, no all-reduce of the
    experts' output; the router's weight (not the experts', which ep synchronises) has its
    gradient all-reduced over tp once a step, as a norm's under sequence parallelism."""
    from planner.graph.tracing import trace_model
    from planner.intra_op.expert_layout import TOKENS
    from planner.intra_op.megatron import tensor_parallel_layout
    from planner.models import ModelSpec, resolve

    graph = trace_model(resolve(ModelSpec(hf_config=MIXTRAL)), 2, 16, "fp32")
    split = tensor_parallel_layout(graph, 2, sequence_parallel=True)
    folded = tensor_parallel_layout(graph, 2, sequence_parallel=True, fold_experts=True)
    blocks = sorted({n.module.rpartition(".")[0] for n in graph.nodes if n.kind == "grouped_mm"})
    assert len(blocks) == MIXTRAL["num_hidden_layers"]
    for block in blocks:
        nodes = [n for n in graph.nodes if n.module and n.module.startswith(block + ".")]
        assert {folded[n.name].strategy for n in nodes} == {TOKENS}
        assert {folded[n.name].compute_shards for n in nodes} == {2}
        assert not [c for n in nodes for c in folded[n.name].fwd_comm + folded[n.name].bwd_comm]
        assert {p for n in nodes for p in folded[n.name].params.values()} == {"R"}
        step = [c for n in nodes for c in folded[n.name].step_comm]
        router = MIXTRAL["num_local_experts"] * MIXTRAL["hidden_size"] * 4  # fp32
        assert step == [("all_reduce", router)]
        # the split layout gathers the block's input and all-reduces its experts' output
        assert [c for n in nodes for c in split[n.name].fwd_comm]
    outside = [n for n in graph.nodes if not any((n.module or "").startswith(b) for b in blocks)]
    assert all(folded[n.name].strategy == split[n.name].strategy for n in outside)


def test_the_search_folds_ep_over_the_tp_ranks_where_that_is_faster():
    """Mixtral-8x7B's layers on 16 H100 at tp 2 under DDP: the search keeps every expert
    whole and draws ep from the dp x tp ranks (expert tp 1), faster than splitting each
    expert's features over tp beside ep, and than ep 1. Each rank routes its sequence
    shard: a token all-to-all carries 1 / tp of a sample's rows, tokens x top-2 x hidden in
    bf16."""

    def plan(**pins):
        return _mixtral_8x7b_layers(2, 16, 4096, sequence_parallel=True, mesh=(1, 8, 2), **pins)

    folded, split, whole = plan(zero=0), plan(zero=0, etp=2), plan(zero=0, ep=1)
    assert folded.mesh.etp == 1 and folded.mesh.dims.folded and folded.mesh.ep > 2
    assert split.mesh.etp is None and (split.mesh.ep or 1) > 1
    assert folded.predicted.step_time_s < split.predicted.step_time_s
    assert folded.predicted.step_time_s < whole.predicted.step_time_s
    assert "expert tp 1" in " ".join(folded.explanation)
    (ledger,) = [st.predicted.ledger for st in folded.stages]
    a2a = [e for e in ledger.comm if e.kind == "all_to_all"]
    assert {e.axis for e in a2a} == {"ep"}
    m, layers, experts = folded.schedule.microbatches, 2, 8
    mbs = 16 // folded.mesh.dims.dp // m
    rows = mbs * 4096 // 2 * 2 * 4096 * 2  # a tp rank's tokens x top-2 x hidden x bf16
    counts = layers * m * 8 * experts
    assert sum(e.bytes for e in a2a) == layers * m * 4 * rows + counts


def test_expert_tp_1_draws_ep_from_the_cp_and_tp_ranks():
    """One 64K-token sequence of Mixtral-8x7B's layers on 8 H100 as cp 4 x tp 2 under DDP:
    the search keeps every expert whole with ep 8 over the cp x tp ranks, faster and smaller
    than ep 4 from the cp ranks beside experts split over tp; each all-to-all carries 1/8 of
    the sequence's rows (16,384 / 2 of a cp rank's tokens, x top-2 x hidden x bf16)."""

    def plan(**pins):
        return _mixtral_8x7b_layers(
            1, 1, 65536, mesh=(1, 1, 2), cp=4, zero=0, sequence_parallel=True, **pins
        )

    folded, split = plan(), plan(etp=2)
    assert (folded.mesh.etp, folded.mesh.ep, folded.mesh.cp) == (1, 8, 4)
    assert "over dp x cp x tp" in folded.mesh.dims.summary()
    assert split.mesh.etp is None and split.mesh.ep == 4
    assert folded.predicted.step_time_s < split.predicted.step_time_s
    assert folded.predicted.peak_memory_bytes < split.predicted.peak_memory_bytes
    (ledger,) = [st.predicted.ledger for st in folded.stages]
    a2a = [e for e in ledger.comm if e.kind == "all_to_all"]
    m, layers, experts = folded.schedule.microbatches, 2, 8
    rows = 65536 // 4 // 2 * 2 * 4096 * 2
    assert sum(e.bytes for e in a2a) == layers * m * 4 * rows + layers * m * 8 * experts


def test_the_search_splits_expert_features_where_whole_experts_do_not_fit():
    """Mixtral-8x7B on 64 H100 at tp 8 under DDP: with expert tp 1 a rank would hold one
    whole expert of every layer (ep at most the 8 experts) and nothing fits; splitting each
    expert's features over tp, the search fits it."""
    from planner.search.search import NoFeasiblePlan

    config = {**MIXTRAL_LONG, "num_hidden_layers": 32}

    def plan(**pins):
        return api.plan(
            hf_config=config,
            cluster="dgx-h100",
            nodes=8,
            global_batch_size=64,
            seq_len=4096,
            mesh=(1, 8, 8),
            zero=0,
            sequence_parallel=True,
            **pins,
        )

    chosen = plan()
    assert chosen.mesh.etp is None and chosen.mesh.dims.tp == 8
    with pytest.raises(NoFeasiblePlan):
        plan(etp=1)


@pytest.mark.parametrize(
    ("experts", "ep", "dp", "tp", "more", "says"),
    [
        (8, 4, 2, 2, {}, None),  # ep 4 over dp 2 x tp 2
        (12, 3, 3, 2, {}, "a multiple of tp 2"),
        (8, 4, 2, 2, {"cp": 2}, None),  # ep 4 over cp 2 x tp 2
        (12, 6, 6, 2, {"cp": 2}, "a multiple or a divisor of cp"),  # 3 tp groups, cp 2
        (8, 4, 1, 4, {"split_over_tp": False}, "GShard"),
        (8, 1, 2, 2, {}, "ep > 1"),
    ],
)
def test_expert_tp_1_is_refused_by_name_where_it_cannot_run(experts, ep, dp, tp, more, says):
    from planner.parallel.expert import mesh_refusal

    more = {"split_over_tp": True, **more}
    why = mesh_refusal(experts, ep, dp, tp, etp=1, **more)
    assert why is None if says is None else says in why


@pytest.mark.parametrize(
    ("pins", "says"),
    [
        ({"etp": 1, "ep": 1}, "1 with ep 1"),
        ({"etp": 4, "mesh": (1, 8, 2)}, "4 with tp 2"),
        ({"etp": 1, "sequence_parallel": False}, "sequence parallelism off"),
    ],
)
def test_an_expert_tp_pin_that_cannot_hold_is_refused_by_name(pins, says):
    with pytest.raises(InputError) as err:
        _mixtral_8x7b_layers(2, 16, 4096, **pins)
    assert err.value.field == "search.etp" and says in str(err.value)
