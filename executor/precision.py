"""The plan's training dtype: mixed precision with fp32 master weights.

Parameters, gradients and optimizer state stay fp32; matmuls and attention run in the plan's
dtype under autocast, on every path (module styles, graph mode, the reference), so bf16 and
fp16 runs compare with a reference that does the same. On the module path FSDP2 also casts
the parameters to the plan's dtype for compute at every ZeRO level (executor.data_parallel),
and the reference computes with parameters cast the same way (`cast_parameters_dtype`).
fp16 adds dynamic loss scaling.
"""

from __future__ import annotations

import contextlib

import torch

from planner.executable import plan_executor_mode
from planner.vocab import DTYPES

COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
assert set(COMPUTE_DTYPES) == set(DTYPES), "every plan dtype needs a compute dtype"


def autocast(dtype: str, device: torch.device):
    """A context under which the forward runs in the plan's precision."""
    compute = COMPUTE_DTYPES[dtype]
    if compute is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute)


def cast_parameters_dtype(plan) -> torch.dtype | None:
    """The dtype the plan's module-path run computes with its parameters cast to (FSDP2's
    MixedPrecisionPolicy, executor.data_parallel), or None where it keeps them fp32 under
    autocast (graph mode, executor.graph_data_parallel)."""
    compute = COMPUTE_DTYPES[plan.request.training.dtype]
    if compute is None or plan_executor_mode(plan) != "modules":
        return None
    return compute


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2018, "Mixed Precision Training"):
    the loss is multiplied by `scale` before backward; gradients are divided by it before the
    optimizer step; a step whose gradients overflowed (on any rank) is skipped and the scale
    halved; after `growth_interval` good steps it doubles. Written on plain tensors so it
    works with DTensor gradients and inside pipeline schedules, where torch's GradScaler
    does not reach. bf16 and fp32 use scale 1 and never skip."""

    def __init__(self, enabled: bool, scale: float = 2.0**16, growth_interval: int = 2000):
        self.enabled = enabled
        self.scale = scale if enabled else 1.0
        self.growth_interval = growth_interval
        self._good_steps = 0

    def unscale_and_check(self, params: list[torch.nn.Parameter], group=None) -> bool:
        """Divide gradients by the scale; True when every rank's gradients are finite."""
        if not self.enabled:
            return True
        finite = torch.ones(())
        for p in params:
            if p.grad is None:
                continue
            p.grad.mul_(1.0 / self.scale)
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if not torch.isfinite(local).all():
                finite.zero_()
        if torch.distributed.is_initialized():
            device = params[0].grad.device if params and params[0].grad is not None else None
            flag = finite.to(device) if device is not None else finite
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
            finite = flag.cpu()
        ok = bool(finite.item())
        self._update(ok)
        return ok

    def _update(self, ok: bool) -> None:
        if not ok:
            self.scale /= 2.0
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= 2.0


def loss_scaler(dtype: str) -> LossScaler:
    return LossScaler(enabled=dtype == "fp16")
