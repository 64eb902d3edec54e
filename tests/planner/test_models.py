import json

import pytest
import torch

from planner.errors import InputError
from planner.graph.tracing import trace_model
from planner.models import FAMILIES, ZOO, ModelSpec, list_models, resolve
from planner.models.config import parse_key_values
from planner.models.gpt import SelfAttention
from planner.models.hf_config import llama_config_from_hf

GPT_AND_LLAMA = sorted(n for n, fam in ZOO.items() if fam in ("gpt", "llama"))


@pytest.mark.parametrize("name", GPT_AND_LLAMA)
def test_traced_param_count_equals_analytic(name):
    """At the zoo model's full width, traced and analytic counts agree at 2 and 3 layers, and
    the analytic count of the full depth is the one its per-layer step extrapolates to (the
    blocks are identical, so tracing all of them would only repeat the check)."""
    counts = {}
    for layers in (2, 3):
        resolved = resolve(ModelSpec(name=name, config={"layers": layers}))
        seq = resolved.default_seq if "gpt" in name else 16
        graph = trace_model(resolved, batch=1, seq=seq)
        assert graph.param_count == resolved.param_count, layers
        counts[layers] = resolved.param_count
    full = resolve(ModelSpec(name=name))
    per_layer = counts[3] - counts[2]
    assert full.param_count == counts[2] + (full.config.layers - 2) * per_layer


@pytest.mark.parametrize("name", sorted(n for n, fam in ZOO.items() if fam in ("moe", "wresnet")))
def test_built_param_count_equals_analytic(name):
    resolved = resolve(ModelSpec(name=name))
    built = sum(p.numel() for p in resolved.build().parameters())
    assert built == resolved.param_count


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("gpt-1.3b", 1.3),
        ("gpt-39b", 39.1),
        ("llama-7b", 6.74),
        ("llama3-70b", 70.6),
        ("moe-380m", 0.38),
        ("moe-70b", 70.4),
        ("wresnet-250m", 0.25),
        ("wresnet-13b", 12.6),
    ],
)
def test_zoo_sizes_match_their_names(name, billions):
    assert resolve(ModelSpec(name=name)).param_count / 1e9 == pytest.approx(billions, rel=0.02)


@pytest.mark.parametrize(("name", "batch", "seq"), [("gpt-350m", 2, 1024), ("gpt-1.3b", 1, 512)])
def test_gpt_training_flops_match_megatron_formula(name, batch, seq):
    resolved = resolve(ModelSpec(name=name))
    cfg = resolved.config
    graph = trace_model(resolved, batch=batch, seq=seq)
    h, layers, vocab = cfg.hidden, cfg.layers, cfg.vocab
    expected = 72 * batch * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (12 * layers * h))
    assert graph.train_flops == pytest.approx(expected, rel=0.02)


def test_overrides_apply_and_validate():
    r = resolve(ModelSpec(name="gpt-1.3b", config={"layers": "2", "hidden": 256, "heads": 4}))
    assert (r.config.layers, r.config.hidden) == (2, 256)
    with pytest.raises(InputError, match=r"model\.config\.layerz: unknown model parameter"):
        resolve(ModelSpec(name="gpt-1.3b", config={"layerz": 2}))
    with pytest.raises(InputError, match=r"model\.config\.layers: 'x' is not an integer"):
        resolve(ModelSpec(name="gpt-1.3b", config={"layers": "x"}))
    with pytest.raises(InputError, match=r"model\.config\.hidden: 100 is not divisible by heads"):
        resolve(ModelSpec(name="gpt-1.3b", config={"hidden": 100}))
    with pytest.raises(InputError, match=r"model\.config\.layers: must be positive"):
        resolve(ModelSpec(name="llama-7b", config={"layers": 0}))
    with pytest.raises(InputError, match=r"model\.name: unknown model 'gpt-9000'"):
        resolve(ModelSpec(name="gpt-9000"))
    with pytest.raises(InputError, match=r"--config: 'layers' is not key=value"):
        parse_key_values(["layers"])


