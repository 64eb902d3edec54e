"""autopar's own executor (executor/): DDP or FSDP2 (fully_shard with MixedPrecisionPolicy,
as torchtitan applies it), torch's pipeline schedules, torchao fp8.

Layout: the ZeRO paper's bytes (declaration.zero_paper) at ZeRO 0, 2 and 3; ZeRO-1 as
executor/zero1.py holds it (zero1_bytes). Where the weights are kept whole in fp32 (ZeRO 0-1,
or dp 1) FSDP2's MixedPrecisionPolicy casts them for compute and keeps each cast copy from
forward to backward (replicate, or fully_shard on one rank without resharding): 2 bytes more
per parameter, seen on an H100 when autocast made the same copies
(bench/results/h100_execute.md: a 1.9B-parameter plan peaked 3.6 GiB over a prediction
without them)."""

from __future__ import annotations

from planner.runtime.declaration import (
    Runtime,
    StateBytes,
    adam_states,
    low_precision,
    zero_paper,
)


def zero1_bytes(dtype: str, optimizer: str, zero: int) -> StateBytes:
    """ZeRO-1 as executor/zero1.py runs it: every dp rank keeps the module's whole fp32
    parameters (4) and their whole fp32 gradients (4); the optimizer steps this rank's
    shard of fp32 master copies (4) with its states (4 each), split over dp. Megatron-LM's
    distributed optimizer has this shape (its declaration, 6 + 12/d in bf16). Other levels:
    the ZeRO paper's."""
    if zero != 1:
        return zero_paper(dtype, optimizer, zero)
    low_precision(dtype)  # checks the dtype
    return StateBytes(weights=(4, 0), grads=(4, 0), optimizer=(0, 4 + 4 * adam_states(optimizer)))


RUNTIME = Runtime(
    "autopar",
    summary="autopar's executor: DDP or FSDP2, torch's schedules, torchao fp8",
    sources=(
        "Rajbhandari et al., ZeRO, SC'20, section 3.1 (2 + 2 + 12 bytes per parameter)",
        "executor/zero1.py (ZeRO-1: whole fp32 parameters and gradients, fp32 master shards)",
        "bench/results/h100_execute.md (autocast's cast copies, measured on an H100)",
        "torch 2.13: distributed/pipelining/stage.py (backward_maybe_with_nosync, "
        "perform_reduce_grad), distributed/fsdp/_fully_shard/_fsdp_param.py "
        "(to_accumulated_grad_if_needed): gradients accumulated whole in fp32",
    ),
    zero_levels=(0, 1, 2, 3),
    zero_names="ZeRO 0-3",
    state_bytes=zero1_bytes,
    cast_copy_levels=(0, 1),  # DDP, and ZeRO-1's whole fp32 parameters (executor.zero1)
    tp_layouts=("megatron", "per_node"),
    fsdp2_levels=(2, 3),  # executor.data_parallel's fully_shard; ZeRO-1 is executor.zero1
    # executor.training.accumulate: ZeRO-2 reduces in the last micro-batch's backward,
    # ZeRO-3 reduce-scatters each micro-batch's
    accumulates_unsharded=(2,),
    reduces_every_backward=(3,),  # ZeRO 0-2 reduce in the last one (executor.training.accumulate)
)
