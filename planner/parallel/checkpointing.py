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

Alternating selective checkpointing ("selective_alternate"; torchtitan's op-level selective
AC, torchtitan/distributed/activation_checkpoint.py, the policy of its published Llama 3 8B
runs): as selective, but of the layer's linear layers (in forward order) only the first,
third, ... keep their output; the others are recomputed with the rest. About half the
matmul outputs' memory for their recomputation (torchtitan also keeps reduce-scatter
outputs; here a layer's collectives are recomputed under every policy).

Per-layer checkpointing ("partial"): full checkpointing of only the first k layers a device
holds (in pipeline-chunk order), k chosen per pipeline stage as the fewest that fit (stage 0
holds the most micro-batches in flight, the last stage the fewest): each checkpointed layer
trades its saved tensors for its inputs and adds its forward to the recompute. k = 0 is no
checkpointing and k = all its layers full checkpointing, so it is never slower than either
where they fit.

Search: checkpointing only adds time, so it is tried only when nothing fits without it, then
selective, then alternating where selective does not fit, then partial where neither fits
(partial can be faster than either, but trying it everywhere cost gpt-39b's warm search
1.6x), full only when none fits (never, as partial covers it). Plan fields:
stages[].activation_checkpointing, stages[].checkpoint_policy, stages[].checkpointed_layers.
"""

from __future__ import annotations

import functools

from planner.cost.schedules import WEIGHT_SPLIT
from planner.graph.opgraph import OpNode
from planner.intra_op.node_layout import NodeLayout
from planner.parallel import registry
from planner.parallel.choice import Choice
from planner.parallel.technique import Pin, Technique
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
        "stages[].checkpoint_policy",
        "selective_alternate",
        "executor.checkpointing:apply_checkpointing",
        f"{_TEST}[llama-dp2xtp2-alternate-ckpt]",
    ),
    Choice(
        "stages[].checkpointed_layers",
        "partial",
        "executor.checkpointing:apply_checkpointing",
        f"{_TEST}[pp2xdp2-partial-ckpt]",
    ),
)
SELECTIVE = "selective"
ALTERNATE = "selective_alternate"
PARTIAL = "partial"
# Op-level policies: what each keeps and recomputes is summed per layer (LayerTable fields
# "<policy>_kept", "<policy>_recompute").
OP_POLICIES = (SELECTIVE, ALTERNATE)
# Node kinds whose outputs selective checkpointing keeps (the executor's policy saves the
# matmul and attention ops these nodes run: executor.checkpointing.SAVED_OPS).
SAVED_KINDS = frozenset({"linear", "einsum", "attention", "grouped_mm", "conv2d"})


def schedule_refusal(schedule: str, mode) -> str | None:
    """Why the executor cannot run this checkpointing with this schedule, or None. The
    zero-bubble schedules run two backwards through a layer (input gradients, then weight
    gradients): torch's op-level (selective) checkpointing allows one; full and partial
    checkpointing rebuild the layer for the first and keep what they rebuilt until the
    second, so the run holds more than without checkpointing (ZB-V, Llama, 4 layers on 2x2:
    1.18 MB measured with it, 0.55 MB without; the plan predicted 0.16 MB) and recomputes
    besides (bench/results/ledger_property.md)."""
    if recomputes(mode) and schedule in WEIGHT_SPLIT:
        if mode in OP_POLICIES:
            return f"{schedule} splits backward in two; {mode} checkpointing allows one"
        return (
            f"{schedule} splits backward in two; checkpointing would rebuild each layer and "
            "keep it until the weight gradients: more memory than without, and recomputation"
        )
    return None


@functools.cache  # read per candidate the search keys
def modes() -> tuple:
    """The search's checkpointing values (ParallelConfig.checkpointing), least recompute
    first; partial and the activation stores (registry.stores: no recompute, copies instead)
    are tried together (neither is slower than the other everywhere)."""
    return (False, SELECTIVE, ALTERNATE, PARTIAL, *registry.stores(), True)


def searched(modes: tuple) -> tuple:
    """The modes the search tries, in order: full only where partial is not among them
    (partial with every layer checkpointed is full checkpointing)."""
    return tuple(m for m in modes if not (m is True and PARTIAL in modes))


def policy_name(mode) -> str:
    return mode if mode in OP_POLICIES else "full"


def recomputes(mode) -> bool:
    """Whether a mode checkpoints (recomputes) layers: an activation store keeps every
    activation, off the device."""
    return bool(mode) and registry.store_of(mode) is None


def selectively_saved(node: OpNode, linear_ordinal: int = 0, policy: str = SELECTIVE) -> bool:
    """Whether `policy` keeps the node's output; `linear_ordinal`: a linear node's place
    among its layer's linear nodes in forward order, from 1 (linear_ordinals)."""
    if policy == ALTERNATE and node.kind == "linear" and linear_ordinal % 2 == 0:
        return False
    return node.kind in SAVED_KINDS


