"""Planning Hugging Face models: configs as transformers writes them, the architectures it
builds, MoE expert FLOPs, tracing a raw causal LM, and config vs trace plans."""

import json

import pytest

from api.cli import main as cli_main
from planner.errors import InputError
from planner.graph.tracing import trace_model
from planner.models import ModelSpec, resolve
from planner.plan import Plan
from tests.hf_configs import TINY_DECODER

transformers = pytest.importorskip("transformers")

TINY = TINY_DECODER
ARCHITECTURES = {
    "mistral": {},
    "qwen3": {"head_dim": 16},
    "mixtral": {"num_local_experts": 4},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16},  # no SDPA support in transformers: built with eager attention
    "phi3": {"pad_token_id": 0},
    "deepseek_v3": {
        "num_key_value_heads": 4,  # multi-head latent attention: one kv head per head
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
    },
}


def test_a_config_written_by_transformers_is_read_by_its_model_type(tmp_path):
    from planner.models.hf_config import load_hf_config

    path = tmp_path / "config.json"
    transformers.LlamaConfig(**{k: v for k, v in TINY.items()}).to_json_file(path)
    data = load_hf_config(path)
    assert "architectures" not in data or not data["architectures"]
    resolved = resolve(ModelSpec(hf_config=data))
    assert resolved.name == "hf:llama" and resolved.config.layers == 2


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_transformers_architectures_trace_with_their_parameters(model_type):
    body = {"model_type": model_type, **TINY, **ARCHITECTURES[model_type]}
    resolved = resolve(ModelSpec(hf_config=body))
    graph = trace_model(resolved, 2, 16, "bf16")
    built = sum(p.numel() for p in resolved.build().parameters())
    assert graph.param_count == resolved.param_count == built
    assert graph.num_layers == 2
    assert graph.summary()["fwd_flops"] > 0


def test_mixtral_flops_per_token_are_six_times_its_active_parameters():
    """Mixtral-8x7B's shapes (2 of its 32 layers): top-2 of 8 experts; the expert GEMMs
    (grouped mm) count. Training FLOPs per token ~ 6 x active non-embedding parameters
    (Kaplan et al. 2020) plus attention, which is small at seq 1024."""
    cfg = {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
    }
    resolved = resolve(ModelSpec(hf_config=cfg))
    seq = 1024
    graph = trace_model(resolved, 1, seq, "bf16")
    s = graph.summary()
    per_token = (s["fwd_flops"] + s["bwd_flops"]) / seq
    h, f, layers = 4096, 14336, 2
    attention = h * h * 2 + h * 1024 * 2  # q, o; k, v at 8 kv heads of 128
    active = layers * (attention + 2 * 3 * h * f + 8 * h) + 32000 * h  # + router, + head
    assert per_token == pytest.approx(6 * active, rel=0.10)
    assert s["kinds"]["grouped_mm"] == 2 * layers
    assert s["params"] == resolved.param_count


def _plan(args: list[str], path) -> Plan:
    common = ["--cluster", "dgx-a100-80g", "--global-batch", "16", "--seq", "256"]
    common += ["--no-baselines", "-o", str(path)]
    assert cli_main([*args, *common]) == 0
    return Plan.from_json(path.read_text())


