"""Map a Hugging Face `config.json` of a Llama-family model onto the zoo's LlamaConfig (no
weights): the planner's path when `transformers` is not installed (planner/models/hf.py builds
transformers' own classes when it is). A config without `architectures` (as
`PretrainedConfig.to_json_file` writes it) is recognised by its `model_type`."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from planner.errors import InputError
from planner.limits import check_config
from planner.models.configs.llama import LlamaConfig

ARCH_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,99}$")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ARCHITECTURE_OF_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

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


def _architectures(data: dict[str, Any], prefix: str) -> list[str]:
    archs = data.get("architectures") or []
    if not archs and isinstance(data.get("model_type"), str):
        archs = [ARCHITECTURE_OF_TYPE.get(data["model_type"], data["model_type"])]
    if not isinstance(archs, list) or not all(
        isinstance(a, str) and ARCH_NAME.match(a) for a in archs
    ):
        raise InputError(
            f"{prefix}.architectures",
            f"{archs!r} is not a list of class names",
            'a list like ["LlamaForCausalLM"]',
        )
    return archs


def _value(data: dict[str, Any], key: str, default: Any, kind: type, prefix: str) -> Any:
    """data[key] (or `default`) as `kind` (int or float, finite), else an InputError."""
    raw = data.get(key, default)
    ok = isinstance(raw, int | float) and not isinstance(raw, bool)
    if ok and kind is int:
        ok = isinstance(raw, int) or (isinstance(raw, float) and raw.is_integer())
    if not ok or not math.isfinite(raw):
        expected = "an integer" if kind is int else "a finite number"
        raise InputError(f"{prefix}.{key}", f"{raw!r} is not {expected}", expected)
    return kind(raw)


def llama_config_from_hf(data: dict[str, Any], prefix: str = "hf_config") -> LlamaConfig:
    archs = _architectures(data, prefix)
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
    if not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0:
        raise InputError(f"{prefix}.num_key_value_heads", f"not a positive integer: {kv!r}")
    tie = data.get("tie_word_embeddings", False)
    bias = data.get("attention_bias", "Qwen2ForCausalLM" in archs)
    for key, flag in (("tie_word_embeddings", tie), ("attention_bias", bias)):
        if not isinstance(flag, bool):
            raise InputError(f"{prefix}.{key}", f"{flag!r} is not a boolean", "true or false")
    cfg = LlamaConfig(
        **values,
        kv_heads=kv,
        seq_len=_value(data, "max_position_embeddings", 2048, int, prefix),
        rope_theta=_value(data, "rope_theta", 10000.0, float, prefix),
        norm_eps=_value(data, "rms_norm_eps", 1e-5, float, prefix),
        tie_embeddings=tie,
        # Qwen2 has biases on q/k/v (its config has no flag for it); Llama/Mistral have none.
        attention_bias=bias,
    )
    check_config(cfg, prefix)
    cfg.validate(prefix)
    return cfg
