"""fp8 matmuls for training (issue 17, item 3): torchao's float8 training, which swaps a
model's nn.Linear layers for Float8Linear (inputs, weights and output gradients cast to
float8 e4m3/e5m2 with dynamic scales; GEMMs through torch._scaled_mm), with torchao's own
recipes: "tensorwise" (one scale per tensor) and "rowwise" (one per row, more accurate,
slower on the H100 measured: bench/results/h100_fp8.md).

What is swapped: the linear layers whose input and output features are multiples of 16
(what the fp8 GEMM needs) except the language-model head, whose logits feed the loss
directly (torchtitan leaves it in high precision too). Parameters and optimizer state stay
fp32 (executor.precision); under bf16 autocast Float8Linear casts its input to bf16 first.

fp8 needs a CUDA device with fp8 tensor cores (compute capability 8.9: Ada, Hopper and
later); on the CPU (gloo tests) it cannot run, and `fp8_refusal` says so.
"""

from __future__ import annotations

import torch
from torch import nn

FP8_RECIPES = ("tensorwise", "rowwise")
HEAD_NAMES = frozenset({"output", "lm_head", "head"})


def fp8_refusal(device: torch.device) -> str | None:
    """Why fp8 training cannot run on `device`, or None."""
    if device.type != "cuda":
        return f"fp8 matmuls need a CUDA GPU with fp8 tensor cores; this run is on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (
            f"fp8 matmuls need compute capability 8.9 or later (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}"
        )
    return None


def fp8_eligible(module: nn.Module, fqn: str) -> bool:
    """Whether `module` (at `fqn`) is a linear layer the fp8 recipe converts."""
    if not isinstance(module, nn.Linear) or fqn.rsplit(".", 1)[-1] in HEAD_NAMES:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(model: nn.Module, recipe: str, device: torch.device) -> int:
    """Swap `model`'s eligible linear layers for torchao's Float8Linear under `recipe`;
    returns how many were swapped. Raises ValueError naming the recipe or the device."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r}: expected one of {', '.join(FP8_RECIPES)}")
    refusal = fp8_refusal(device)
    if refusal:
        raise ValueError(refusal)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(
        model,
        module_filter_fn=fp8_eligible,
        config=Float8LinearConfig.from_recipe_name(recipe),
    )
    return before - sum(type(m) is nn.Linear for m in model.modules())
