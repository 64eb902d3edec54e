"""A runtime's declaration: its model-state layout, with the sources it is read from."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from planner.errors import InputError
from planner.vocab import OPTIMIZERS

Part = tuple[float, float]  # bytes per parameter (kept whole, split over the ZeRO group)


@dataclass(frozen=True)
class StateBytes:
    """A runtime's bytes per parameter on one device: the weights the forward computes
    with, the gradient buffers and the optimizer's state (fp32 master weights included),
    each part kept whole or split over the d ranks of the ZeRO group."""

    weights: Part
    grads: Part
    optimizer: Part

    def on_device(self, d: int) -> tuple[float, float, float]:
        """(weights, grads, optimizer) bytes per parameter with a ZeRO group of d ranks."""
        return tuple(
            whole + split / d for whole, split in (self.weights, self.grads, self.optimizer)
        )


def adam_states(optimizer: str) -> int:
    """fp32 values the optimizer keeps per parameter beside the master copy."""
    if optimizer not in OPTIMIZERS:
        raise InputError("optimizer", f"unknown optimizer {optimizer!r}", ", ".join(OPTIMIZERS))
    return {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}[optimizer]


def low_precision(dtype: str) -> bool:
    if dtype in ("bf16", "fp16"):
        return True
    if dtype in ("fp32", "tf32"):
        return False
    raise InputError("dtype", f"unsupported training dtype {dtype!r}", "fp32, bf16 or fp16")


def zero_paper(dtype: str, optimizer: str, zero: int) -> StateBytes:
    """The ZeRO paper's layout (Rajbhandari et al., SC'20, section 3.1): mixed precision
    keeps 2 (bf16/fp16 weights) + 2 (gradients) + 4 (fp32 master) + 4 per optimizer state;
    ZeRO over d ranks splits the optimizer state (level 1), the gradients too (2), the
    weights too (3). fp32 training keeps 4 + 4 + 4 per state and no master copy."""
    states = adam_states(optimizer)
    weights, grads = (2, 2) if low_precision(dtype) else (4, 4)
    opt = (4 if low_precision(dtype) else 0) + 4 * states
    return StateBytes(
        weights=(0, weights) if zero >= 3 else (weights, 0),
        grads=(0, grads) if zero >= 2 else (grads, 0),
        optimizer=(0, opt) if zero >= 1 else (opt, 0),
    )


@dataclass(frozen=True)
class Runtime:
    name: str
    summary: str
    sources: tuple[str, ...]  # where each figure of its layout is read
    zero_levels: tuple[int, ...]  # the ZeRO levels its configuration can say
    zero_names: str  # how it names them, for errors
    # (dtype, optimizer, zero) -> bytes per parameter, whole and split
    state_bytes: Callable[[str, str, int], StateBytes]
    # the ZeRO levels at which it keeps whole fp32 weights and a compute-dtype copy of each
    # from forward to backward (autocast's saved casts, or FSDP2's cast without resharding),
    # at any level without data parallelism; elsewhere FSDP2's mixed precision gathers them
    # in the compute dtype (planner.cost.memory). None at all: its weights are kept in the
    # compute dtype
    cast_copy_levels: tuple[int, ...] = ()
    # (node, the bytes the traced op saves on the device's kernels, the graph's nodes by
    # name) -> what the runtime's own kernels save for it (planner.cost.model.saved_bytes)
    saved_bytes: Callable[[Any, int, Mapping[str, Any]], int] | None = None
    # under sequence parallelism a column-parallel linear keeps its sequence-sharded input
    # and gathers it again in backward (instead of keeping the gathered input)
    keeps_sharded_linear_input: bool = False
    # the tensor-parallel layouts its configuration can say (planner.vocab TpLayoutName):
    # a framework's own TP is Megatron's; the ILP's per-node layouts run in autopar's
    # executor only
    tp_layouts: tuple[str, ...] = ("megatron",)
    # a layer's tensor-parallel collectives are cut into chunks that run beside the GEMMs
    # they feed or come from (Transformer Engine's userbuffers: Megatron-LM's
    # --tp-comm-overlap), so the layer's compute covers them (planner.evaluate.layer_table)
    tp_comm_overlap: bool = False
    # the ZeRO levels it runs with FSDP2's fully_shard (where dp > 1), and of those the ones
    # at which, without a pipeline, it reduces once over several micro-batches, in the last
    # backward (holds_whole_gradients)
    fsdp2_levels: tuple[int, ...] = ()
    accumulates_unsharded: tuple[int, ...] = ()
    # the ZeRO levels whose data-parallel wrapper reduces the gradients in every backward,
    # each micro-batch's too, without a pipeline (its train loop never turns the sync off)
    reduces_every_backward: tuple[int, ...] = ()

    def holds_whole_gradients(self, zero: int, dp: int, pp: int, microbatches: int) -> bool:
        """Whether a step holds each FSDP2 unit's gradients whole, upcast to fp32
        (FSDPParam.to_accumulated_grad_if_needed: the MixedPrecisionPolicy's reduce_dtype),
        and its weights gathered, from the unit's first backward to the step's one
        reduction: under torch's pipeline schedules always (torch 2.13's
        PipelineStage.backward_maybe_with_nosync turns gradient sync and resharding after
        backward off for every backward; perform_reduce_grad reduces at the step's end), and
        without one over several micro-batches at its accumulates_unsharded levels.
        Elsewhere FSDP2 reduce-scatters each unit's gradients in its backward."""
        if dp == 1 or zero not in self.fsdp2_levels:
            return False
        return pp > 1 or (microbatches > 1 and zero in self.accumulates_unsharded)

    def reductions_per_step(self, zero: int, dp: int, pp: int, microbatches: int) -> int:
        """How often a step reduces the gradients over dp: once under torch's pipeline
        schedules (their stage turns the sync off until the step's end) and at levels that
        accumulate (not reduces_every_backward); else in each micro-batch's backward."""
        if dp == 1 or pp > 1 or zero not in self.reduces_every_backward:
            return 1
        return microbatches

    def refusal(self, zero: int) -> str | None:
        if zero not in self.zero_levels:
            return f"{self.name} runs {self.zero_names}, not ZeRO-{zero}"
        return None
