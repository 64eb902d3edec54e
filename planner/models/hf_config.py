"""Map a Hugging Face `config.json` of a Llama-family model onto LlamaConfig (no weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.errors import InputError
from planner.models.llama import LlamaConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

_REQUIRED = {
    "hidden_size": "hidden",
    "num_hidden_layers": "layers",
    "num_attention_heads": "heads",
    "intermediate_size": "ffn_hidden",
    "vocab_size": "vocab",
}


def load_hf_config(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise InputError("--hf-config", f"cannot read {path}: {err.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError("--hf-config", f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise InputError("--hf-config", "top level is not a JSON object")
    return data


def llama_config_from_hf(data: dict[str, Any], prefix: str = "hf_config") -> LlamaConfig:
    archs = data.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise InputError(
            f"{prefix}.architectures",
            f"{archs!r} is not a supported architecture",
            "one of " + ", ".join(SUPPORTED_ARCHITECTURES),
        )
    values: dict[str, Any] = {}
    for key, ours in _REQUIRED.items():
        raw = data.get(key)
        if not isinstance(raw, int) or isinstance(raw, bool) or raw <= 0:
            raise InputError(f"{prefix}.{key}", f"missing or not a positive integer: {raw!r}")
        values[ours] = raw
    kv = data.get("num_key_value_heads", values["heads"])
    if not isinstance(kv, int) or kv <= 0:
        raise InputError(f"{prefix}.num_key_value_heads", f"not a positive integer: {kv!r}")
    seq = data.get("max_position_embeddings", 2048)
    cfg = LlamaConfig(
        **values,
        kv_heads=kv,
        seq_len=int(seq),
        rope_theta=float(data.get("rope_theta", 10000.0)),
        norm_eps=float(data.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(data.get("tie_word_embeddings", False)),
        # Qwen2 has biases on q/k/v (its config has no flag for it); Llama/Mistral have none.
        attention_bias=bool(data.get("attention_bias", "Qwen2ForCausalLM" in archs)),
    )
    cfg.validate(prefix)
    return cfg
