"""Activation checkpointing, per layer: each layer's forward (and its tensor-parallel
communication) is recomputed in backward; each in-flight micro-batch keeps only the layers'
inputs, and one layer's activations are rebuilt at a time.

Selective checkpointing (torch's `create_selective_checkpoint_contexts` with a policy that
saves the outputs of matmuls and attention, torchtitan's op-level selective AC; Korthikanti
et al. 2022, section 5: recompute what is cheap to recompute) keeps those outputs too and
recomputes the other ops (norms, activations, element-wise, reshapes: memory-bound, a small
share of the forward) and the layer's forward collectives. Under tensor parallelism a
row-parallel matmul's output is a whole partial sum, so it keeps more than full
checkpointing and, with sequence parallelism, can keep more than no checkpointing: a choice
for the search, not a rule.

Per-layer checkpointing ("partial"): full checkpointing of only the first k layers a device
holds (in pipeline-chunk order), k chosen per pipeline stage as the fewest that fit (stage 0
holds the most micro-batches in flight, the last stage the fewest): each checkpointed layer
trades its saved tensors for its inputs and adds its forward to the recompute. k = 0 is no
checkpointing and k = all its layers full checkpointing, so it is never slower than either
where they fit.

Search: checkpointing only adds time, so it is tried only when nothing fits without it, then
selective, then partial where selective does not fit (partial can be faster than selective
too, but trying it everywhere cost gpt-39b's warm search 1.6x), full only when neither fits
(never, as partial covers it). Plan fields: stages[].activation_checkpointing,
stages[].checkpoint_policy, stages[].checkpointed_layers.
"""

from __future__ import annotations

from planner.graph.opgraph import OpNode
from planner.intra_op.node_layout import NodeLayout
from planner.parallel.choice import Choice
from planner.placements import is_shard

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
    Choice(
        "stages[].checkpoint_policy",
        "full",
        "executor.checkpointing:apply_checkpointing",
        f"{_TEST}[pp2xtp2-gpipe-ckpt]",
    ),
    Choice(
        "stages[].checkpoint_policy",
        "selective",
        "executor.checkpointing:apply_checkpointing",
        f"{_TEST}[pp2xtp2-selective-ckpt]",
    ),
    Choice(
        "stages[].checkpointed_layers",
        "partial",
        "executor.checkpointing:apply_checkpointing",
        f"{_TEST}[pp2xdp2-partial-ckpt]",
    ),
)
SELECTIVE = "selective"
PARTIAL = "partial"
# The search's checkpointing values (ParallelConfig.checkpointing), least recompute first.
MODES: tuple = (False, SELECTIVE, PARTIAL, True)
# Node kinds whose outputs selective checkpointing keeps (the executor's policy saves the
# matmul and attention ops these nodes run: executor.checkpointing.SAVED_OPS).
SAVED_KINDS = frozenset({"linear", "einsum", "attention", "grouped_mm", "conv2d"})


def searched(modes: tuple) -> tuple:
    """The modes the search tries, in order: full only where partial is not among them
    (partial with every layer checkpointed is full checkpointing)."""
    return tuple(m for m in modes if not (m is True and PARTIAL in modes))


def policy_name(mode) -> str:
    return SELECTIVE if mode == SELECTIVE else "full"


def selectively_saved(node: OpNode) -> bool:
    return node.kind in SAVED_KINDS


def selective_kept_bytes(node: OpNode, lay: NodeLayout, tp: int) -> int:
    """Bytes per device this node keeps per micro-batch under selective checkpointing: a
    matmul's or attention's output as its op returns it on this device (a column-parallel
    output's shard; a row-parallel output's partial sum, whole, before its collective;
    attention's also its log-sum-exp, one float per row); nothing for other nodes."""
    if not selectively_saved(node) or not node.outputs:
        return 0
    out = node.outputs[0]
    partial = any(  # its output is reduced after the op: the op returns the whole partial sum
        name in ("all_reduce", "reduce_scatter") and nbytes == out.nbytes
        for name, nbytes in lay.fwd_comm
    )
    shards = tp if lay.outputs and is_shard(lay.outputs[0]) and not partial else 1
    kept = out.nbytes // shards
    if node.kind == "attention" and len(out.shape) == 4:
        kept += out.numel // out.shape[-1] * 4 // shards
    return kept


def recompute_time(fwd: float, comm_fwd: float) -> float:
    return fwd + comm_fwd


def recompute_of(table, a: int, b: int, mode) -> float:
    """Recomputation per micro-batch of layer positions [a, b) (a LayerTable's); none for
    partial, whose layers are chosen per stage (fewest_layers), so 0 bounds it."""
    if not mode or mode == PARTIAL:
        return 0.0
    if mode == SELECTIVE:
        return table.range_sum("inside:selective_recompute", a, b) + table.range_sum(
            "inside:comm_fwd", a, b
        )
    return recompute_time(
        table.range_sum("inside:fwd", a, b), table.range_sum("inside:comm_fwd", a, b)
    )


def kept_per_layer(table, i: int, mode) -> int:
    """What checkpointing keeps of layer position i per in-flight micro-batch: its inputs,
    and under selective checkpointing the outputs its policy saves; under partial the less
    of its inputs and its saved tensors (a bound: the layer may or may not be checkpointed)."""
    kept = table.layer_inputs[i]
    if mode == PARTIAL:
        return min(kept, table.inside["saved"][i])
    if mode == SELECTIVE:
        kept += table.inside["selective_kept"][i]
    return kept


def kept_of(table, a: int, b: int, mode) -> int:
    """kept_per_layer summed over layer positions [a, b)."""
    kept = sum(table.layer_inputs[a:b])
    if mode == SELECTIVE:
        kept += int(table.range_sum("inside:selective_kept", a, b))
    return kept


def activation_bytes(
    saved_per_microbatch: int,
    inflight_microbatches: float,
    checkpointing,
    checkpoint_inputs_per_microbatch: int = 0,
    largest_layer_saved: int = 0,
    unchecked_saved_per_microbatch: int = 0,
) -> int:
    """Activations held at the peak of a step on one device: without checkpointing every
    in-flight micro-batch keeps all its saved tensors; with it, what checkpointing keeps of
    the layers (kept_per_layer) plus what lies outside layers, and one layer's activations
    being rebuilt (all its saved tensors: under selective checkpointing its kept outputs
    count twice, an overestimate of at most one layer's kept bytes)."""
    if not checkpointing:
        return int(saved_per_microbatch * inflight_microbatches)
    kept = checkpoint_inputs_per_microbatch + unchecked_saved_per_microbatch
    return int(kept * inflight_microbatches) + largest_layer_saved


def fewest_layers(rows: list[tuple[int, int, float]], inflight: float, budget: float, fixed: int):
    """Partial checkpointing on one device: rows are (saved, inputs, recompute) of its layers
    in order, `fixed` the bytes per in-flight micro-batch outside layers, `budget` the bytes
    left for activations. Checkpoints the first k layers for the smallest k whose
    activations fit (all of them when none does): (k, activation bytes, recompute s)."""
    kept = fixed + sum(saved for saved, _, _ in rows)
    largest = recompute = 0.0
    for k in range(len(rows) + 1):
        acts = int(kept * inflight) + int(largest)
        if acts <= budget or k == len(rows):
            return k, acts, recompute
        saved, inputs, again = rows[k]
        kept += inputs - saved
        largest = max(largest, saved)
        recompute += again
    raise AssertionError("unreachable")
