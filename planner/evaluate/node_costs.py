"""Per-node costs under a layout: compute, tensor-parallel communication, per-step gradient
sync on the tp axis, saved bytes and parameter elements per device, per micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

from planner.cluster.mesh import LogicalMesh
from planner.cost import shape_rates
from planner.cost.model import CostModel
from planner.graph.opgraph import OpGraph, OpNode
from planner.intra_op.node_layout import NodeLayout
from planner.parallel import checkpointing
from planner.parallel.tensor import local_param_elements
from planner.placements import REPLICATE


@dataclass(frozen=True)
class NodeCost:
    """Per micro-batch on one device: compute, tensor-parallel communication, and the
    per-step gradient synchronisation on the tp axis (parameters replicated there while the
    data is split there)."""

    fwd: float
    bwd: float
    comm_fwd: float
    comm_bwd: float
    step_comm: float
    saved: int
    params: int  # parameter elements per device of parameters this node owns
    # The part of bwd that computes parameter gradients (a zero-bubble schedule runs it
    # apart): as long as one forward pass for a node with parameters (a matmul's weight
    # gradient is one matmul of the forward's shape), none for a node without.
    wgrad: float = 0.0
    # Under the op-level checkpointing policies (planner.parallel.checkpointing): the bytes
    # of the output kept (a matmul's or attention's), and the forward time recomputed in
    # backward (every other node's; the collectives' are comm_fwd).
    selective_kept: int = 0
    selective_recompute: float = 0.0
    selective_alternate_kept: int = 0
    selective_alternate_recompute: float = 0.0
    # Transient bytes beyond the saved tensors while the node runs backward (the loss's
    # logits-sized gradient buffers: CostModel.workspace_bytes), per micro-batch on one device.
    workspace: int = 0
    # The part of fwd / bwd that does not grow with the tokens (cost.model.NodeTime).
    fixed_fwd: float = 0.0
    fixed_bwd: float = 0.0
    # Under a split backward (planner.cost.schedules.WEIGHT_SPLIT), the bytes its weight
    # gradient waits for from the B pass to the W pass beyond what it saved: the gradient of
    # its output (torch's stage_backward_input keeps it per parameter group, with the graph).
    wgrad_stash: int = 0


def node_costs(
    graph: OpGraph,
    layouts: dict[str, NodeLayout],
    cm: CostModel,
    mesh: LogicalMesh,
    nodes: list[OpNode] | None = None,
) -> dict[str, NodeCost]:
    """Costs of every node (or of `nodes`) under its layout; the tp axis of `mesh` carries
    the comm."""
    out = {}
    tp = mesh.axis("tp").size
    ordinals = checkpointing.linear_ordinals(graph)
    # the runtime's own kernels, where they keep less than the traced ops (planner.runtime)
    by_name = {n.name: n for n in graph.nodes} if cm.runtime.saved_bytes else None
    for node in graph.nodes if nodes is None else nodes:
        lay = layouts[node.name]
        t = _node_time(node, lay, cm)
        saved = cm.saved_bytes(node, by_name) // _saved_shards(node, lay, tp, cm)
        kept = checkpointing.selective_kept_bytes(node, lay, tp)
        nth = ordinals.get(node.name, 0)
        alternate = checkpointing.ALTERNATE
        out[node.name] = NodeCost(
            t.fwd,
            t.bwd,
            tp_comm(cm, lay.fwd_comm, mesh),
            tp_comm(cm, lay.bwd_comm, mesh),
            tp_comm(cm, lay.step_comm, mesh, bucketed=True),
            saved,
            local_param_elements(node, lay, tp),
            min(t.fwd, t.bwd) if node.params else 0.0,
            kept,
            0.0 if checkpointing.selectively_saved(node) else t.fwd,
            checkpointing.selective_kept_bytes(node, lay, tp, nth, alternate),
            0.0 if checkpointing.selectively_saved(node, nth, alternate) else t.fwd,
            cm.workspace_bytes(node) // lay.saved_shards,
            t.fixed_fwd,
            t.fixed_bwd,
            _output_grad_bytes(node, lay, tp) if node.params else 0,
        )
    return out


def _saved_shards(node: OpNode, lay: NodeLayout, tp: int, cm: CostModel) -> int:
    """How many ways what the node saves is split: its layout's, or, where the runtime's
    column-parallel linears keep the sequence-sharded input that sequence parallelism
    gathers in forward (and gather it again in backward), tp."""
    keeps_shard = cm.runtime.keeps_sharded_linear_input and node.kind == "linear"
    if keeps_shard and any(name == "all_gather" for name, _ in lay.fwd_comm):
        return tp
    return lay.saved_shards


def _output_grad_bytes(node: OpNode, lay: NodeLayout, tp: int) -> int:
    if not node.outputs:
        return 0
    return node.outputs[0].nbytes // checkpointing.output_shards(node, lay, tp)


def tp_comm(
    cm: CostModel, events: list[tuple[str, int]], mesh: LogicalMesh, bucketed: bool = False
) -> float:
    """Time of (collective, bytes) events on the tp axis."""
    axis = mesh.axis("tp")
    if bucketed:
        return sum(cm.bucketed(name, nbytes, axis) for name, nbytes in events)
    return sum(getattr(cm, name)(nbytes, axis) for name, nbytes in events)


def _at(places: list[str], i: int) -> str:
    return places[i] if i < len(places) else REPLICATE


def _node_time(node: OpNode, lay: NodeLayout, cm: CostModel):
    """The node's compute under its layout; a linear layer priced by shape (measured GEMM
    rates) at its own local GEMM; under the search's "ideal" bound layout at the fastest of
    the GEMMs a tp split can leave (rows, reduction or output dim divided), so that the bound
    stays below every layout's time however the measured rates vary with shape."""
    shards = lay.compute_shards
    priced_by_shape = cm.gemm_rates or cm.fp8 is not None
    if not priced_by_shape or node.op not in shape_rates.LINEAR_OPS or shards <= 1:
        return cm.node_time(node, shards)
    if lay.strategy == IDEAL:
        splits = [shape_rates.split_gemm(node, (p,), (shards,)) for p in IDEAL_SPLITS]
        return min((cm.node_time(node, shards, g) for g in splits), key=lambda t: t.fwd + t.bwd)
    w = shape_rates.linear_weight_name(node)
    place = lay.params.get(w, REPLICATE) if w else _at(lay.inputs, 1)
    return cm.node_time(node, shards, shape_rates.split_gemm(node, (place,), (shards,)))


IDEAL = "ideal"  # planner.search.bounds.ideal_layouts' strategy name
IDEAL_SPLITS = (REPLICATE, "S(0)", "S(1)")  # the weight's placement: rows, one dim, the other
