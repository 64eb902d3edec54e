"""Sharding strategies of a node on a 1-D or 2-D logical mesh, each with its cost and memory.

A strategy picks one AxisChoice (planner.intra_op.sharding_rules) per mesh axis. Its placements
are one string per axis for every input, output and parameter ("R", "S(d)", "P"); a tensor dim
may be sharded on two axes only if it divides by both sizes.
Costs, from the one cost model:
- compute_s: forward + backward time with the work split over the axes whose choice splits it;
- comm_s: per micro-batch, the strategy's own communication: all-reduce of partial input
  gradients in backward, loss-parallel reductions, ZeRO-3 gathers (2x all-gather of the
  parameters) and gradient reduce-scatter;
- grad_sync_s: per step, all-reduce of the gradients of parameters replicated on an axis where
  the data is split (charged once per step, not per micro-batch);
- memory: parameter elements per device (for weights, grads and optimizer state) and
  activation bytes saved for backward per micro-batch per device.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from planner.cluster.mesh import LogicalMesh
from planner.cost import shape_rates
from planner.cost.model import CostModel
from planner.executable import executable
from planner.graph.opgraph import OpNode, TensorMeta
from planner.intra_op.sharding_rules import AxisChoice, axis_choices, with_zero
from planner.placements import shard_dim

Placements = tuple[str, ...]  # one per mesh axis


@dataclass(frozen=True)
class Strategy:
    name: str
    inputs: tuple[Placements, ...]
    outputs: tuple[Placements, ...]
    params: tuple[tuple[str, Placements], ...]
    compute_s: float
    comm_s: float
    grad_sync_s: float
    param_elems: int  # per device, parameters owned by this node
    saved_bytes: int  # per device, per micro-batch
    fwd_collectives: tuple[str, ...] = ()  # the strategy's own forward communication
    compute_shards: int = 1
    # (axis, collective, bytes) of its own communication: per micro-batch forward/backward,
    # and per step (bucketed gradient sync)
    fwd_events: tuple[tuple[int, str, float], ...] = ()
    bwd_events: tuple[tuple[int, str, float], ...] = ()
    step_events: tuple[tuple[int, str, float], ...] = ()

    def step_cost(self, microbatches: int) -> float:
        """Per micro-batch cost, with per-step costs spread over the micro-batches."""
        return self.compute_s + self.comm_s + self.grad_sync_s / microbatches


def local_bytes(meta: TensorMeta, placements: Placements, mesh: LogicalMesh, skip: int = -1):
    div = 1
    for a, place in enumerate(placements):
        if a != skip and shard_dim(place) is not None:
            div *= mesh.shape[a]
    return meta.nbytes / div


def _valid(meta: TensorMeta, placements: Placements, mesh: LogicalMesh) -> bool:
    per_dim: dict[int, int] = {}
    for a, place in enumerate(placements):
        d = shard_dim(place)
        if d is not None:
            per_dim[d] = per_dim.get(d, 1) * mesh.shape[a]
    return all(d < len(meta.shape) and meta.shape[d] % k == 0 for d, k in per_dim.items())


def _local_gemm(node: OpNode, choices, inputs, param_places, mesh: LogicalMesh, cm: CostModel):
    """A linear layer's local (m, k, n) under these choices, where measured GEMM rates by shape
    will price it (planner.cost.shape_rates); None otherwise."""
    if not cm.gemm_rates or node.op not in shape_rates.LINEAR_OPS:
        return None
    w = shape_rates.linear_weight_name(node)
    split = [a for a, c in enumerate(choices) if c.split_compute]
    places = [param_places[w][a] if w else inputs[1][a] for a in split]
    return shape_rates.split_gemm(node, places, [mesh.shape[a] for a in split])


def _combine(
    node: OpNode,
    choices: tuple[AxisChoice, ...],
    mesh: LogicalMesh,
    cm: CostModel,
    grad_share: dict[int, float],
) -> Strategy | None:
    axes = mesh.axes
    inputs = tuple(tuple(c.inputs[i] for c in choices) for i in range(len(node.inputs)))
    outputs = tuple(tuple(c.outputs[j] for c in choices) for j in range(len(node.outputs)))
    param_places = {p: tuple(dict(c.params).get(p, "R") for c in choices) for p in node.params}
    for meta, pl in zip(node.inputs, inputs, strict=True):
        if not _valid(meta, pl, mesh):
            return None
    for meta, pl in zip(node.outputs, outputs, strict=True):
        if not _valid(meta, pl, mesh):
            return None
    for p, pl in param_places.items():
        if not _valid(node.params[p], pl, mesh):
            return None
    shards = 1
    for a, c in enumerate(choices):
        if c.split_compute:
            shards *= mesh.shape[a]
    t = cm.node_time(node, shards, _local_gemm(node, choices, inputs, param_places, mesh, cm))
    comm = 0.0
    sync = 0.0
    fwd_names: list[str] = []
    fwd_ev: list[tuple[int, str, float]] = []
    bwd_ev: list[tuple[int, str, float]] = []
    step_ev: list[tuple[int, str, float]] = []
    for a, c in enumerate(choices):
        fwd_names += [name for name, _ in c.fwd_comm]
        if c.zero3:
            fwd_names.append("all_gather")
        axis = axes[a]
        for i in c.partial_input_grads:
            # Consumers of one tensor (q, k, v) add their partial gradients locally first;
            # one all-reduce follows, each consumer pays its share.
            share = grad_share.get(i, 1.0)
            if share:
                nbytes = local_bytes(node.inputs[i], inputs[i], mesh, skip=a)
                comm += share * cm.all_reduce(nbytes, axis)
                bwd_ev.append((a, "all_reduce", share * nbytes))
        for name, nbytes in c.fwd_comm:
            comm += getattr(cm, name)(nbytes, axis)
            fwd_ev.append((a, name, nbytes))
        for p in c.partial_param_grads:
            grad = local_bytes(node.params[p], param_places[p], mesh, skip=a)
            if c.zero3:
                gather = cm.bucketed("all_gather", grad, axis)
                comm += 2 * gather + cm.bucketed("reduce_scatter", grad, axis)
            else:
                sync += cm.bucketed("all_reduce", grad, axis)
                step_ev.append((a, "all_reduce", grad))
    owned = [p for p in node.params if p not in node.shared_params]
    elems = 0
    for p in owned:
        div = 1
        for a, place in enumerate(param_places[p]):
            if shard_dim(place) is not None:
                div *= mesh.shape[a]
        elems += node.params[p].numel // div
    saved = cm.saved_bytes(node) // shards
    name = "|".join(f"{mesh.axis_names[a]}:{c.name}" for a, c in enumerate(choices))
    return Strategy(
        name=name,
        inputs=inputs,
        outputs=outputs,
        params=tuple(param_places.items()),
        compute_s=t.fwd + t.bwd,
        comm_s=comm,
        grad_sync_s=sync,
        param_elems=elems,
        saved_bytes=saved,
        fwd_collectives=tuple(fwd_names),
        compute_shards=shards,
        fwd_events=tuple(fwd_ev),
        bwd_events=tuple(bwd_ev),
        step_events=tuple(step_ev),
    )


def node_strategies(
    node: OpNode,
    mesh: LogicalMesh,
    cm: CostModel,
    zero: int = 3,
    grad_share: dict[int, float] | None = None,
    executable_only: bool = False,
) -> list[Strategy]:
    """All valid strategies of `node` on `mesh`; the all-replicated one comes first.
    `grad_share[i]`: this node's share of the all-reduce of input i's partial gradient:
    1 / (consumers of that tensor), or 0 when the tensor needs no gradient (graph inputs)."""
    per_axis = []
    for a, size in enumerate(mesh.shape):
        options = axis_choices(node, size)
        if executable_only and mesh.axis_names[a] == "tp":
            options = [c for c in options if executable(node.kind, c.name, node.module_type)]
        if zero == 3 and mesh.axis_names[a] == "dp":
            options += [z for c in options if (z := with_zero(c, node, size)) is not None]
        per_axis.append(options)
    out: list[Strategy] = []
    seen: set[tuple] = set()
    for combo in itertools.product(*per_axis):
        strategy = _combine(node, combo, mesh, cm, grad_share or {})
        if strategy is None:
            continue
        key = (strategy.inputs, strategy.outputs, strategy.params)
        if key in seen:
            continue  # e.g. replicate on a size-1 axis: same placements, same cost
        seen.add(key)
        out.append(strategy)
    return out


def renamed(strategies: list[Strategy], first: OpNode, node: OpNode) -> list[Strategy]:
    """`first`'s strategies for an identical node: the same placements and costs, its own
    parameter names (in the same order)."""
    names = dict(zip(first.params, node.params, strict=True))
    return [
        replace(s, params=tuple((names[p], place) for p, place in s.params)) for s in strategies
    ]


def reshard_cost(
    cm: CostModel,
    nbytes: float,
    src: Placements,
    dst: Placements,
    mesh: LogicalMesh,
    backward: bool = True,
) -> float:
    """Forward conversion src -> dst, and the gradient's way back (dst -> src, where the
    gradient of a partial-sum output is replicated)."""
    fwd = cm.reshard(nbytes, list(src), list(dst), mesh)
    if not backward:
        return fwd
    grad_src = ["R" if p == "P" else p for p in src]
    grad_dst = ["R" if p == "P" else p for p in dst]
    return fwd + cm.reshard(nbytes, grad_dst, grad_src, mesh)
