"""Every technique's declaration (planner.parallel.technique), in the order a rank applies
them (DESIGN.md): fp8 swaps the linear modules first, then tensor, sequence and context
placements, activation checkpointing or offload, ZeRO/FSDP2 over dp and its CPU offload,
and the pipeline schedule last."""

from __future__ import annotations

from planner.parallel import (
    activation_offload,
    checkpointing,
    context,
    data,
    fp8,
    offload,
    pipeline,
    sequence,
    tensor,
)
from planner.parallel.technique import Technique

TECHNIQUES: tuple[Technique, ...] = tuple(
    module.TECHNIQUE
    for module in (
        fp8,
        tensor,
        sequence,
        context,
        checkpointing,
        activation_offload,
        data,
        offload,
        pipeline,
    )
)