def test_list_models_covers_every_family():
    families = {row["family"] for row in list_models()}
    assert families == set(FAMILIES) - {"hf"}  # transformers' models have no zoo names


# Published parameter counts of public checkpoints, from their config.json shapes.
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
}
QWEN2_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize(("hf", "params"), [(MISTRAL_7B, 7_241_732_096), (QWEN2_05B, 494_032_768)])
def test_hf_config_builds_the_published_model(hf, params):
    resolved = resolve(ModelSpec(hf_config=hf))
    assert resolved.family.name == "hf"  # transformers' own class, not a re-derivation
    built = sum(p.numel() for p in resolved.build().parameters())
    assert built == resolved.param_count == params


@pytest.mark.parametrize(("hf", "params"), [(MISTRAL_7B, 7_241_732_096), (QWEN2_05B, 494_032_768)])
def test_hf_config_maps_onto_the_zoo_llama_without_transformers(hf, params):
    from planner.models.llama import param_count

    assert param_count(llama_config_from_hf(hf)) == params
    by_type = {k: v for k, v in hf.items() if k != "architectures"}
    by_type["model_type"] = "mistral" if hf is MISTRAL_7B else "qwen2"
    assert param_count(llama_config_from_hf(by_type)) == params


def test_hf_config_errors_name_the_field(tmp_path):
    bad = dict(MISTRAL_7B, architectures=["FooForCausalLM"])
    with pytest.raises(InputError, match=r"hf_config\.model_type: missing, and architectures"):
        resolve(ModelSpec(hf_config=bad))
    wrong = dict(MISTRAL_7B, hidden_size="wide")
    with pytest.raises(InputError, match=r"hf_config: transformers refused .*'hidden_size'"):
        resolve(ModelSpec(hf_config=wrong))
    with pytest.raises(InputError, match=r"model\.hf_config\.num_key_value_heads: 3 does not"):
        resolve(ModelSpec(hf_config=dict(MISTRAL_7B, num_key_value_heads=3)))
    with pytest.raises(InputError, match=r"model\.hf_config\.rope_theta: .* not a finite"):
        resolve(ModelSpec(hf_config=dict(MISTRAL_7B, rope_theta=float("inf"))))
    with pytest.raises(InputError, match=r"model\.hf_config\.model_type: 'vit'"):
        resolve(ModelSpec(hf_config=dict(MISTRAL_7B, model_type="vit")))
    from planner.models.hf_config import load_hf_config

    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(InputError, match="--hf-config"):
        load_hf_config(path)
    path.write_text(json.dumps(QWEN2_05B))
    assert load_hf_config(path)["hidden_size"] == 896


def test_attention_infers_local_heads_from_shapes():
    """Column-sharding q/k/v by whole heads (as tensor parallelism does) still runs."""
    torch.manual_seed(0)
    full = SelfAttention(hidden=64, heads=4)
    x = torch.randn(2, 5, 64)
    shard = SelfAttention(hidden=64, heads=4)
    for name in ("q_proj", "k_proj", "v_proj"):
        src, dst = getattr(full, name), getattr(shard, name)
        dst.weight = torch.nn.Parameter(src.weight[:32].clone())  # first two of four heads
        dst.bias = torch.nn.Parameter(src.bias[:32].clone())
    shard.out_proj.weight = torch.nn.Parameter(full.out_proj.weight[:, :32].clone())
    out = shard(x)
    assert out.shape == (2, 5, 64)


def test_the_zoo_catalog_is_the_zoos():
    """`autopar models` reads planner/models/zoo_catalog.json (no torch import); it must say
    what the families say (regenerate: python -m planner.models.zoo_catalog)."""
    from planner.models.zoo_catalog import catalog

    assert catalog() == json.loads(json.dumps(list_models()))


def test_autopar_models_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys; from api.cli import main; main(['models']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
