"""Megatron-style tensor parallelism over an OpGraph (Shoeybi et al. 2019; Narayanan et al.
2021), used to evaluate hand-written dp x tp x pp configurations and as the baseline layout.

Walking the graph in order, each tensor is either replicated ("R") or sharded on one dim
("S(d)") across the tp axis:
- a linear (or conv, or expert einsum) whose input is replicated becomes column-parallel
  (weight sharded on its output features, output sharded on the last/channel dim; the input
  gradient needs an all-reduce in backward);
- one whose input is sharded on the contracted dim becomes row-parallel (weight sharded on its
  input features; the partial output is all-reduced in forward);
- the token embedding is vocab-parallel (all-reduce in forward), the loss on vocab-sharded
  logits is vocab-parallel (three all-reduces of one float per token);
- attention on head-sharded q/k/v is head-parallel; element-wise ops, reshapes and
  batch-norm follow their input; LayerNorm/RMSNorm need the normalised dim whole;
- anything that cannot follow a sharded input gathers it first (all-gather in forward,
  reduce-scatter in backward) and runs replicated.
Narrow projections (out_features < in_features / 4, e.g. an MoE router) stay replicated.
"""

from __future__ import annotations

from planner.graph.opgraph import OpGraph, OpNode, TensorMeta
from planner.intra_op.dims import moved_dim
from planner.intra_op.node_layout import NodeLayout
from planner.placements import REPLICATE, shard, shard_dim


def _linear_like(node: OpNode, x: str, tp: int, lay: NodeLayout) -> str:
    """linear/conv2d: column-parallel on a replicated input, row-parallel on a sharded one."""
    weight_name = next(iter(node.params), None)
    weight = node.params.get(weight_name) if weight_name else None
    out = node.outputs[0]
    out_dim = len(out.shape) - 1 if node.kind == "linear" else 1
    in_dim = len(node.inputs[0].shape) - 1 if node.kind == "linear" else 1
    if weight is None or (node.kind == "linear" and "linear" not in node.op):
        # No (out, in) weight to split: e.g. GPT-2's Conv1D (addmm with an (in, out) weight
        # and a fused q/k/v output that a column split would cut across q, k and v).
        return _gather_all(node, [x], tp, lay)
    out_features, in_features = weight.shape[0], weight.shape[1]
    column, row = ("col", "row") if node.kind == "linear" else ("out_channels", "in_channels")
    if shard_dim(x) == in_dim and in_features % tp == 0:
        lay.strategy = row
        lay.compute_shards = lay.saved_shards = tp
        lay.fwd_comm.append(("all_reduce", out.nbytes))
        for name, meta in node.params.items():
            lay.params[name] = shard(1) if len(meta.shape) > 1 else REPLICATE
        return REPLICATE
    if shard_dim(x) is not None:
        x = _gather_input(node, 0, tp, lay)
    if out_features % tp or out_features * 4 < in_features:
        lay.params = {name: REPLICATE for name in node.params}
        return REPLICATE
    lay.strategy = column
    lay.compute_shards = tp
    lay.bwd_comm.append(("all_reduce", node.inputs[0].nbytes))
    for name in node.params:
        lay.params[name] = shard(0)
    return shard(out_dim)


def _einsum(node: OpNode, states: list[str], tp: int, lay: NodeLayout) -> str:
    eq = str(node.attrs.get("equation", ""))
    if "->" not in eq or not node.params or len(node.inputs) != 1:
        return _gather_all(node, states, tp, lay)
    lhs, out_letters = eq.split("->")
    operands = lhs.split(",")
    param_name = next(iter(node.params))
    param_meta = node.params[param_name]
    # The activation is the operand whose shape matches the input; the other is the param.
    act_idx = (
        0 if len(operands[0]) == len(node.inputs[0].shape) and operands[0] != operands[1] else 1
    )
    act, par = operands[act_idx], operands[1 - act_idx]
    if len(par) != len(param_meta.shape):
        act, par = par, act
    x = states[0]
    d = shard_dim(x)
    if d is not None and act[d] in par and act[d] not in out_letters:
        lay.strategy = f"split_{act[d]}"  # the contracted letter (the rules' name)
        lay.compute_shards = lay.saved_shards = tp
        lay.params[param_name] = shard(par.index(act[d]))
        lay.fwd_comm.append(("all_reduce", node.outputs[0].nbytes))
        return REPLICATE
    if d is not None:
        x = _gather_input(node, 0, tp, lay)
    free = [c for c in par if c in out_letters and c not in act]
    if not free or param_meta.shape[par.index(free[0])] % tp:
        lay.params[param_name] = REPLICATE
        return REPLICATE
    lay.strategy = f"split_{free[0]}"  # the parameter's output letter
    lay.compute_shards = tp
    lay.params[param_name] = shard(par.index(free[0]))
    lay.bwd_comm.append(("all_reduce", node.inputs[0].nbytes))
    return shard(out_letters.index(free[0]))


