"""Hugging Face causal LMs, built by `transformers` itself from a config (no weights, no hub).

Any decoder that `AutoModelForCausalLM` builds (Llama, Mistral, Qwen2/3, Mixtral and other
MoE, GPT-2, Gemma, Phi-3, DeepSeek-V3 ...) is planned from the model transformers builds on
the meta device, so the plan names the model's own modules ("model.layers.3.self_attn.q_proj")
and the executor and `autopar.parallelize` apply it to the same classes. Nothing in a config
is executed or imported: only transformers' built-in classes, chosen by `model_type`, are
built (no `auto_map`, no remote code, no quantization).

Without transformers installed, Llama-family configs still plan through the zoo's own Llama
(planner/models/hf_config.py); the zoo stays the dependency-free default.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from planner.errors import InputError
from planner.limits import (
    MAX_CONFIG_FLOAT,
    MAX_CONFIG_INT,
    MAX_EXPERTS,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_SEQ,
    MAX_VOCAB,
    MAX_WIDTH,
)

LOG = logging.getLogger("autopar.models")

# What a config.json says about how it was made or is to be loaded, not the architecture;
# and what would make transformers do more than build a built-in class.
DROPPED_KEYS = frozenset(
    {
        "architectures",
        "auto_map",
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "quantization_config",
        "use_cache",
        "attn_implementation",
        "_attn_implementation",
        "experts_implementation",
        "trust_remote_code",
        "base_model_tp_plan",
        "base_model_pp_plan",
    }
)
# The zoo's override names -> transformers' (the config classes map them to their own, e.g.
# GPT-2's n_layer, through `attribute_map`).
OVERRIDE_KEYS = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab": "vocab_size",
    "ffn_hidden": "intermediate_size",
    "seq_len": "max_position_embeddings",
}
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
MAX_CONFIG_KEYS = 500
MAX_STRING = 200


@dataclass(frozen=True)
class HFConfig:
    """A transformers config, by its model type and fields, with the sizes the planner and
    the limits read (taken from transformers' config object, not re-derived)."""

    model_type: str
    settings: dict[str, Any]
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    experts: int = 0
    # the sliding window some layer attends within, in tokens (0: every layer sees the
    # whole causal prefix); the attention of context parallelism has none
    attention_window: int = 0
    # the cap transformers soft-caps attention scores to (Gemma 2's attn_logit_softcapping;
    # 0: none)
    attention_softcap: float = 0.0

    @property
    def key(self) -> str:
        return json.dumps([self.model_type, self.settings, self.seq_len], sort_keys=True)


def causal_lm_types() -> dict[str, str]:
    """model_type -> class name of every causal LM transformers builds."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _model_type(data: dict[str, Any], prefix: str) -> str:
    types = causal_lm_types()
    model_type = data.get("model_type")
    if model_type is None:
        by_class = {cls: t for t, cls in types.items()}
        archs = data.get("architectures") or []
        if not isinstance(archs, list):
            raise InputError(
                f"{prefix}.architectures", f"{archs!r} is not a list", 'e.g. ["LlamaForCausalLM"]'
            )
        found = [by_class[a] for a in archs if isinstance(a, str) and a in by_class]
        if not found:
            raise InputError(
                f"{prefix}.model_type",
                f"missing, and architectures {archs!r} names no causal LM transformers builds",
                'a model_type such as "llama", "mixtral", "gpt2", or architectures like '
                '["LlamaForCausalLM"]',
            )
        return found[0]
    if not isinstance(model_type, str) or model_type not in types:
        raise InputError(
            f"{prefix}.model_type",
            f"{model_type!r} is not a causal LM that transformers builds",
            f"one of {len(types)} types, e.g. llama, mistral, qwen2, qwen3, mixtral, gpt2, gemma2",
        )
    return model_type


def _check_values(value: Any, field: str, budget: list[int], depth: int = 0) -> None:
    """Every number finite and bounded, strings short, nesting shallow, keys few."""
    budget[0] -= 1
    if budget[0] < 0:
        raise InputError(field, "too many entries", f"at most {MAX_CONFIG_KEYS} keys and items")
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        if abs(value) > MAX_CONFIG_INT:
            raise InputError(field, f"{value} is past any model", f"|value| <= {MAX_CONFIG_INT}")
    elif isinstance(value, float):
        if not math.isfinite(value) or abs(value) > MAX_CONFIG_FLOAT:
            raise InputError(field, f"{value!r} is not a finite number in range", "finite")
    elif isinstance(value, str):
        if len(value) > MAX_STRING:
            raise InputError(field, "string too long", f"at most {MAX_STRING} characters")
    elif isinstance(value, dict | list):
        if depth >= 3:
            raise InputError(field, "nested too deeply", "at most 3 levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            _check_values(v, f"{field}.{k}", budget, depth + 1)
    else:
        raise InputError(field, f"{type(value).__name__} is not a JSON value", "JSON")


def _transformers_config(model_type: str, settings: dict[str, Any], prefix: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type, **settings)
    except Exception as err:  # transformers' own validation: report it, naming the field
        raise InputError(prefix, f"transformers refused this {model_type} config: {err}") from None


def _size(cfg: Any, attr: str, field: str, high: int, default: int | None = None) -> int:
    value = getattr(cfg, attr, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= high:
        raise InputError(field, f"{value!r} is not an integer in [1, {high}]", f"1..{high}")
    return value


# The sizes a plan is made of: a config.json without one gets transformers' class default,
# which is rarely the model meant (LlamaConfig's num_attention_heads is 32)
SIZE_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


def _warn_defaulted(cfg: Any, settings: dict[str, Any], prefix: str) -> None:
    """Warn, naming each, about the sizes the config leaves to transformers' defaults (a
    model type's own names count: GPT-2's n_head is its num_attention_heads)."""
    aliases = getattr(cfg, "attribute_map", {}) or {}
    for attr in SIZE_KEYS:
        given = attr in settings or aliases.get(attr) in settings
        if not given and getattr(cfg, attr, None) is not None:
            LOG.warning(
                "%s.%s: not in the config; transformers' %s default %s is used",
                prefix,
                attr,
                type(cfg).__name__,
                getattr(cfg, attr),
            )


def hf_config(
    data: dict[str, Any], overrides: dict[str, Any] | None = None, prefix: str = "hf_config"
) -> HFConfig:
    """Check a config.json body (and `--config` overrides, in the zoo's names or
    transformers') and read the sizes from transformers' own config class."""
    _check_values(data, prefix, [MAX_CONFIG_KEYS])
    model_type = _model_type(data, prefix)
    settings = {k: v for k, v in data.items() if k not in DROPPED_KEYS and k != "model_type"}
    for key, raw in (overrides or {}).items():
        target = OVERRIDE_KEYS.get(key, key)
        field = f"{prefix.rsplit('.', 1)[0]}.config.{key}"
        try:
            value = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError:
            value = raw
        except RecursionError:
            raise InputError(field, "nested too deeply", "a value or a shallow JSON list") from None
        _check_values(value, field, [MAX_CONFIG_KEYS])
        settings[target] = value
    cfg = _transformers_config(model_type, settings, prefix)
    _warn_defaulted(cfg, settings, prefix)

    def size(attr: str, high: int, default: int | None = None) -> int:
        return _size(cfg, attr, f"{prefix}.{attr}", high, default)

    heads = size("num_attention_heads", MAX_HEADS)
    experts = next((size(k, MAX_EXPERTS) for k in EXPERT_KEYS if getattr(cfg, k, None)), 0)
    out = HFConfig(
        model_type=model_type,
        settings=settings,
        layers=size("num_hidden_layers", MAX_LAYERS),
        hidden=size("hidden_size", MAX_WIDTH),
        heads=heads,
        kv_heads=size("num_key_value_heads", heads, heads),
        vocab=size("vocab_size", MAX_VOCAB),
        seq_len=size("max_position_embeddings", MAX_SEQ, 2048),
        experts=experts,
        attention_window=_attention_window(cfg),
        attention_softcap=_attention_softcap(cfg),
    )
    if out.heads % out.kv_heads:
        raise InputError(
            f"{prefix}.num_key_value_heads",
            f"{out.kv_heads} does not divide num_attention_heads = {out.heads}",
            "a divisor of num_attention_heads",
        )
    return out


def _attention_window(cfg) -> int:
    """The sliding window of a transformers config's windowed layers: those `layer_types`
    names "sliding_attention" (Gemma 2/3, Qwen 2/3 with use_sliding_window), or every layer
    where a config without layer types sets `sliding_window` (Mistral's and Mixtral's
    rule); 0 where no layer has one."""
    window = getattr(cfg, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return 0
    kinds = getattr(cfg, "layer_types", None)
    if kinds is not None:
        return window if "sliding_attention" in kinds else 0
    return window


def _attention_softcap(cfg) -> float:
    cap = getattr(cfg, "attn_logit_softcapping", None)
    number = isinstance(cap, (int, float)) and not isinstance(cap, bool)
    return float(cap) if number and cap > 0 else 0.0


def with_seq(cfg: HFConfig, seq: int) -> HFConfig:
    return dataclasses.replace(cfg, seq_len=max(seq, cfg.seq_len))


def build_causal_lm(cfg: HFConfig) -> nn.Module:
    """transformers' model class for `cfg` (on the current default device), set up for
    training: no KV cache, SDPA attention (flash-style kernels on GPUs)."""
    from transformers import AutoModelForCausalLM

    config = _transformers_config(cfg.model_type, dict(cfg.settings), "hf_config")
    positions = getattr(config, "max_position_embeddings", None)
    if positions and cfg.seq_len > positions:
        config.max_position_embeddings = cfg.seq_len  # learned positions (GPT-2) sized to seq
    config.use_cache = False
    try:
        try:
            return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        except (ValueError, ImportError):  # a model without SDPA support (Gemma-2): eager
            config = _transformers_config(cfg.model_type, dict(cfg.settings), "hf_config")
            config.use_cache = False
            if getattr(config, "max_position_embeddings", None) and positions:
                config.max_position_embeddings = max(positions, cfg.seq_len)
            return AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    except Exception as err:  # a value transformers accepted but cannot build with
        raise InputError(
            "model.hf_config",
            f"transformers could not build this {cfg.model_type} model: "
            f"{type(err).__name__}: {err}",
        ) from None


FLASH_COST = "autopar_flash_cost"


def price_as_flash(model: nn.Module) -> None:
    """Where transformers builds a model with eager attention only (Gemma-2: no SDPA path,
    for its attention-logit softcapping), trace it through SDPA's fused kernel instead: the
    s x s scores the eager path materialises and saves are not what users train it with.
    FlashAttention-2 applies the softcap inside its kernel (flash_attn's `softcap`, since
    2.6.0; transformers' flash_attention_2 passes it), at a fused kernel's cost. Only the
    trace changes: the executor runs transformers' eager attention, softcap and all."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "eager":
        return
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def flash_cost(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("softcap", None)  # applied in FlashAttention-2's kernel: no pass of its own
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(FLASH_COST, flash_cost)
    for sub in model.modules():
        sub_config = getattr(sub, "config", None)
        if getattr(sub_config, "_attn_implementation", None) == "eager":
            sub_config._attn_implementation = FLASH_COST


# Past this many layers the count is extrapolated from a few builds (a request may name up to
# MAX_LAYERS; building 10,000 layers, even on meta, would be unbounded work per request).
BUILT_LAYERS = 16
LAYER_PERIOD = 4  # layer patterns repeat with period 1, 2 or 4 (Llama 4: MoE every 2nd layer)


@lru_cache(maxsize=64)
def _built_count(key: str) -> int:
    model_type, settings, seq_len = json.loads(key)
    cfg = HFConfig(model_type, settings, 1, 1, 1, 1, 1, seq_len)
    with torch.device("meta"):
        model = build_causal_lm(cfg)
    return sum(p.numel() for p in model.parameters())


def param_count(cfg: HFConfig) -> int:
    """Parameters of the model transformers builds (tied weights once), counted on meta.
    Deeper than BUILT_LAYERS + LAYER_PERIOD: counted at a few depths and extended by whole
    periods of layers, exact when layers past the first few repeat with a period dividing
    LAYER_PERIOD (every architecture transformers ships: DeepSeek-V3's dense layers come
    first, Llama 4 alternates dense and MoE)."""
    if cfg.layers <= BUILT_LAYERS + LAYER_PERIOD:
        return _built_count(cfg.key)

    def at(layers: int) -> int:
        return _built_count(with_layers(cfg, layers).key)

    periods, rest = divmod(cfg.layers - BUILT_LAYERS, LAYER_PERIOD)
    base = at(BUILT_LAYERS + rest)
    per_period = at(BUILT_LAYERS + LAYER_PERIOD) - at(BUILT_LAYERS)
    return base + periods * per_period


def with_layers(cfg: HFConfig, layers: int) -> HFConfig:
    """`cfg` with `layers` decoder layers (per-layer lists, such as layer_types, cut to
    them)."""
    old = cfg.settings.get("num_hidden_layers", cfg.layers)
    settings = {
        k: v[:layers] if isinstance(v, list) and len(v) == old else v
        for k, v in cfg.settings.items()
    }
    settings["num_hidden_layers"] = layers
    return dataclasses.replace(cfg, layers=layers, settings=settings)


def _layer_signature(layer: nn.Module) -> tuple:
    """What makes one decoder layer compute what another does: its modules' classes, their
    parameters' and buffers' shapes, and their per-layer settings (sliding windows, attention
    types, ...) but the layer's own index."""
    parts = []
    for name, module in layer.named_modules():
        tensors = [(n, tuple(t.shape), str(t.dtype)) for n, t in module.named_parameters("", False)]
        tensors += [(n, tuple(t.shape)) for n, t in module.named_buffers("", False)]
        scalars = sorted(
            (k, v)
            for k, v in vars(module).items()
            if k != "layer_idx" and isinstance(v, int | float | str | bool | type(None))
        )
        parts.append((name, type(module).__name__, tuple(tensors), tuple(scalars)))
    return tuple(parts)


@lru_cache(maxsize=64)
def _uniform(key: str, layers: int) -> bool:
    model_type, settings, seq_len = json.loads(key)
    for name, value in settings.items():  # per-layer settings past the layers built below
        if "layer" not in name or not isinstance(value, list) or not value:
            continue
        if len(value) == layers and len(set(map(str, value))) > 1:  # layer_types, ...
            return False
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return False  # indices of layers (mlp_only_layers, ...)
    built = min(layers, BUILT_LAYERS + LAYER_PERIOD)
    cfg = HFConfig(
        model_type, {**settings, "num_hidden_layers": layers}, layers, 1, 1, 1, 1, seq_len
    )
    with torch.device("meta"):
        model = build_causal_lm(with_layers(cfg, built))
    blocks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == built]
    if len(blocks) != 1:
        return False
    first = _layer_signature(blocks[0][0])
    return all(_layer_signature(layer) == first for layer in blocks[0][1:])


def uniform_layers(cfg: HFConfig) -> bool:
    """Whether every decoder layer of `cfg` is the same computation (then a trace of two
    layers stands for all of them: planner.graph.expand, period 1): the per-layer settings
    agree, and so do the first BUILT_LAYERS + LAYER_PERIOD layers transformers builds (past
    them layers repeat with a period dividing LAYER_PERIOD: param_count's premise)."""
    return _uniform(cfg.key, cfg.layers)
