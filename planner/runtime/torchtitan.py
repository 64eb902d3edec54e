"""torchtitan (its job config, api/export/torchtitan.py): FSDP2's fully_shard with
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), torchtitan's defaults
(training.mixed_precision_param = "bfloat16", mixed_precision_reduce = "float32"), or DDP
under autocast where nothing is sharded.

Layout under FSDP2 with d shards: the sharded parameter is the fp32 master (4/d), the
sharded gradient fp32 (4/d, reduce_dtype), the optimizer's states 4/d each; the compute
copy is gathered in bf16. ZeRO-3 (reshard_after_forward "always") gathers one layer at a
time, as the ZeRO paper's 16/d counts. The plan's ZeRO-1/2 export as "never" (the gathered
bf16 weights kept from forward to backward: 2 bytes whole) with gradients and states
sharded: 2 + 4/d + 4/d + 8/d. Without FSDP (ZeRO-0): fp32 weights and gradients, autocast's
cast copies, as autopar's executor. Under a pipeline (torch's schedules) FSDP2 keeps the
gradients whole in fp32 and every layer gathered until the step's end
(Runtime.holds_whole_gradients)."""

from __future__ import annotations

from planner.runtime.declaration import Runtime, StateBytes, adam_states, low_precision, zero_paper


def state_bytes(dtype: str, optimizer: str, zero: int) -> StateBytes:
    if zero in (1, 2) and low_precision(dtype):
        return StateBytes(
            weights=(2, 0), grads=(0, 4), optimizer=(0, 4 + 4 * adam_states(optimizer))
        )
    return zero_paper(dtype, optimizer, zero)


RUNTIME = Runtime(
    "torchtitan",
    summary="torchtitan: FSDP2 with bf16 compute and fp32 reduction, or DDP under autocast",
    sources=(
        "torch.distributed.fsdp.MixedPrecisionPolicy (param_dtype, reduce_dtype)",
        "torchtitan JobConfig defaults: mixed_precision_param bfloat16, "
        "mixed_precision_reduce float32, fsdp_reshard_after_forward",
        "Rajbhandari et al., ZeRO, SC'20, section 3.1",
        "torch 2.13: distributed/pipelining/stage.py (backward_maybe_with_nosync)",
        "torchtitan/train.py (Trainer.train_step, forward_backward_step): no no_sync",
    ),
    zero_levels=(0, 1, 2, 3),
    zero_names="DDP or FSDP2 (ZeRO 0-3 as fsdp_reshard_after_forward)",
    state_bytes=state_bytes,
    cast_copy_levels=(0,),  # DDP; ZeRO 1-3 are FSDP2 with MixedPrecisionPolicy
    fsdp2_levels=(1, 2, 3),  # its pipelines run torch's schedules (holds_whole_gradients)
    # torchtitan/train.py: train_step calls loss.backward() for each gradient-accumulation
    # micro-batch with FSDP2's / replicate's sync left on
    reduces_every_backward=(0, 1, 2, 3),
)
