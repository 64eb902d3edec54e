"""DeepSpeed (api/export/deepspeed.py): bf16 runs at ZeRO stage 0 go through its
BF16_Optimizer, which keeps, besides the bf16 weights and their bf16 gradients, a flat fp32
gradient buffer the size of the whole model (fp32_groups_gradients_flat, zeros_like the
flat bf16 weights in fp32) and shards only the fp32 master weights and the optimizer's
states over dp (fp32_groups_flat_partition): 2 + 2 + 4 + 12/d per parameter
(deepspeed/runtime/bf16_optimizer.py, _setup_for_real_optimizer). ZeRO stage 1 (its ZeRO
optimizer) keeps the bf16 gradients whole and an fp32 gradient partition beside the master
partition (single_grad_partition, deepspeed/runtime/zero/stage_1_and_2.py): 2 + 2 + 4/d +
12/d. Stages 2 and 3 as the ZeRO paper counts them (the paper is DeepSpeed's)."""

from __future__ import annotations

from planner.runtime.declaration import Runtime, StateBytes, adam_states, low_precision, zero_paper


def state_bytes(dtype: str, optimizer: str, zero: int) -> StateBytes:
    if zero >= 2 or not low_precision(dtype):
        return zero_paper(dtype, optimizer, zero)
    opt = 4 + 4 * adam_states(optimizer)
    if zero == 0 and dtype == "bf16":  # BF16_Optimizer
        return StateBytes(weights=(2, 0), grads=(2 + 4, 0), optimizer=(0, opt))
    if zero == 1:
        return StateBytes(weights=(2, 0), grads=(2, 4), optimizer=(0, opt))
    return zero_paper(dtype, optimizer, zero)  # fp16 at stage 0: FP16_Optimizer, unsharded


RUNTIME = Runtime(
    "deepspeed",
    summary="DeepSpeed: its BF16_Optimizer at stage 0, ZeRO stages 1-3",
    sources=(
        "deepspeed/runtime/bf16_optimizer.py: fp32_groups_gradients_flat (whole), "
        "fp32_groups_flat_partition (1/d)",
        "deepspeed/runtime/zero/stage_1_and_2.py: single_grad_partition (fp32, 1/d)",
        "Rajbhandari et al., ZeRO, SC'20, section 3.1",
    ),
    zero_levels=(0, 1, 2, 3),
    zero_names="ZeRO stages 0-3",
    state_bytes=state_bytes,
)