def linear_ordinals(graph) -> dict[str, int]:
    """Each linear node's place among its layer's linear nodes in forward order, from 1 (what
    the executor's alternating policy counts: one matmul per linear layer)."""
    out = {}
    for nodes in graph.layer_nodes.values():
        linears = [n for n in nodes if n.kind == "linear"]
        out.update({n.name: i for i, n in enumerate(linears, start=1)})
    return out


def selective_kept_bytes(
    node: OpNode, lay: NodeLayout, tp: int, linear_ordinal: int = 0, policy: str = SELECTIVE
) -> int:
    """Bytes per device this node keeps per micro-batch under an op-level policy: a
    matmul's or attention's output as its op returns it on this device (a column-parallel
    output's shard; a row-parallel output's partial sum, whole, before its collective;
    attention's also its log-sum-exp, one float per row); nothing for other nodes."""
    if not selectively_saved(node, linear_ordinal, policy) or not node.outputs:
        return 0
    out, shards = node.outputs[0], output_shards(node, lay, tp)
    kept = out.nbytes // shards
    if node.kind == "attention" and len(out.shape) == 4:
        kept += out.numel // out.shape[-1] * 4 // shards
    return kept


def output_shards(node: OpNode, lay: NodeLayout, tp: int) -> int:
    """How many ways the node's first output is split as the op returns it on a device: tp
    for a sharded output, 1 for a replicated one or a row-parallel partial sum (whole before
    its collective)."""
    out = node.outputs[0]
    partial = any(  # its output is reduced after the op: the op returns the whole partial sum
        name in ("all_reduce", "reduce_scatter") and nbytes == out.nbytes
        for name, nbytes in lay.fwd_comm
    )
    return tp if lay.outputs and is_shard(lay.outputs[0]) and not partial else 1


def recompute_time(fwd: float, comm_fwd: float) -> float:
    return fwd + comm_fwd


def recompute_of(table, a: int, b: int, mode) -> float:
    """Recomputation per micro-batch of layer positions [a, b) (a LayerTable's); none for
    partial, whose layers are chosen per stage (fewest_layers), so 0 bounds it."""
    if not recomputes(mode) or mode == PARTIAL:
        return 0.0
    if mode in OP_POLICIES:
        return table.range_sum(f"inside:{mode}_recompute", a, b) + table.range_sum(
            "inside:comm_fwd", a, b
        )
    return recompute_time(
        table.range_sum("inside:fwd", a, b), table.range_sum("inside:comm_fwd", a, b)
    )


def kept_per_layer(table, i: int, mode) -> int:
    """What checkpointing keeps of layer position i per in-flight micro-batch: its inputs,
    and under an op-level policy the outputs it saves; under partial the less
    of its inputs and its saved tensors (a bound: the layer may or may not be checkpointed)."""
    if registry.store_of(mode) is not None:  # off the device (transit_bytes is on it)
        return 0
    kept = table.layer_inputs[i]
    if mode == PARTIAL:
        return min(kept, table.inside["saved"][i])
    if mode in OP_POLICIES:
        kept += table.inside[f"{mode}_kept"][i]
    return kept


def kept_of(table, a: int, b: int, mode) -> int:
    """kept_per_layer summed over layer positions [a, b)."""
    if registry.store_of(mode) is not None:
        return 0
    kept = sum(table.layer_inputs[a:b])
    if mode in OP_POLICIES:
        kept += int(table.range_sum(f"inside:{mode}_kept", a, b))
    return kept


def rebuilt_of(table, a: int, b: int, mode) -> int:
    """The most bytes one layer of positions [a, b) rebuilds in backward (under activation
    store, holds while its activations come back: transit_bytes): what it saves,
    less what an op policy keeps of it (kept once, not again in the rebuild), and the
    gradients of its backward: the one arriving at its output (its input's size) and the
    largest it makes (its largest output's size)."""
    saved = table.inside["saved"][a:b]
    if (store := registry.store_of(mode)) is not None:  # brought back, not rebuilt
        inputs, largest = table.layer_inputs[a:b], table.largest_outputs[a:b]
        pairs = zip(inputs, largest, strict=True)
        return max((store.transit_bytes(i, o) for i, o in pairs), default=0)
    if not recomputes(mode):
        return max(saved, default=0)
    if mode in OP_POLICIES:
        kept = table.inside[f"{mode}_kept"][a:b]
        saved = [s - k for s, k in zip(saved, kept, strict=True)]
    return max((s + _gradients(table, a + i) for i, s in enumerate(saved)), default=0)


