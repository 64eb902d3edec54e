"""fp8 matmuls for training: torchao's float8 training, which swaps a
model's nn.Linear layers for Float8Linear (inputs, weights and output gradients cast to
float8 e4m3/e5m2 with dynamic scales; GEMMs through torch._scaled_mm), with torchao's own
recipes: "tensorwise" (one scale per tensor) and "rowwise" (one per row, more accurate,
slower on the H100 measured: bench/results/h100_fp8.md).

What is swapped: the linear layers whose input and output features are multiples of 16
(what the fp8 GEMM needs) except the language-model head, whose logits feed the loss
directly (torchtitan leaves it in high precision too). Parameters and optimizer state stay
fp32 (executor.precision); under bf16 autocast Float8Linear casts its input to bf16 first.

On CUDA, fp8 needs fp8 tensor cores (compute capability 8.9: Ada, Hopper and later), and
`fp8_refusal` says so elsewhere; there each converted block is compiled (`compile_blocks`):
eagerly, torchao's amax, scale and cast kernels cost more than the fp8 GEMM saves
(bench/results/h100_fp8.md: 0.1-0.8x bf16's speed eager, 0.95-1.65x compiled), and the
planner prices the fused casts (planner.parallel.fp8). On the CPU, torch 2.13's
torch._scaled_mm runs the same float8 arithmetic (slowly, in software): the gloo tests check
the plans' fp8 against the single-process reference with it.

Which layers (planner.parallel.fp8.eligible and fp8_eligible here agree; a test checks it):
the plan's stage modules' nn.Linear layers with both dims multiples of 16, but the head.
With tensor parallelism the converted layers take plain Colwise/RowwiseParallel: torchao's
Float8Linear casts DTensor inputs and weights with amaxes reduced over the tp group, so the
scales are those of the whole tensors, as on one process.
"""

from __future__ import annotations

import torch
from torch import nn

from planner.parallel.fp8 import ALIGN, HEAD_NAMES
from planner.vocab import FP8_RECIPES


def fp8_refusal(device: torch.device) -> str | None:
    """Why fp8 training cannot run on `device`, or None (the CPU runs it in software)."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"fp8 matmuls run on CUDA GPUs with fp8 tensor cores and on the CPU; not {device}"
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
    return module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0


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


def compile_blocks(stage: nn.Module, device: torch.device) -> int:
    """On CUDA, compile each block of `stage` that holds a converted layer, so torchao's
    casts fuse (module docstring); returns how many were. Nothing on the CPU."""
    if device.type != "cuda":
        return 0
    from torchao.float8.float8_linear import Float8Linear

    count = 0
    for block in stage.owned_blocks().values():
        if any(isinstance(m, Float8Linear) for m in block.modules()):
            block.compile()
            count += 1
    return count