def test_plans_from_config_and_from_trace_agree(tmp_path, monkeypatch):
    """The same HF model planned from its config and from `autopar trace` of the raw
    transformers model (a user factory returning LlamaForCausalLM, whose output is a
    ModelOutput): step time and memory within 5%."""
    body = {**TINY, "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4}
    (tmp_path / "config.json").write_text(json.dumps(body))
    (tmp_path / "my_models.py").write_text(
        "import json, transformers\n"
        "def llama():\n"
        f"    body = json.loads({json.dumps(json.dumps(body))})\n"
        "    body.pop('model_type')\n"
        "    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**body))\n"
    )
    monkeypatch.chdir(tmp_path)
    graph = tmp_path / "graph.json"
    code = cli_main(["trace", "my_models:llama", "--seq", "256", "-o", str(graph)])  # batch 2
    assert code == 0
    pins = ["--mesh", "2x2x2", "--schedule", "1f1b"]  # both searched on the same mesh
    from_config = _plan(
        ["plan", "--hf-config", str(tmp_path / "config.json"), *pins], tmp_path / "a"
    )
    from_trace = _plan(["plan", "--graph", str(graph), *pins], tmp_path / "b")
    a, b = from_config.predicted, from_trace.predicted
    assert b.step_time_s == pytest.approx(a.step_time_s, rel=0.05)
    assert b.peak_memory_bytes == pytest.approx(a.peak_memory_bytes, rel=0.05)


def test_gpt2_tensor_parallel_plan_runs_in_graph_mode(tmp_path):
    """GPT-2's fused Conv1D q/k/v has no module-level parallel style, so a tp plan of it runs
    in graph mode (tests/executor: HF models there match their reference)."""
    from planner.executable import plan_executor_mode

    body = {"model_type": "gpt2", "vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4}
    (tmp_path / "gpt2.json").write_text(json.dumps(body))
    args = ["plan", "--hf-config", str(tmp_path / "gpt2.json"), "--cluster", "cpu-local"]
    args += ["--global-batch", "8", "--seq", "16", "--dtype", "fp32", "--no-baselines"]
    assert cli_main([*args, "--mesh", "1x1x4", "--zero", "0", "-o", str(tmp_path / "p")]) == 0
    plan = Plan.from_json((tmp_path / "p").read_text())
    assert plan.executable and plan.not_executable_reason is None
    assert plan_executor_mode(plan) == "graph"
    # graph mode checkpoints and reduces gradients by the layer blocks the stage lists
    blocks = [m for m in plan.stages[0].modules if m.rsplit(".", 1)[-1].isdigit()]
    assert blocks == ["transformer.h.0", "transformer.h.1"]


def test_tp_must_divide_heads_and_kv_heads():
    from planner.cluster.profile import load_cluster
    from planner.evaluate.config import ParallelConfig
    from planner.request import resolve_request

    request = resolve_request(
        {"hf_config": {"model_type": "llama", **TINY}},
        load_cluster("cpu-local"),
        {"global_batch_size": 8, "seq_len": 16},
    )
    config = ParallelConfig(dp=1, tp=4, pp=1, microbatches=1)
    with pytest.raises(InputError, match=r"mesh\.tp: tp = 4 does not divide .*kv_heads = 2"):
        config.validate(request.cluster, 8, request.layers, request.model.config)


@pytest.mark.parametrize("layers", [7, 23, 26])
def test_deep_models_count_parameters_without_building_every_layer(layers):
    """Past 20 layers the count is extrapolated by periods of 4 layers; it equals a full
    build for a model whose layers alternate (DeepSeek-V3: 1 dense layer, then MoE)."""
    body = {"model_type": "deepseek_v3", **TINY, **ARCHITECTURES["deepseek_v3"]}
    body["num_hidden_layers"] = layers
    resolved = resolve(ModelSpec(hf_config=body))
    built = sum(p.numel() for p in resolved.build().parameters())
    assert resolved.param_count == built


def test_planning_a_transformers_model_prints_no_stray_log_lines(tmp_path):
    """transformers imports torchao, which warns about kernels built for another Python and
    about torch's pytree registration: lines a user cannot act on (api/quiet.py)."""
    import subprocess
    import sys

    config = tmp_path / "llama.json"
    config.write_text(json.dumps({"model_type": "llama", **TINY_DECODER}))
    args = ["plan", "--hf-config", str(config), "--cluster", "cpu-local", "--global-batch", "8"]
    args += ["--seq", "16", "--no-baselines"]
    run = subprocess.run(
        [sys.executable, "-m", "api.cli", *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert "Failed to load" not in run.stderr and "register_constant" not in run.stderr
    assert "step time" in run.stdout


def test_sizes_left_to_transformers_defaults_are_named(caplog):
    from planner.models.hf import hf_config

    missing = {k: v for k, v in TINY_DECODER.items() if k != "num_attention_heads"}
    with caplog.at_level("WARNING", logger="autopar.models"):
        cfg = hf_config({"model_type": "llama", **missing})
    assert cfg.heads == 32  # LlamaConfig's default
    ours = [r.getMessage() for r in caplog.records if r.name == "autopar.models"]
    assert ours == [
        "hf_config.num_attention_heads: not in the config; transformers' LlamaConfig default "
        "32 is used"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="autopar.models"):
        hf_config({"model_type": "llama", **TINY_DECODER})
        # GPT-2 names its sizes its own way (n_head is num_attention_heads)
        hf_config(
            {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128}
        )
    assert [r for r in caplog.records if r.name == "autopar.models"] == []


DEEPSEEK_V2 = {  # DeepSeek-V2-Lite's structure at toy sizes: MLA, complex rotary, MoE
    "model_type": "deepseek_v2",
    **{"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128},
    **{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4},
    **{"moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1},
    **{"num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1},
    **{"kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 16},
    **{"qk_rope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 128},
    **{"topk_method": "greedy", "n_group": 1, "topk_group": 1},
}


def test_deepseek_v2s_complex_rotary_embedding_traces_and_plans(tmp_path):
    # its rotary embedding multiplies complex64 tensors (torch.polar); ones_like makes a
    # constant in the shape of a tensor: both were refused before (dtype, ILP strategies)
    config = tmp_path / "deepseek_v2.json"
    config.write_text(json.dumps(DEEPSEEK_V2))
    out = tmp_path / "plan.json"
    args = ["plan", "--hf-config", str(config), "--cluster", "cpu-local", "--global-batch", "8"]
    args += ["--seq", "16", "--no-baselines", "--workers", "1", "-o", str(out)]
    assert cli_main(args) == 0
    plan = Plan.from_json(out.read_text())
    assert plan.request.model.config["model_type"] == "deepseek_v2"
    dtypes = {
        t.dtype for n in trace_model(_resolved(DEEPSEEK_V2), 1, 16, "fp32").nodes for t in n.outputs
    }
    assert "complex64" in dtypes


def _resolved(config: dict):
    return resolve(ModelSpec(hf_config=config))


def test_gemma2_is_traced_with_a_fused_attention_kernel():
    """transformers builds Gemma-2 with eager attention only (its logit softcapping); the
    trace prices what users train it with, FlashAttention-2 with the softcap in its kernel:
    one fused attention op per layer and no softmax over a seq x seq score matrix, whose
    saved scores would grow with the square of the sequence."""
    config = {**TINY, "model_type": "gemma2", "head_dim": 16, "sliding_window": 8}
    graph = trace_model(resolve(ModelSpec(hf_config=config)), 1, 48, "fp32")
    attention = [n for n in graph.nodes if n.kind == "attention"]
    assert len(attention) == TINY["num_hidden_layers"]
    assert not [n for n in graph.nodes if "softmax" in n.op]
    scores = [
        n.name
        for n in graph.nodes
        for t in n.outputs
        if t.shape[-2:] == [48, 48] and t.dtype.startswith("float")
    ]
    assert not scores


def test_a_config_whose_own_forward_fails_names_the_config():
    """Helium's head_dim defaults to 128, whatever hidden_size / heads is: at hidden 64 the
    model's own attention cannot run. The user hears which field, not an internal error."""
    config = {"model_type": "helium", **TINY_DECODER}
    with pytest.raises(InputError) as err:
        trace_model(resolve(ModelSpec(hf_config=config)), 2, 16, "fp32")
    assert err.value.field == "model.hf_config"
    assert "helium model fails its own forward" in str(err.value)