def _gather_input(node: OpNode, i: int, tp: int, lay: NodeLayout) -> str:
    meta: TensorMeta = node.inputs[i]
    lay.fwd_comm.append(("all_gather", meta.nbytes))
    lay.bwd_comm.append(("reduce_scatter", meta.nbytes))
    lay.inputs[i] = REPLICATE
    return REPLICATE


def _gather_all(node: OpNode, states: list[str], tp: int, lay: NodeLayout) -> str:
    for i, s in enumerate(states):
        if shard_dim(s) is not None:
            _gather_input(node, i, tp, lay)
    lay.params = {name: REPLICATE for name in node.params}
    return REPLICATE


def _follow(node: OpNode, states: list[str], tp: int, lay: NodeLayout) -> str:
    """Element-wise/reshape-like ops: keep the sharded dim if every input agrees on it."""
    dims = {shard_dim(s) for s in states if shard_dim(s) is not None}
    if not dims:
        return REPLICATE
    src_idx = next(i for i, s in enumerate(states) if shard_dim(s) is not None)
    d = shard_dim(states[src_idx])
    assert d is not None
    src_shape = node.inputs[src_idx].shape
    out_shape = node.outputs[0].shape
    if len(dims) > 1:
        return _gather_all(node, states, tp, lay)
    target = moved_dim(node, d, src_shape, out_shape, tp)
    if target is None:
        return _gather_all(node, states, tp, lay)
    lay.strategy = f"dim{d}"  # the source input's sharded dim (the rules' follower name)
    lay.compute_shards = lay.saved_shards = tp
    return shard(target)


def tensor_parallel_layout(graph: OpGraph, tp: int) -> dict[str, NodeLayout]:
    layouts: dict[str, NodeLayout] = {}
    state: dict[tuple[str, int], str] = {}
    in_edges: dict[str, list] = {}
    for e in graph.edges:
        in_edges.setdefault(e.dst, []).append(e)
    input_nodes = {n.name for n in graph.nodes if n.kind == "input"}
    bwd_reduced: set[tuple[str, int]] = set()
    for node in graph.nodes:
        edges = sorted(in_edges.get(node.name, []), key=lambda e: e.dst_input)
        states = [state.get((e.src, e.src_output), REPLICATE) for e in edges]
        lay = NodeLayout(inputs=list(states))
        lay.params = {name: REPLICATE for name in node.params}
        if tp == 1 or node.kind in ("input", "constant"):
            out = REPLICATE
        elif node.kind == "embedding":
            from_tokens = any(e.src in input_nodes for e in edges)
            weight = next(iter(node.params.values()), None)
            if from_tokens and weight is not None and weight.shape[0] % tp == 0:
                lay.strategy = "vocab"
                lay.params = {name: shard(0) for name in node.params}
                lay.fwd_comm.append(("all_reduce", node.outputs[0].nbytes))
            out = REPLICATE
        elif node.kind in ("linear", "conv2d") and states:
            out = _linear_like(node, states[0], tp, lay)
        elif node.kind == "einsum":
            out = _einsum(node, states, tp, lay)
        elif node.kind == "attention":
            dims = {shard_dim(s) for s in states[:3]}
            if dims == {1}:
                lay.strategy = "heads"
                lay.compute_shards = lay.saved_shards = tp
                out = shard(1)
            else:
                out = _gather_all(node, states, tp, lay)
        elif node.kind == "norm":
            d = shard_dim(states[0]) if states else None
            channel_norm = "batch_norm" in node.op
            if d is not None and channel_norm and d == 1:
                lay.strategy = "dim1"
                lay.compute_shards = lay.saved_shards = tp
                lay.params = {name: shard(0) for name in node.params}
                out = shard(1)
            else:
                out = _gather_all(node, states, tp, lay)
        elif node.kind == "loss":
            d = shard_dim(states[0]) if states else None
            if d is not None and d == len(node.inputs[0].shape) - 1 and "cross_entropy" in node.op:
                lay.strategy = "vocab"
                lay.compute_shards = lay.saved_shards = tp
                rows = node.inputs[0].numel // node.inputs[0].shape[-1]
                lay.fwd_comm.extend([("all_reduce", rows * 4)] * 3)
                lay.inputs[1:] = [REPLICATE] * (len(states) - 1)
                out = REPLICATE
            else:
                out = _gather_all(node, states, tp, lay)
        elif node.kind in ("elementwise", "reshape", "concat", "pool", "softmax"):
            out = _follow(node, states, tp, lay)
        else:
            out = _gather_all(node, states, tp, lay)
        column = any(name == "all_reduce" for name, _ in lay.bwd_comm)  # column-parallel
        if column and edges:
            # Column-parallel consumers of one tensor (q, k, v) sum their input gradients
            # locally; the backward all-reduce happens once per tensor.
            key = (edges[0].src, edges[0].src_output)
            if key in bwd_reduced:
                lay.bwd_comm = [c for c in lay.bwd_comm if c[0] != "all_reduce"]
            bwd_reduced.add(key)
        lay.outputs = [out] + [REPLICATE] * (len(node.outputs) - 1)
        for i in range(len(node.outputs)):
            state[(node.name, i)] = lay.outputs[i]
        layouts[node.name] = lay
    return layouts
