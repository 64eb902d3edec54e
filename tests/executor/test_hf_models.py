"""Hugging Face models built by transformers, planned from their config and run on 4 real gloo
processes: each matches the single-process reference of the same transformers model."""

import json

import pytest

from api.cli import main as cli_main
from executor.local_ranks import run_local
from executor.optim import DEFAULT_LR
from executor.reference import distributed_losses, distributed_params, reference_run
from planner.executable import plan_executor_mode
from planner.plan import Plan
from tests.executor.ledger_check import check_ledger
from tests.hf_configs import TINY_DECODER

pytest.importorskip("transformers")

SMALL = TINY_DECODER
CONFIGS = {
    "llama": {"model_type": "llama", **SMALL},
    # Qwen2 with tied embeddings: the first and last pipeline stages each hold the table.
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], **SMALL, "tie_word_embeddings": True},
    "mixtral": {"model_type": "mixtral", **SMALL, "num_local_experts": 4},
    # RMSNorms on each head's queries and keys, inside the head-parallel attention
    "qwen3": {"model_type": "qwen3", **SMALL},
    "gemma3_text": {"model_type": "gemma3_text", **SMALL, "head_dim": 16},
    # Llama's layers with multipliers on the embeddings, residuals and logits; its base
    # model multiplies the hidden states a later pipeline stage is given too
    "granite": {"model_type": "granite", **SMALL, "embedding_multiplier": 4.0},
    # attention and MLP side by side on one norm's output (each reduces its input gradient)
    "phi": {"model_type": "phi", **SMALL},
    # LayerNorms with biases; an MLP module called with its input positionally, its
    # parameter named hidden_states as transformers' attention's keyword
    "starcoder2": {"model_type": "starcoder2", **SMALL},
    # attention that views its queries by the head count it holds (the rank's under tp)
    "stablelm": {"model_type": "stablelm", **SMALL},
    # rotary embeddings on interleaved halves (a stack on a new last dim)
    "cohere": {"model_type": "cohere", **SMALL},
    # norms after each block, and on the whole q and k projections (tp-split: their mean
    # is each rank's part, all-reduced)
    "olmo2": {"model_type": "olmo2", **SMALL},
    # the embeddings scaled by sqrt(hidden) in their own module
    "gemma2": {"model_type": "gemma2", **SMALL, "head_dim": 16},
    # a window of 12 tokens: with 16 per sequence, its mask differs from the causal one
    "mistral-window12": {"model_type": "mistral", **SMALL, "sliding_window": 12},
    # Gemma 2 with windows of 6 tokens on every other layer (a mask per layer type), its
    # weights drawn 25x wider than the default and its scores soft-capped at 1: a tiny
    # model's scores are far from the default cap of 50, where the cap changes nothing
    "gemma2-window6": {
        "model_type": "gemma2",
        **{**SMALL, "head_dim": 16, "sliding_window": 6},
        **{"initializer_range": 0.5, "attn_logit_softcapping": 1.0},
    },
    "gemma3_text-window6": {
        "model_type": "gemma3_text",
        **{**SMALL, "num_hidden_layers": 6},
        **{"head_dim": 16, "sliding_window": 6},
    },
    # Llama's attention (the default scale, no soft-capping or windows) after a scaled embedding
    "gemma": {"model_type": "gemma", **SMALL, "head_dim": 16},
    # a shared expert beside the routed ones, gated by its own sigmoid
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        **SMALL,
        **{"moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
        **{"num_experts": 4, "num_experts_per_tok": 2},
    },
    # multi-head latent attention, a dense first layer, then routed and shared experts
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        **{**SMALL, "num_key_value_heads": 4},
        **{"moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2},
        **{"n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1},
        **{"kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8},
        **{"qk_nope_head_dim": 8, "v_head_dim": 16},
    },
    "gpt2": {
        "model_type": "gpt2",
        "vocab_size": 128,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
}
# model, dtype, optimizer, pinned flags. HF Llama pp2 x tp2 (interleaved) runs under torchrun
# in tests/executor/test_example.py, through autopar.parallelize. GPT-2's fused Conv1D q/k/v
# has no parallel style, so its tp plan runs in graph mode, cut into pipeline stages.
CASES = {
    "qwen2-dp2xtp2-bf16-adamw": (
        "qwen2",
        "bf16",
        "adamw",
        *("--mesh", "1x2x2", "--zero", "3", "--tp-layout", "megatron"),
    ),
    # sequence parallelism: norms and residuals on sequence shards, rotary positions of the
    # whole sequence passed to a model whose embeddings' output is a shard
    "llama-pp2xtp2-sequence-parallel": (
        *("llama", "fp32", "sgd"),
        *("--mesh", "2x1x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
    ),
    "qwen3-dp2xtp2-sequence-parallel": (
        *("qwen3", "fp32", "sgd"),
        *("--mesh", "1x2x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
    ),
    "granite-pp2xtp2-sequence-parallel": (
        *("granite", "fp32", "sgd"),
        *("--mesh", "2x1x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
    ),
    # sequence parallelism with sliding windows: masks of the whole sequence, not the shard
    "mistral-window12-dp2xtp2-sequence-parallel": (
        *("mistral-window12", "fp32", "sgd"),
        *("--mesh", "1x2x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
    ),
    # ... and scaled embeddings (reduce-scattered, then scaled)
    "gemma2-window6-pp2xtp2-sequence-parallel": (
        *("gemma2-window6", "fp32", "sgd"),
        *("--mesh", "2x1x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
    ),
    # fp8 matmuls (torchao's tensorwise Float8Linear; torch's software float8 GEMM on the
    # CPU) in transformers' linears, checked against the fp8 reference: dp 1, so that each
    # micro-batch's scales are the reference's
    "llama-pp2xtp2-fp8-sequence-parallel": (
        *("llama", "fp32", "sgd"),
        *("--mesh", "2x1x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
        *("--fp8", "tensorwise"),
    ),
    # ... with selective checkpointing of Gemma 2's layers
    "gemma2-pp2xtp2-fp8-selective-ckpt": (
        *("gemma2", "fp32", "sgd"),
        *("--mesh", "2x1x2", "--tp-layout", "megatron", "--fp8", "tensorwise"),
        *("--checkpointing", "selective"),
    ),
    "gemma2-pp2xdp2": (*("gemma2", "fp32", "sgd"), *("--mesh", "2x2x1", "--zero", "1")),
    "phi-dp2xtp2": (*("phi", "fp32", "sgd"), *("--mesh", "1x2x2", "--tp-layout", "megatron")),
    "phi-pp2xtp2-sequence-parallel": (
        *("phi", "fp32", "sgd"),
        *("--mesh", "2x1x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
    ),
    "stablelm-pp2xtp2-sequence-parallel": (
        *("stablelm", "fp32", "sgd"),
        *("--mesh", "2x1x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
    ),
    "starcoder2-dp2xtp2-sequence-parallel": (
        *("starcoder2", "fp32", "sgd"),
        *("--mesh", "1x2x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
    ),
    "cohere-pp2xtp2-sequence-parallel": (
        *("cohere", "fp32", "sgd"),
        *("--mesh", "2x1x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
    ),
    "olmo2-dp2xtp2-sequence-parallel": (
        *("olmo2", "fp32", "sgd"),
        *("--mesh", "1x2x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
    ),
    # Gemma 3: q/k norms scaling by 1 + weight on each rank's heads
    "gemma3_text-pp2xtp2": (
        *("gemma3_text", "fp32", "sgd"),
        *("--mesh", "2x1x2", "--tp-layout", "megatron", "--schedule", "1f1b"),
    ),
    "mixtral-pp2xtp2": (
        *("mixtral", "fp32", "sgd", "--mesh", "2x1x2", "--tp-layout", "megatron", "--ep", "1"),
    ),
    # the experts' block whole on every tp rank: its input gathered from the sequence
    # shards, its output cut back (and that gradient gathered: whole gradients, no
    # reduce-scatter)
    # ... and a shared expert beside the routed ones, tp-split as an MLP on the whole tokens
    "qwen2_moe-pp2xtp2-sequence-parallel": (
        *("qwen2_moe", "fp32", "sgd"),
        *("--mesh", "2x1x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
        *("--ep", "1"),
    ),
    "mixtral-dp2xtp2-sequence-parallel": (
        *("mixtral", "fp32", "sgd"),
        *("--mesh", "1x2x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
        *("--ep", "1"),
    ),
    "gpt2-pp2xtp2-graph": ("gpt2", "fp32", "sgd", "--mesh", "2x1x2"),
    # expert parallelism, dropless: tokens to their experts' ranks by all-to-alls of uneven
    # splits; the experts' gradients over the ranks holding the same (none at ep = dp)
    "mixtral-dp4-ep2-zero0": (
        "mixtral",
        "fp32",
        "sgd",
        "--mesh",
        "1x4x1",
        "--ep",
        "2",
        "--zero",
        "0",
    ),
    "qwen2_moe-dp4-ep4-zero3": (
        *("qwen2_moe", "fp32", "sgd"),
        *("--mesh", "1x4x1", "--ep", "4", "--zero", "3"),
    ),
    # expert tp 1: every expert whole, each MoE block on its tp rank's sequence shard, the
    # router's weights' gradients summed over tp, ep over the dp x tp ranks (all four)
    "mixtral-dp2xtp2-ep4-etp1-zero3": (
        *("mixtral", "fp32", "sgd"),
        *("--mesh", "1x2x2", "--ep", "4", "--etp", "1", "--zero", "3"),
    ),
    # ... with a shared expert beside the routed ones, whole too; ep over one tp group
    "qwen2_moe-dp2xtp2-ep2-etp1-zero2": (
        *("qwen2_moe", "fp32", "sgd"),
        *("--mesh", "1x2x2", "--ep", "2", "--etp", "1", "--zero", "2"),
    ),
    # ... under context parallelism: ep over the cp x tp ranks (one ep group of two cp x
    # tp ranks each, all-gathered keys and values), and within one cp rank's tp group (ring)
    "mixtral-cp2xtp2-ep4-etp1-zero3": (
        *("mixtral", "fp32", "sgd"),
        *("--mesh", "1x1x2", "--cp", "2", "--cp-comm", "all_gather"),
        *("--ep", "4", "--etp", "1", "--zero", "3"),
    ),
    "mixtral-cp2xtp2-ep2-etp1-ring-zero2": (
        *("mixtral", "fp32", "sgd"),
        *("--mesh", "1x1x2", "--cp", "2", "--cp-comm", "ring"),
        *("--ep", "2", "--etp", "1", "--zero", "2"),
    ),
    "deepseek_v3-pp2xdp2-ep2-zero2-ckpt": (
        *("deepseek_v3", "fp32", "sgd"),
        *("--mesh", "2x2x1", "--ep", "2", "--zero", "2", "--checkpointing", "on"),
        *("--microbatch-size", "1"),
    ),
    # bf16 under DDP (ZeRO-0): the parameters cast for compute by FSDP2's replicate, so the
    # residual stream and with it the tp collectives are bf16, as the plan prices them
    "llama-dp2xtp2-bf16-adamw-zero0": (
        *("llama", "bf16", "adamw"),
        *("--mesh", "1x2x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
        *("--zero", "0"),
    ),
    # context parallelism through transformers' attention interface, rotary positions from
    # the rank's position_ids: each exchange
    "llama-dp2xcp2-all-gather": (
        "llama",
        "fp32",
        "sgd",
        *("--mesh", "1x2x1", "--cp", "2", "--cp-comm", "all_gather", "--zero", "1"),
    ),
    "qwen2-pp2xcp2-ring": (
        "qwen2",
        "fp32",
        "sgd",
        *("--mesh", "2x1x1", "--cp", "2", "--cp-comm", "ring", "--checkpointing", "on"),
    ),
    # a MoE model's attention under context parallelism, its experts on each rank's tokens
    "mixtral-dp2xcp2-ring": (
        *("mixtral", "fp32", "sgd"),
        *("--mesh", "1x2x1", "--cp", "2", "--cp-comm", "ring", "--zero", "2"),
    ),
    # experts split over ep and each expert's features over tp (expert tensor parallelism):
    # the all-to-alls on the ep ranks of a tp index, the output summed over tp
    "mixtral-dp2xtp2-ep2-sequence-parallel-zero3": (
        *("mixtral", "fp32", "sgd"),
        *("--mesh", "1x2x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
        *("--ep", "2", "--etp", "2", "--zero", "3"),
    ),
    # experts split over the dp x cp ranks, cp innermost: an ep group of two whole cp
    # groups (ep 4 > cp 2), and two ep groups inside one cp group of 4 (ep 2 < cp 4)
    "mixtral-dp2xcp2-ep4-ring": (
        *("mixtral", "fp32", "sgd"),
        *("--mesh", "1x2x1", "--cp", "2", "--cp-comm", "ring", "--ep", "4", "--zero", "0"),
    ),
    "qwen2_moe-cp4-ep2-all-gather-zero3": (
        *("qwen2_moe", "fp32", "sgd"),
        *("--mesh", "1x1x1", "--cp", "4", "--cp-comm", "all_gather", "--ep", "2", "--zero", "3"),
    ),
    # Gemma 2's ring attention with its windows of 6 tokens on every other layer, scores
    # soft-capped and scaled by query_pre_attn_scalar (256: not 1/sqrt(head_dim))
    "gemma2-window6-dp2xcp2-ring": (
        *("gemma2-window6", "fp32", "sgd"),
        *("--mesh", "1x2x1", "--cp", "2", "--cp-comm", "ring", "--zero", "1"),
    ),
    # Gemma 3's with windows of 6 tokens on 5 of every 6 layers and its q/k norms
    "gemma3_text-window6-pp2xcp2-ring": (
        *("gemma3_text-window6", "fp32", "sgd"),
        *("--mesh", "2x1x1", "--cp", "2", "--cp-comm", "ring"),
    ),
    # DeepSeek-V3 under tp: its latent attention whole on every rank (its latent projection
    # split by features, its rotary key shared by all heads), its MLPs and experts' block
    # as Megatron's layout has them
    "deepseek_v3-pp2xtp2": (
        *("deepseek_v3", "fp32", "sgd"),
        *("--mesh", "2x1x2", "--tp-layout", "megatron", "--ep", "1"),
    ),
    # ... and with sequence parallelism: its latent attention and its experts' block each
    # gathered once from the sequence shards and cut back, the shared expert inside tp-split
    "deepseek_v3-dp2xtp2-sequence-parallel": (
        *("deepseek_v3", "fp32", "sgd"),
        *("--mesh", "1x2x2", "--tp-layout", "megatron", "--sequence-parallel", "on"),
        *("--ep", "1"),
    ),
    # DeepSeek-V3's multi-head latent attention (values narrower than queries and keys)
    "deepseek_v3-dp2xcp2-ring": (
        *("deepseek_v3", "fp32", "sgd"),
        *("--mesh", "1x2x1", "--cp", "2", "--cp-comm", "ring", "--zero", "1"),
    ),
    "gemma-dp2xcp2-ulysses": (
        *("gemma", "fp32", "sgd"),
        *("--mesh", "1x2x1", "--cp", "2", "--cp-comm", "ulysses", "--zero", "1"),
    ),
    "llama-cp2xtp2-ulysses": (
        "llama",
        "fp32",
        "sgd",
        *("--mesh", "1x1x2", "--cp", "2", "--cp-comm", "ulysses", "--tp-layout", "megatron"),
    ),
}


def hf_plan(tmp_path, model: str, dtype: str, optimizer: str, *pins: str):
    config = tmp_path / f"{model}.json"
    config.write_text(json.dumps(CONFIGS[model]))
    path = tmp_path / "plan.json"
    args = ["plan", "--hf-config", str(config), "--cluster", "cpu-local", "--global-batch", "8"]
    args += ["--seq", "16", "--dtype", dtype, "--optimizer", optimizer, "--no-baselines"]
    args += ["--executable-only", "-o", str(path), *pins]
    assert cli_main(args) == 0
    return Plan.from_json(path.read_text()), path


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_model_matches_single_process_reference(tmp_path, case):
    model, dtype, optimizer, *pins = CASES[case]
    plan, _ = hf_plan(tmp_path, model, dtype, optimizer, *pins)
    assert plan.request.model.family == "hf" and plan.executable
    pinned = dict(zip(pins[::2], pins[1::2], strict=True))
    dims = plan.mesh.dims
    assert f"{dims.pp}x{dims.dp}x{dims.tp}" == pinned["--mesh"]
    assert dims.cp == int(pinned.get("--cp", 1))
    assert (plan.mesh.cp_comm or "all_gather") == pinned.get("--cp-comm", "all_gather")
    assert (plan.mesh.ep or 1) == int(pinned.get("--ep", 1))
    assert plan.mesh.etp == (1 if pinned.get("--etp") == "1" else None)
    assert plan.fp8 == pinned.get("--fp8")
    if pinned.get("--checkpointing") == "selective":
        assert all(st.checkpoint_policy == "selective" for st in plan.stages)
    ranks = run_local(plan, steps=3, timeout_s=240)  # the worker on 4 forked gloo ranks
    assert {r["mode"] for r in ranks} == {plan_executor_mode(plan)}
    assert "graph" not in case or plan_executor_mode(plan) == "graph"
    reference = reference_run(plan, steps=3)
    params = distributed_params(ranks)
    assert set(reference["params"]) - {"lm_head.weight"} <= set(params)  # tied: one name
    if dtype == "fp32" and optimizer == "sgd":
        rel, abs_ = 1e-5, 1e-5
    else:  # as tests/executor/test_training_recipe.py: Adam's lr-sized noise, bf16 rounding
        rel, abs_ = 1e-4, 2 * DEFAULT_LR[optimizer] * 3
    assert distributed_losses(ranks, plan) == pytest.approx(reference["losses"], rel=rel)
    for name, values in params.items():
        assert values == pytest.approx(reference["params"][name], abs=abs_), name
    check_ledger(plan, ranks)


@pytest.mark.distributed
def test_a_traced_model_runs_with_its_factory(tmp_path):
    """`autopar trace pkg.module:factory` -> `autopar plan --graph` -> the executor builds
    the model with the same factory (given on this machine) and runs the plan in graph mode,
    pp2 x tp2 with a per-node layout."""
    factory = "tests.model_factories:tiny_llama"
    graph, path = tmp_path / "graph.json", tmp_path / "plan.json"
    assert cli_main(["trace", factory, "--seq", "16", "--dtype", "fp32", "-o", str(graph)]) == 0
    args = ["plan", "--graph", str(graph), "--cluster", "cpu-local", "--global-batch", "8"]
    args += ["--seq", "16", "--dtype", "fp32", "--optimizer", "sgd", "--no-baselines"]
    args += ["--mesh", "2x1x2", "--tp-layout", "per_node", "-o", str(path)]
    assert cli_main(args) == 0
    plan = Plan.from_json(path.read_text())
    assert plan.request.model.family == "graph" and plan.executable
    assert plan.request.model.config == {"vocab": TINY_DECODER["vocab_size"]}
    with pytest.raises(RuntimeError, match="pass its factory with --model"):
        run_local(plan, steps=1, timeout_s=240)
    ranks = run_local(plan, steps=2, timeout_s=240, model=factory)
    assert {r["mode"] for r in ranks} == {"graph"}
    reference = reference_run(plan, steps=2, model_factory=factory)
    assert distributed_losses(ranks, plan) == pytest.approx(reference["losses"], rel=1e-5)
    params = distributed_params(ranks)
    assert set(reference["params"]) - {"lm_head.weight"} <= set(params)
    for name, values in params.items():
        assert values == pytest.approx(reference["params"][name], abs=1e-5), name
    check_ledger(plan, ranks)


@pytest.mark.distributed
def test_mixtral_expert_parallel_matches_single_process_reference():
    """Expert parallelism for transformers' grouped expert matmuls: each of 2 tp ranks holds
    half of Mixtral's experts and multiplies only their tokens (graph mode)."""
    from planner.cluster.profile import load_cluster
    from planner.evaluate.forced_strategy import strategy_plan
    from planner.models import ModelSpec

    spec = ModelSpec(hf_config=CONFIGS["mixtral"])
    cluster = load_cluster("cpu-local").model_copy(update={"devices_per_node": 2})
    plan = strategy_plan(spec, cluster, "grouped_mm", "experts", tp=2, global_batch=4, seq=16)
    experts = [s for st in plan.stages for s in st.shardings if s.kind == "grouped_mm"]
    assert experts and all(s.strategy == "experts" for s in experts)
    assert all(s.inputs[1][1] == "S(0)" and s.outputs[0][1] == "P" for s in experts)
    assert plan.executable and plan_executor_mode(plan) == "graph"
    ranks = run_local(plan, steps=2, timeout_s=240)
    reference = reference_run(plan, steps=2)
    assert distributed_losses(ranks, plan) == pytest.approx(reference["losses"], rel=1e-5)
    for name, values in distributed_params(ranks).items():
        assert values == pytest.approx(reference["params"][name], abs=1e-5), name
    # gap: the gradients of the replicated tokens entering the sharded experts are partial
    # sums, priced as one all-reduce each where the experts take them
    # (planner.intra_op.sharding_rules); DTensor keeps them partial further back and
    # reduces them there: the first experts' output gradient [128, 256], attention's score
    # gradients [4, 4, 16, 16], the replicated weights' gradients once a step (measured on
    # rank 0, one micro-batch: 2 x 131,072 B, 2 + 2 x 16,384 B and 2 x 256 B more)
    gap = ("where DTensor reduces the experts' partial gradients", frozenset({"tp"}), True)
    check_ledger(plan, ranks, gap)


@pytest.mark.distributed
@pytest.mark.parametrize("etp", ["2", "1"])
def test_a_run_with_experts_split_over_ep_and_tp_resumes_as_it_ran(tmp_path, etp):
    """Saved after 2 steps and resumed to 4, a Mixtral whose experts are split over ep 2
    and their features over tp 2 (expert tp 2), or whole with ep 2 over the tp ranks
    (expert tp 1), ZeRO-3: steps 2 and 3 match the single-process reference. Each rank's
    expert slice is checkpointed under its own name (executor.checkpoint.expert_slices);
    under one name DCP kept one slice and the resumed run trained others' weights."""
    pins = ("--mesh", "1x2x2", "--tp-layout", "megatron", "--sequence-parallel", "on")
    pins += ("--ep", "2", "--etp", etp, "--zero", "3")
    plan, _ = hf_plan(tmp_path, "mixtral", "fp32", "sgd", *pins)
    assert plan.mesh.etp == (1 if etp == "1" else None)
    ckpt = str(tmp_path / "ckpt")
    options = {"checkpoint_dir": ckpt, "checkpoint_every": 2, "momentum": 0.9}
    run_local(plan, steps=2, timeout_s=240, **options)
    resumed = run_local(plan, steps=4, timeout_s=240, resume=True, **options)
    assert [s["step"] for s in resumed[0]["steps"]] == [2, 3]
    reference = reference_run(plan, steps=4, momentum=0.9)
    assert distributed_losses(resumed, plan) == pytest.approx(reference["losses"][2:], rel=1e-5)
