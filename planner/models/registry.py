"""The model zoo: families, named configurations, and how to build a training module on meta."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from planner.errors import InputError
from planner.limits import MAX_PARAMS, MODEL_NAME
from planner.models.config import apply_overrides, override_schema
from planner.models.configs import gpt, llama, mlp, moe, wresnet
from planner.models.hf_config import llama_config_from_hf

# What tracing and the executor build with torch (planner.models.modules), imported on first
# use, so that resolving a zoo model and planning from cached traces never imports torch.
_MODULE_NAMES = (
    "DTYPES",
    "TrainingModule",
    "family_loss",
    "lm_inputs",
    "lm_loss",
    "model_output",
    "torch_dtype",
)


def __getattr__(name: str) -> Any:
    if name in _MODULE_NAMES:
        from planner.models import modules

        return getattr(modules, name)
    raise AttributeError(f"module 'planner.models.registry' has no attribute {name!r}")


def _lazy(ref: str) -> Any:
    """`module:attribute`, imported now."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _hf_param_count(cfg: Any) -> int:
    from planner.models import hf

    return hf.param_count(cfg)


@dataclass(frozen=True)
class Family:
    name: str
    model_ref: str  # `module:class` of the nn.Module built from a config (torch)
    zoo: dict[str, Any]
    inputs_ref: str  # `module:function` making a micro-batch's (inputs, labels) on a device
    loss_ref: str  # `module:function` of the training loss
    param_count: Callable[[Any], int]
    tokens_per_sample: bool  # True: throughput in tokens (seq per sample); False: samples
    # Layers repeat with this period (planner.graph.expand traces 2 periods and copies them);
    # None: traced whole (Hugging Face configs may vary per layer, ResNet stages differ).
    layer_period: int | None = None

    @property
    def model_cls(self) -> Callable[[Any], Any]:
        return _lazy(self.model_ref)

    @property
    def make_inputs(self) -> Callable[..., tuple]:
        return _lazy(self.inputs_ref)

    @property
    def loss(self) -> Callable[[Any, Any], Any]:
        return _lazy(self.loss_ref)


_M = "planner.models.modules"
FAMILIES = {
    "gpt": Family(
        "gpt",
        "planner.models.gpt:GPT",
        gpt.ZOO,
        f"{_M}:lm_inputs",
        f"{_M}:lm_loss",
        gpt.param_count,
        True,
        1,
    ),
    "llama": Family(
        "llama",
        "planner.models.llama:Llama",
        llama.ZOO,
        f"{_M}:lm_inputs",
        f"{_M}:lm_loss",
        llama.param_count,
        True,
        1,
    ),
    "moe": Family(
        "moe",
        "planner.models.moe:MoELM",
        moe.ZOO,
        f"{_M}:lm_inputs",
        f"{_M}:lm_loss",
        moe.param_count,
        True,
        2,
    ),
    "wresnet": Family(
        "wresnet",
        "planner.models.wresnet:WResNet",
        wresnet.ZOO,
        f"{_M}:image_inputs",
        f"{_M}:class_loss",
        wresnet.param_count,
        False,
    ),
    "mlp": Family(
        "mlp",
        "planner.models.mlp:MLPModel",
        mlp.ZOO,
        f"{_M}:mlp_inputs",
        f"{_M}:mse_loss",
        mlp.param_count,
        False,
    ),
    # Hugging Face causal LMs built by transformers (planner/models/hf.py); no zoo names.
    "hf": Family(
        "hf",
        "planner.models.hf:build_causal_lm",
        {},
        f"{_M}:lm_inputs",
        f"{_M}:lm_loss",
        _hf_param_count,
        True,
    ),
}

ZOO: dict[str, str] = {name: fam.name for fam in FAMILIES.values() for name in fam.zoo}


def zoo_override_schemas() -> list[tuple[list[str], dict[str, Any]]]:
    """Per family with zoo models: (its names, the JSON schema of its config overrides)."""
    return [
        (sorted(fam.zoo), override_schema(next(iter(fam.zoo.values()))))
        for fam in FAMILIES.values()
        if fam.zoo
    ]


