"""The model zoo: families, named configurations, and how to build a training module on meta."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

import planner.models.gpt as gpt
import planner.models.hf as hf
import planner.models.llama as llama
import planner.models.mlp as mlp
import planner.models.moe as moe
import planner.models.wresnet as wresnet
from planner.errors import InputError
from planner.limits import MAX_PARAMS, MODEL_NAME
from planner.models.config import apply_overrides, override_schema
from planner.models.hf_config import llama_config_from_hf

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str, field: str = "dtype") -> torch.dtype:
    if name not in DTYPES:
        raise InputError(field, f"unknown dtype {name!r}", "one of " + ", ".join(DTYPES))
    return DTYPES[name]


def lm_inputs(cfg: Any, batch: int, seq: int, dtype: torch.dtype, device: str) -> tuple:
    tokens = torch.zeros(batch, seq, dtype=torch.long, device=device)
    return tokens, torch.zeros(batch, seq, dtype=torch.long, device=device)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _image_inputs(cfg: Any, batch: int, seq: int, dtype: torch.dtype, device: str) -> tuple:
    size = cfg.image_size
    images = torch.zeros(batch, 3, size, size, dtype=dtype, device=device)
    return images, torch.zeros(batch, dtype=torch.long, device=device)


def _class_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def _mlp_inputs(cfg: Any, batch: int, seq: int, dtype: torch.dtype, device: str) -> tuple:
    x = torch.zeros(batch, seq, cfg.hidden, dtype=dtype, device=device)
    return x, torch.zeros_like(x)


def _mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target.float())


@dataclass(frozen=True)
class Family:
    name: str
    model_cls: Callable[[Any], nn.Module]
    zoo: dict[str, Any]
    make_inputs: Callable[..., tuple]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    param_count: Callable[[Any], int]
    tokens_per_sample: bool  # True: throughput in tokens (seq per sample); False: samples
    # Layers repeat with this period (planner.graph.expand traces 2 periods and copies them);
    # None: traced whole (Hugging Face configs may vary per layer, ResNet stages differ).
    layer_period: int | None = None


FAMILIES = {
    "gpt": Family("gpt", gpt.GPT, gpt.ZOO, lm_inputs, lm_loss, gpt.param_count, True, 1),
    "llama": Family(
        "llama", llama.Llama, llama.ZOO, lm_inputs, lm_loss, llama.param_count, True, 1
    ),
    "moe": Family("moe", moe.MoELM, moe.ZOO, lm_inputs, lm_loss, moe.param_count, True, 2),
    "wresnet": Family(
        "wresnet",
        wresnet.WResNet,
        wresnet.ZOO,
        _image_inputs,
        _class_loss,
        wresnet.param_count,
        False,
    ),
    "mlp": Family("mlp", mlp.MLPModel, mlp.ZOO, _mlp_inputs, _mse_loss, mlp.param_count, False),
    # Hugging Face causal LMs built by transformers (planner/models/hf.py); no zoo names.
    "hf": Family("hf", hf.build_causal_lm, {}, lm_inputs, lm_loss, hf.param_count, True),
}

ZOO: dict[str, str] = {name: fam.name for fam in FAMILIES.values() for name in fam.zoo}


def zoo_override_schemas() -> list[tuple[list[str], dict[str, Any]]]:
    """Per family with zoo models: (its names, the JSON schema of its config overrides)."""
    return [
        (sorted(fam.zoo), override_schema(next(iter(fam.zoo.values()))))
        for fam in FAMILIES.values()
        if fam.zoo
    ]


def family_loss(family: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The training loss of a family's models; a traced model ("graph") follows the
    language-model convention `autopar trace` traced it with."""
    return FAMILIES[family].loss if family in FAMILIES else lm_loss


class ModelSpec(BaseModel):
    """What the user asks for: a zoo name with overrides, or a Hugging Face config.json body."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str | None = Field(None, examples=["gpt-1.3b"])
    config: dict[str, Any] = Field(default_factory=dict, examples=[{"layers": 12}])
    hf_config: dict[str, Any] | None = None


class TrainingModule(nn.Module):
    """model + loss, so a trace covers the whole forward of a training step."""

    def __init__(self, model: nn.Module, loss: Callable):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(model_output(self.model(inputs)), labels)


def model_output(out: Any) -> torch.Tensor:
    """The tensor a loss takes from a model's output: Hugging Face models return a
    ModelOutput (take `.logits`) or a tuple (its first element)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"cannot take a tensor from the model's output ({type(out).__name__})")


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
            return dataclasses.replace(self, config=hf.with_seq(self.config, seq))
        if self.family.name == "llama":
            seq = max(seq, self.config.seq_len)
        return dataclasses.replace(self, config=dataclasses.replace(self.config, seq_len=seq))

    def build(self, dtype: torch.dtype = torch.float32, device: str = "meta") -> TrainingModule:
        with torch.device(device):
            model = self.family.model_cls(self.config).to(dtype)
        return TrainingModule(model, self.family.loss)

    def example_inputs(
        self, batch: int, seq: int, dtype: torch.dtype = torch.float32, device: str = "meta"
    ) -> tuple:
        return self.family.make_inputs(self.config, batch, seq, dtype, device)

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
    if spec.hf_config is not None and hf.transformers_available():
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
