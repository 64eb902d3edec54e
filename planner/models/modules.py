"""What tracing and the executor build with torch from a resolved model (planner.models.
registry): the training module (model + loss), each family's example inputs and loss, and the
training dtypes. The registry names these by import path, so that resolving and planning a
zoo model from cached traces imports no torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import InputError
from planner.models import registry

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


def image_inputs(cfg: Any, batch: int, seq: int, dtype: torch.dtype, device: str) -> tuple:
    size = cfg.image_size
    images = torch.zeros(batch, 3, size, size, dtype=dtype, device=device)
    return images, torch.zeros(batch, dtype=torch.long, device=device)


def class_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def mlp_inputs(cfg: Any, batch: int, seq: int, dtype: torch.dtype, device: str) -> tuple:
    x = torch.zeros(batch, seq, cfg.hidden, dtype=dtype, device=device)
    return x, torch.zeros_like(x)


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target.float())


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


def family_loss(family: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The training loss of a family's models; a traced model ("graph") follows the
    language-model convention `autopar trace` traced it with."""
    return registry.FAMILIES[family].loss if family in registry.FAMILIES else lm_loss


def build(model: Any, dtype: torch.dtype | None, device: str) -> TrainingModule:
    """`model` (a registry.ResolvedModel) built on `device` in `dtype`, with its loss."""
    with torch.device(device):
        module = model.family.model_cls(model.config).to(dtype or torch.float32)
    return TrainingModule(module, model.family.loss)
