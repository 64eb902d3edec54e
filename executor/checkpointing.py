"""Activation checkpointing: every block of a stage recomputes its forward in backward
(the plan's `activation_checkpointing`, per stage), or only its first `checkpointed_layers`
(partial checkpointing). `checkpoint_policy` "selective" keeps the outputs of matmuls and
attention (torch's selective checkpointing, the planner's
planner.parallel.checkpointing.SAVED_KINDS) and recomputes every other op, collectives
included; "selective_alternate" keeps attention and every second linear layer's output
(torchtitan's op-level selective AC: its first, third, ... matmul of the block) and
recomputes the rest."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from planner.parallel.checkpointing import ALTERNATE, SELECTIVE

_aten = torch.ops.aten
# What the planner's linear nodes run (counted by the alternating policy).
LINEAR_OPS = frozenset({_aten.mm.default, _aten.addmm.default})
# What the planner's linear, einsum, conv2d, attention and grouped-matmul nodes run.
SAVED_OPS = LINEAR_OPS | frozenset(
    op
    for op in (
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten.convolution.default,
        getattr(_aten, "_grouped_mm", None) and _aten._grouped_mm.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        # what a lower-right CausalBias calls where flash does not apply (context parallelism)
        _aten._efficient_attention_forward.default,
    )
    if op
)


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _alternate_policy():
    """A policy for one block's forward and its recomputation: the n-th linear-layer matmul
    of each (counted apart: the recomputation replays the forward) is saved when n is odd."""
    seen = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in LINEAR_OPS:
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _save_matmuls(ctx, op)

    return policy


def selective_contexts():
    """torch.utils.checkpoint's context_fn for the selective policy."""
    return create_selective_checkpoint_contexts(_save_matmuls)


def alternate_contexts():
    """torch.utils.checkpoint's context_fn for the alternating policy: a fresh count per
    block call."""
    return create_selective_checkpoint_contexts(_alternate_policy())


def checkpoint_kwargs(policy: str) -> dict:
    """torch.utils.checkpoint keyword arguments for a plan's checkpoint_policy."""
    contexts = {SELECTIVE: selective_contexts, ALTERNATE: alternate_contexts}
    return {"context_fn": contexts[policy]} if policy in contexts else {}


def apply_checkpointing(stage: nn.Module, policy: str = "full", count: int | None = None) -> None:
    """Wrap the stage's blocks, or its first `count` (the plan's checkpointed_layers)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for key, block in list(stage.owned_blocks().items())[:count]:
        stage.set_block(key, checkpoint_wrapper(block, **checkpoint_kwargs(policy)))