class ModelSpec(BaseModel):
    """What the user asks for: a zoo name with overrides, or a Hugging Face config.json body."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str | None = Field(None, examples=["gpt-1.3b"])
    config: dict[str, Any] = Field(default_factory=dict, examples=[{"layers": 12}])
    hf_config: dict[str, Any] | None = None


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    family: Family
    config: Any

    def with_seq(self, seq: int) -> ResolvedModel:
        """The model as trained at sequence length `seq` (position tables sized to it)."""
        if not hasattr(self.config, "seq_len") or self.family.name == "mlp":
            return self
        if self.family.name == "hf":
            from planner.models import hf

            return dataclasses.replace(self, config=hf.with_seq(self.config, seq))
        if self.family.name == "llama":
            seq = max(seq, self.config.seq_len)
        return dataclasses.replace(self, config=dataclasses.replace(self.config, seq_len=seq))

    def build(self, dtype: Any = None, device: str = "meta") -> Any:
        """The TrainingModule (model + loss) on `device`, in `dtype` (a torch dtype; float32)."""
        from planner.models.modules import build

        return build(self, dtype, device)

    def example_inputs(
        self, batch: int, seq: int, dtype: Any = None, device: str = "meta"
    ) -> tuple:
        import torch

        return self.family.make_inputs(self.config, batch, seq, dtype or torch.float32, device)

    @property
    def param_count(self) -> int:
        return self.family.param_count(self.config)

    @property
    def default_seq(self) -> int:
        if self.family.name == "mlp":
            return self.config.seq_len
        return getattr(self.config, "seq_len", 1)

    def config_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.config)


def resolve(spec: ModelSpec, field: str = "model") -> ResolvedModel:
    if spec.name is not None and not MODEL_NAME.match(spec.name):
        raise InputError(f"{field}.name", f"{spec.name!r} is not a valid name", MODEL_NAME.pattern)
    if spec.hf_config is not None and _transformers_available():
        from planner.models import hf

        cfg = hf.hf_config(spec.hf_config, spec.config, prefix=f"{field}.hf_config")
        name = spec.name or f"hf:{cfg.model_type}"
        return _bounded(ResolvedModel(name, FAMILIES["hf"], cfg), field)
    if spec.hf_config is not None:
        cfg = llama_config_from_hf(spec.hf_config, prefix=f"{field}.hf_config")
        cfg = apply_overrides(cfg, spec.config, prefix=f"{field}.config")
        arch = (spec.hf_config.get("architectures") or ["hf"])[0]
        return _bounded(ResolvedModel(spec.name or f"hf:{arch}", FAMILIES["llama"], cfg), field)
    if not spec.name:
        raise InputError(f"{field}.name", "missing", "a zoo model name or an hf_config")
    if spec.name not in ZOO:
        raise InputError(
            f"{field}.name", f"unknown model {spec.name!r}", "one of " + ", ".join(sorted(ZOO))
        )
    family = FAMILIES[ZOO[spec.name]]
    cfg = apply_overrides(family.zoo[spec.name], spec.config, prefix=f"{field}.config")
    return _bounded(ResolvedModel(spec.name, family, cfg), field)


def _transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _bounded(model: ResolvedModel, field: str) -> ResolvedModel:
    if model.param_count > MAX_PARAMS:
        raise InputError(
            f"{field}.config",
            f"{model.param_count:.3g} parameters is past any real model",
            f"at most {MAX_PARAMS:.0e} parameters",
        )
    return model


def resolve_ref(family: str, name: str, config: dict[str, Any]) -> ResolvedModel:
    """The model a plan's ModelRef names (its family and recorded config), for the executor:
    zoo models by name and config, Hugging Face models by their transformers config."""
    if family == "hf":
        from planner.models import hf

        return ResolvedModel(name, FAMILIES["hf"], hf.HFConfig(**config))
    if family in FAMILIES and name not in ZOO:  # e.g. a Llama config read without transformers
        zoo_config = next(iter(FAMILIES[family].zoo.values()))
        cfg = apply_overrides(zoo_config, config, prefix="model.config")
        return _bounded(ResolvedModel(name, FAMILIES[family], cfg), "model")
    return resolve(ModelSpec(name=name, config=config))


def list_models() -> list[dict[str, Any]]:
    rows = []
    for fam in FAMILIES.values():
        for name, cfg in fam.zoo.items():
            rows.append(
                {
                    "name": name,
                    "family": fam.name,
                    "params": fam.param_count(cfg),
                    "config": dataclasses.asdict(cfg),
                }
            )
    return rows
