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

import re
from dataclasses import dataclass, field

from planner.graph import OpGraph, OpNode, TensorMeta

REPLICATE = "R"
_SHARD = re.compile(r"^S\((\d+)\)$")


def shard(d: int) -> str:
    return f"S({d})"


def shard_dim(state: str) -> int | None:
    m = _SHARD.match(state)
    return int(m.group(1)) if m else None


@dataclass
class NodeLayout:
    strategy: str = "replicated"
    compute_shards: int = 1
    saved_shards: int = 1
    # (collective, bytes) on the tp axis, per micro-batch
    fwd_comm: list[tuple[str, int]] = field(default_factory=list)
    bwd_comm: list[tuple[str, int]] = field(default_factory=list)
    # (collective, bytes) on the tp axis once per step (gradients of tp-replicated parameters
    # when the data is split on tp)
    step_comm: list[tuple[str, int]] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)  # tp placement per parameter
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


def map_reshape(src: list[int], dst: list[int], d: int, tp: int) -> int | None:
    """Where dim d of `src` lands in `dst` when only the shape changes (view/reshape/flatten):
    the dst dim that starts at the same element offset and can still be split tp ways."""
    prefix = 1
    for s in src[:d]:
        prefix *= s
    acc = 1
    for j, s in enumerate(dst):
        if acc == prefix and s % tp == 0 and s > 1:
            return j
        acc *= s
        if acc > prefix:
            break
    return None


def _linear_like(node: OpNode, x: str, tp: int, lay: NodeLayout) -> str:
    """linear/conv2d: column-parallel on a replicated input, row-parallel on a sharded one."""
    weight_name = next(iter(node.params), None)
    weight = node.params.get(weight_name) if weight_name else None
    out = node.outputs[0]
    out_dim = len(out.shape) - 1 if node.kind == "linear" else 1
    in_dim = len(node.inputs[0].shape) - 1 if node.kind == "linear" else 1
    if weight is None:
        return _gather_all(node, [x], tp, lay)
    out_features, in_features = weight.shape[0], weight.shape[1]
    if shard_dim(x) == in_dim and in_features % tp == 0:
        lay.strategy = "row_parallel"
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
    lay.strategy = "column_parallel"
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
        lay.strategy = "row_parallel"
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
    lay.strategy = "column_parallel"
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


def _int_args(node: OpNode) -> list[int]:
    return [a for a in node.attrs.get("args", []) if isinstance(a, int) and not isinstance(a, bool)]


def _op_dim(node: OpNode, ndim: int) -> int | None:
    """The `dim` argument of ops like cat/slice/chunk/softmax, normalised to >= 0."""
    dim = node.attrs.get("dim")
    if dim is None:
        ints = _int_args(node)
        base = node.op.split(".")[1] if node.op.count(".") >= 2 else node.op
        if base in ("cat",) and ints:
            dim = ints[0]
        elif (
            base
            in (
                "slice",
                "select",
                "narrow",
                "softmax",
                "_softmax",
                "log_softmax",
                "chunk",
                "split",
                "split_with_sizes",
                "cumsum",
                "repeat_interleave",
            )
            and ints
        ):
            dim = (
                ints[1]
                if base in ("chunk", "split", "split_with_sizes") and len(ints) > 1
                else ints[0]
            )
            if base == "repeat_interleave":
                dim = node.attrs.get("dim", ints[-1] if len(ints) > 1 else None)
    if isinstance(dim, int):
        return dim % ndim if ndim else 0
    return None


def _moved_dim(node: OpNode, d: int, src_shape: list[int], out_shape: list[int], tp: int):
    """Where sharded dim d of the input goes through this op, or None if it cannot stay."""
    base = node.op.split(".")[1] if node.op.count(".") >= 2 else node.op
    ints = _int_args(node)
    ndim = len(src_shape)
    if base == "transpose" and len(ints) >= 2:
        a, b = ints[0] % ndim, ints[1] % ndim
        return b if d == a else a if d == b else d
    if base == "t":
        return 1 - d if ndim == 2 else d
    if base == "permute":
        dims = node.attrs["args"][1] if len(node.attrs.get("args", [])) > 1 else []
        dims = [x % ndim for x in dims] if isinstance(dims, list) else []
        return dims.index(d) if d in dims else None
    op_dim = _op_dim(node, ndim)
    if (
        base
        in (
            "softmax",
            "_softmax",
            "log_softmax",
            "cumsum",
            "cat",
            "slice",
            "narrow",
            "chunk",
            "split",
            "split_with_sizes",
        )
        or node.kind == "concat"
    ):
        if op_dim == d:
            return None
        return d if len(out_shape) == ndim else None
    if base == "select":
        if op_dim == d:
            return None
        return d - 1 if op_dim is not None and op_dim < d else d
    if len(out_shape) == ndim and out_shape[d] % tp == 0:
        return d  # element-wise, expand, repeat_interleave over the (local) head dim
    return map_reshape(src_shape, out_shape, d, tp)


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
    target = _moved_dim(node, d, src_shape, out_shape, tp)
    if target is None:
        return _gather_all(node, states, tp, lay)
    lay.strategy = "sharded"
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
                lay.strategy = "vocab_parallel"
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
                lay.strategy = "head_parallel"
                lay.compute_shards = lay.saved_shards = tp
                out = shard(1)
            else:
                out = _gather_all(node, states, tp, lay)
        elif node.kind == "norm":
            d = shard_dim(states[0]) if states else None
            channel_norm = "batch_norm" in node.op
            if d is not None and channel_norm and d == 1:
                lay.strategy = "sharded"
                lay.compute_shards = lay.saved_shards = tp
                lay.params = {name: shard(0) for name in node.params}
                out = shard(1)
            else:
                out = _gather_all(node, states, tp, lay)
        elif node.kind == "loss":
            d = shard_dim(states[0]) if states else None
            if d is not None and d == len(node.inputs[0].shape) - 1 and "cross_entropy" in node.op:
                lay.strategy = "vocab_parallel_loss"
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
        if lay.strategy == "column_parallel" and edges:
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