def _gradients(table, i: int) -> int:
    """The gradients live while layer position i's backward runs (rebuilt_of)."""
    return table.layer_inputs[i] + table.largest_outputs[i]


def activation_bytes(
    saved_per_microbatch: int,
    inflight_microbatches: float,
    checkpointing,
    checkpoint_inputs_per_microbatch: int = 0,
    largest_layer_saved: int = 0,
    unchecked_saved_per_microbatch: int = 0,
    saved_after_layers: int = 0,
    workspace: int = 0,
) -> int:
    """Activations held at the peak of a step on one device: without checkpointing every
    in-flight micro-batch keeps all its saved tensors; with it, what checkpointing keeps of
    the layers (kept_per_layer) plus what lies outside layers, and one layer's activations
    being rebuilt (`largest_layer_saved`: rebuilt_of). `workspace`: the loss's transient
    buffers, at the start of a micro-batch's backward (all it saved still held);
    `saved_after_layers`: what the micro-batch saved after its layers (the head), freed by
    then (rebuild_peak)."""
    if not checkpointing:
        return int(saved_per_microbatch * inflight_microbatches) + workspace
    if registry.store_of(checkpointing) is not None:  # the layers' off the device, one back
        held = unchecked_saved_per_microbatch * inflight_microbatches
        return rebuild_peak(held, largest_layer_saved, saved_after_layers, workspace)
    kept = checkpoint_inputs_per_microbatch + unchecked_saved_per_microbatch
    return rebuild_peak(
        kept * inflight_microbatches, largest_layer_saved, saved_after_layers, workspace
    )


def rebuild_peak(held: float, rebuilt: float, freed: float, workspace: int) -> int:
    """The later of a checkpointed step's two high points: every in-flight micro-batch's
    forward done and the loss's backward starting (`held` + `workspace`), or a layer
    rebuilt (`rebuilt` bytes) in one micro-batch's backward, by when what it saved after the
    layer has run its backward and gone (`freed`: measured on a last pipeline stage with
    full checkpointing, its head's logits and inputs; counting them over-predicted the
    run by 28%)."""
    return int(max(held + workspace, held - freed + rebuilt))


def fewest_layers(
    rows: list[tuple[int, int, float, int]],
    inflight: float,
    budget: float,
    fixed: int,
    after: int = 0,
    workspace: int = 0,
):
    """Partial checkpointing on one device: rows are layer_rows' of its layers
    in order, `fixed` the bytes per in-flight micro-batch outside layers (`after` of them
    after the layers), `budget` the bytes left for activations. Checkpoints the first k
    layers for the smallest k whose activations fit (all of them when none does):
    (k, activation bytes, recompute s). A checkpointed layer is rebuilt once the
    micro-batch's later (unchecked) layers have run their backward and freed what they
    saved (measured: with 1 of 2 layers checkpointed on a 1F1B first stage, a rebuild on top
    of everything held over-predicted the run by 38%)."""
    unchecked = sum(row[0] for row in rows)
    kept = fixed + unchecked
    largest = recompute = 0.0
    for k in range(len(rows) + 1):
        acts = rebuild_peak(kept * inflight, largest, unchecked + after, workspace)
        if acts <= budget or k == len(rows):
            return k, acts, recompute
        saved, inputs, again, gradients = rows[k]
        kept += inputs - saved
        unchecked -= saved
        largest = max(largest, saved + gradients)  # as rebuilt_of
        recompute += again
    raise AssertionError("unreachable")


def layer_rows(table, ranges) -> list[tuple[int, int, float, int]]:
    """(saved, inputs, recompute, backward's gradients) of each layer a device holds, chunk
    by chunk in order."""
    inside = table.inside
    return [
        (
            inside["saved"][i],
            table.layer_inputs[i],
            inside["fwd"][i] + inside["comm_fwd"][i],
            _gradients(table, i),
        )
        for a, b in ranges
        for i in range(a, b)
    ]


PINS: tuple[Pin, ...] = (
    Pin(
        "checkpointing",
        "choice",
        "activation checkpointing: true (CLI on: full), false (off), selective (keep matmul "
        "and attention outputs), selective_alternate (keep every second linear layer's "
        "output: torchtitan's op-level policy), partial (full on the fewest layers per stage "
        "that fit)",
        choices=(True, False, "selective", "selective_alternate", "partial"),
    ),
)


TECHNIQUE = Technique(
    "checkpointing",
    order=50,
    pins=PINS,
    choices=CHOICES,
    terms=(
        "planner.parallel.checkpointing:recompute_of",
        "planner.parallel.checkpointing:kept_of",
        "planner.parallel.checkpointing:rebuilt_of",
        "planner.parallel.checkpointing:activation_bytes",
        "planner.parallel.checkpointing:rebuild_peak",
    ),
)
