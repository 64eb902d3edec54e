"""A shallow trace expanded to the model's depth equals the full trace, node for node and edge
for edge (names, layers, parameters, FLOPs, bytes, arguments), for every family that is
expanded (planner.graph.expand), and for transformers models whose layers are all alike."""

import dataclasses

import pytest

from planner.graph import tracing
from planner.graph.expand import expand_layers
from planner.models import ModelSpec, hf, resolve, torch_dtype
from tests.hf_configs import MIXTRAL_8X7B, QWEN3_30B_A3B, TINY_DECODER

CASES = [
    ("gpt-350m", {"hidden": 64, "heads": 4, "vocab": 256}, 1),
    ("llama3-8b", {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128, "vocab": 256}, 1),
    ("moe-380m", {"hidden": 64, "heads": 4, "experts": 4, "vocab": 256}, 2),
]
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
HF_CASES = {
    "llama": {**TINY_DECODER, "model_type": "llama"},
    "mixtral": {**MIXTRAL_8X7B, **SMALL, "num_key_value_heads": 2, "vocab_size": 128},
    "qwen3_moe": {
        **QWEN3_30B_A3B,
        **SMALL,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 128,
    },
}


def _full_trace(model, batch: int):
    """Every layer traced (what trace_model does where it cannot expand)."""
    model = model.with_seq(32)
    module = tracing._traced_module(model, torch_dtype("bf16"))
    inputs = model.example_inputs(batch, 32, torch_dtype("bf16"))
    return tracing.trace(module, inputs, name=model.name, seq=32, strip_prefix="model.")


def _same(expanded, full) -> None:
    want, got = full.to_dict(), expanded.to_dict()
    assert [n["name"] for n in got["nodes"]] == [n["name"] for n in want["nodes"]]
    for a, b in zip(got["nodes"], want["nodes"], strict=True):
        assert a == b, a["name"]
    assert got["edges"] == want["edges"]
    assert got == want


# depths whose remainder modulo the period differs (one depth where the period is 1)
DEPTHS = [(name, config, period, layers) for name, config, period in CASES for layers in (5, 8)]
DEPTHS = [d for d in DEPTHS if d[2] > 1 or d[3] == 5]


@pytest.mark.parametrize(("name", "config", "period", "layers"), DEPTHS)
def test_expanded_trace_is_the_full_trace(name, config, period, layers):
    model = resolve(ModelSpec(name=name, config={**config, "layers": layers}))
    for batch in (1, 2):
        _same(tracing.trace_model(model, batch, 32, "bf16"), _full_trace(model, batch))


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_a_transformers_model_with_layers_alike_is_expanded_exactly(case, monkeypatch):
    """Its trace is expanded from two layers (not traced whole) and equals the full trace."""
    model = resolve(ModelSpec(hf_config={**HF_CASES[case], "num_hidden_layers": 5}))
    assert hf.uniform_layers(model.config)
    calls = []

    def spy(graph, layers, period):
        calls.append((len({n.layer for n in graph.nodes if n.layer is not None}), layers))
        return expand_layers(graph, layers, period)

    monkeypatch.setattr(tracing, "expand_layers", spy)
    expanded = tracing.trace_model(model, 1, 32, "bf16")
    assert calls == [(2, 5)]  # two layers traced, five made
    _same(expanded, _full_trace(model, 1))


def test_layers_that_differ_are_traced_whole():
    """A layer picked to differ (mlp_only_layers), a dense prefix (DeepSeek's
    first_k_dense_replace) or alternating attention (Gemma-2's layer_types): not alike."""
    qwen = {**HF_CASES["qwen3_moe"], "num_hidden_layers": 5}
    for config in (
        {**qwen, "mlp_only_layers": [4]},
        {**qwen, "decoder_sparse_step": 2},
        {
            "model_type": "gemma2",
            **SMALL,
            "vocab_size": 128,
            "num_hidden_layers": 5,
            "num_key_value_heads": 2,
            "head_dim": 16,
        },
    ):
        assert not hf.uniform_layers(resolve(ModelSpec(hf_config=config)).config), config


def test_a_per_layer_list_alike_is_cut_with_the_layers():
    """layer_types all alike (30 layers): alike, and built with the list cut to the layers."""
    config = {**HF_CASES["llama"], "num_hidden_layers": 30, "layer_types": ["full_attention"] * 30}
    assert hf.uniform_layers(resolve(ModelSpec(hf_config=config)).config)


def test_the_shallow_config_keeps_per_layer_lists_in_step():
    model = resolve(ModelSpec(hf_config={**HF_CASES["llama"], "num_hidden_layers": 5}))
    cfg = dataclasses.replace(
        model.config, settings={**model.config.settings, "layer_types": ["full_attention"] * 5}
    )
    shallow = hf.with_layers(cfg, 2)
    assert shallow.layers == 2 and shallow.settings["num_hidden_layers"] == 2
    assert shallow.settings["layer_types"] == ["full_attention"] * 2
