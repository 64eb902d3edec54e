"""Activation checkpointing: every block of a stage recomputes its forward in backward
(the plan's `activation_checkpointing`, per stage)."""

from __future__ import annotations

from torch import nn


def apply_checkpointing(stage: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for key, block in stage.owned_blocks().items():
        stage.set_block(key, checkpoint_wrapper(block))
