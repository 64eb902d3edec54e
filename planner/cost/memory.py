"""Memory per device: parameters, gradients, optimizer state, activations (ZeRO 0-3, AC).

Bytes per parameter are the runtime's (planner.runtime: the request's training.runtime):
autopar's executor follows the ZeRO paper (Rajbhandari et al., SC'20, section 3.1): mixed
precision Adam keeps 2 (bf16/fp16 params) + 2 (grads) + 12 (fp32 master, momentum, variance)
= 16 bytes per parameter. ZeRO over d data-parallel ranks divides the optimizer state by d
(stage 1), also the gradients (stage 2), also the parameters (stage 3); stage 3 gathers one
layer's full parameters at a time, which we add as a working buffer. Megatron-LM keeps fp32
main gradients, DeepSpeed's bf16 optimizer an fp32 gradient buffer as well (their
declarations).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from planner.errors import InputError
from planner.runtime import runtime_of
from planner.vocab import OPTIMIZERS

REDUCE_BYTES = 4  # FSDP2's gradients: fp32, its MixedPrecisionPolicy's reduce_dtype


@dataclass(frozen=True)
class ParamBytes:
    weights: int
    grads: int
    optimizer: int


@functools.cache  # called per stage of every configuration the search evaluates
def bytes_per_param(dtype: str, optimizer: str) -> ParamBytes:
    """Per parameter: weight copy used in compute, gradient, optimizer state (incl. master)."""
    if optimizer not in OPTIMIZERS:
        raise InputError("optimizer", f"unknown optimizer {optimizer!r}", ", ".join(OPTIMIZERS))
    state_fp32 = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}[optimizer]
    if dtype in ("bf16", "fp16"):
        return ParamBytes(2, 2, 4 + 4 * state_fp32)  # fp32 master copy + states
    if dtype in ("fp32", "tf32"):
        return ParamBytes(4, 4, 4 * state_fp32)
    raise InputError("dtype", f"unsupported training dtype {dtype!r}", "fp32, bf16 or fp16")


@dataclass(frozen=True)
class MemoryBreakdown:
    params: int
    grads: int
    optimizer: int
    activations: int
    total: int

    def as_dict(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "total": self.total,
        }


def keeps_cast_copies(zero: int, dp: int, runtime: str = "autopar") -> bool:
    """Whether the runtime keeps a stage's whole fp32 weights and a bf16/fp16 copy of each
    from forward to backward: at its cast_copy_levels (autopar's executor: ZeRO-0's
    replicate and ZeRO-1's fully_shard on one rank, both casting by FSDP2's
    MixedPrecisionPolicy without resharding; torchtitan: DDP under autocast) or without data
    parallelism; where FSDP2 shards the stage over dp (executor.data_parallel), its
    MixedPrecisionPolicy gathers the weights in the compute dtype and keeps no other copy."""
    levels = runtime_of(runtime).cast_copy_levels
    return bool(levels) and (zero in levels or dp == 1)


def compute_copy_bytes(
    params_per_device: int, dtype: str, zero: int, dp: int, runtime: str = "autopar"
) -> int:
    """Low-precision weight copies alive at the step's peak. Where the runtime keeps them
    (keeps_cast_copies), every weight's cast copy lives from forward to backward: 2 bytes per
    parameter the device computes with. With the ZeRO paper's 16 bytes this gives what the
    executor holds at ZeRO-0, 4 + 4 + 8 + 2 = 18. Seen on an H100: a 1.9B-parameter plan
    peaked 11.3 GiB over its prediction, 3.6 GiB of them these copies and 7.8 GiB the loss's
    workspace (bench/results/h100_execute.md). Under FSDP2's MixedPrecisionPolicy the
    gathered compute-dtype weights are model_state_bytes' 2-byte weights (ZeRO-2) or its
    gathered layer (ZeRO-3)."""
    if dtype not in ("bf16", "fp16") or not keeps_cast_copies(zero, dp, runtime):
        return 0
    return 2 * params_per_device


def model_state_bytes(
    params_per_device: int,
    dtype: str,
    optimizer: str,
    zero: int,
    dp: int,
    largest_layer_params: int = 0,
    offload: bool = False,
    runtime: str = "autopar",
    pp: int = 1,
    microbatches: int = 1,
    held_whole: int | None = None,
) -> tuple[int, int, int]:
    """(weights, grads, optimizer) bytes on one device for `params_per_device` parameters
    (already divided by tensor/pipeline parallelism), as the runtime lays them out at the
    step's peak. With CPU offload (ZeRO-3's shards of all three on the host,
    planner.parallel.offload) only the layer being computed is here: its gathered weights
    and its gradients before they are reduced; but under whole-gradient holding every
    layer is. Where the runtime accumulates FSDP2's
    gradients whole (its holds_whole_gradients, for pp stages and `microbatches`), the
    gradients are whole fp32 (the sharded ones are made by the step's reduction, after its
    backward: the optimizer's zero_grad frees them before the step) and under ZeRO-3 every
    layer's weights are gathered; `held_whole`: of the parameters, those whose chunks hold
    them so at once (torch reduces each chunk after its last backward,
    planner.cost.schedule_v.gradient_holders), the others hold their shards."""
    if zero not in (0, 1, 2, 3):
        raise InputError("zero", f"{zero!r} is not a ZeRO stage", "0, 1, 2 or 3")
    per = bytes_per_param(dtype, optimizer)
    declared = runtime_of(runtime)
    whole = declared.holds_whole_gradients(zero, dp, pp, microbatches)
    held = params_per_device if held_whole is None else min(held_whole, params_per_device)
    if offload and whole:
        # the shards and the optimizer on the host, but every unit gathered here and its
        # gradients accumulated whole here, in fp32, until its chunk's reduction
        return held * per.weights, held * REDUCE_BYTES, 0
    if offload:
        return largest_layer_params * per.weights, largest_layer_params * per.grads, 0
    layout = declared.state_bytes(dtype, optimizer, zero)
    weights, grads, opt = (
        int(params_per_device * whole) + -(-int(params_per_device * split) // dp)
        for whole, split in (layout.weights, layout.grads, layout.optimizer)
    )
    if whole:  # the chunks not holding theirs whole at the peak hold their shards
        rest = params_per_device - held
        grads = held * REDUCE_BYTES + (grads * rest // params_per_device if rest else 0)
        largest_layer_params = held  # ZeRO-3: the held chunks' weights all gathered
    if zero >= 3:  # one layer gathered in full, in the compute dtype, while it computes
        weights += largest_layer_params * per.weights
    return weights, grads, opt


@functools.cache  # asked for every configuration the search bounds
def state_bytes_per_param(
    dtype: str,
    optimizer: str,
    zero: int,
    dp: int,
    offload: bool = False,
    runtime: str = "autopar",
    pp: int = 1,
    microbatches: int = 1,
) -> float:
    """Weights + gradients + optimizer state per parameter on one device under ZeRO over dp,
    as the runtime lays them out, and the compute copy (compute_copy_bytes): what predict
    counts per parameter, without the ZeRO-3 gather buffer of one layer (none at all with
    CPU offload). Where the runtime holds gradients whole over `pp` stages and
    `microbatches` (model_state_bytes), their fp32 bytes and, at ZeRO-3, every weight
    gathered (with CPU offload too: only the shards and the optimizer leave)."""
    declared = runtime_of(runtime)
    whole = declared.holds_whole_gradients(zero, dp, pp, microbatches)
    if offload:
        return bytes_per_param(dtype, optimizer).weights + REDUCE_BYTES if whole else 0.0
    weights, grads, opt = declared.state_bytes(dtype, optimizer, zero).on_device(dp)
    if whole:
        grads = REDUCE_BYTES
        if zero >= 3:
            weights += bytes_per_param(dtype, optimizer).weights
    return weights + grads + opt + compute_copy_bytes(1, dtype, zero, dp, runtime)


def breakdown(
    weights: int, grads: int, optimizer: int, activations: int, overhead: int = 0
) -> MemoryBreakdown:
    total = weights + grads + optimizer + activations + overhead
    return MemoryBreakdown(weights, grads, optimizer, activations, total)
