"""Activation checkpointing, per layer: each layer's forward (and its tensor-parallel
communication) is recomputed in backward; each in-flight micro-batch keeps only the layers'
inputs, and one layer's activations are rebuilt at a time. Search: it only adds time, so it
is tried only when nothing fits without it. Plan field: stages[].activation_checkpointing.
"""

from __future__ import annotations

from planner.parallel.choice import Choice

_TEST = "tests/executor/test_execute.py::test_plan_matches_single_process_reference"
CHOICES = (
    Choice(
        "stages[].activation_checkpointing",
        False,
        "executor.parallelize:parallelize",
        f"{_TEST}[pp2xtp2-1f1b]",
    ),
    Choice(
        "stages[].activation_checkpointing",
        True,
        "executor.checkpointing:apply_checkpointing",
        f"{_TEST}[pp2xtp2-gpipe-ckpt]",
    ),
)


def recompute_time(fwd: float, comm_fwd: float) -> float:
    return fwd + comm_fwd


def activation_bytes(
    saved_per_microbatch: int,
    inflight_microbatches: float,
    checkpointing: bool,
    checkpoint_inputs_per_microbatch: int = 0,
    largest_layer_saved: int = 0,
    unchecked_saved_per_microbatch: int = 0,
) -> int:
    """Activations held at the peak of a step on one device: without checkpointing every
    in-flight micro-batch keeps all its saved tensors; with it, the layers' inputs (plus what
    lies outside layers) and one layer's activations being rebuilt."""
    if not checkpointing:
        return int(saved_per_microbatch * inflight_microbatches)
    kept = checkpoint_inputs_per_microbatch + unchecked_saved_per_microbatch
    return int(kept * inflight_microbatches) + largest_layer_saved
