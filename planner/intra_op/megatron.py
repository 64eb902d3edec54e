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
A router (a narrow projection, out_features < in_features / 4, whose output goes straight into a
softmax or sigmoid: an MoE gate) stays replicated; other narrow projections (grouped-query
attention's k and v at large hidden sizes) are column-parallel like any other.

Experts (transformers' experts modules) are split over tp by their features, as Megatron-Core
splits them (planner.intra_op.expert_layout).

With sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4.2.2), the tensors between tp regions ([batch, seq,
hidden]: the residual stream, norms, dropout) are sharded on the sequence (dim 1): the token
embedding and row-parallel linears reduce-scatter their partial output (all-gather of its
gradient in backward) instead of all-reducing it; the first column-parallel consumer of a
sequence-sharded tensor all-gathers it once (its consumers' partial input gradients are
summed and reduce-scattered once in backward); norms run on their sequence shard (their
weights' gradients are all-reduced once per step). Same bytes on the wire as all-reduce,
and the norms' and element-wise ops' compute and saved tensors divided by tp.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from planner.graph.opgraph import OpGraph, OpNode, TensorMeta
from planner.intra_op.dims import moved_dim
from planner.intra_op.expert_layout import (
    expert_tensor_parallel,
    moe_blocks,
    token_shard_layout,
)
from planner.intra_op.layout_map import LayoutMap
from planner.intra_op.node_layout import NodeLayout
from planner.intra_op.sharding_rules import reduction_choices
from planner.placements import REPLICATE, shard, shard_dim

SEQ_DIM = 1  # the sequence dim of [batch, seq, hidden] activations


def seq_shardable(meta: TensorMeta, tp: int) -> bool:
    """Whether sequence parallelism can shard this tensor: [batch, seq, hidden], seq % tp."""
    return len(meta.shape) == 3 and meta.shape[SEQ_DIM] % tp == 0


def _partial_output(node: OpNode, tp: int, lay: NodeLayout, sp: bool) -> str:
    """A row-parallel (or vocab-parallel) output's partial sums: reduce-scattered onto the
    sequence with sequence parallelism, all-reduced without."""
    out = node.outputs[0]
    if sp and seq_shardable(out, tp):
        lay.fwd_comm.append(("reduce_scatter", out.nbytes))
        lay.bwd_comm.append(("all_gather", out.nbytes))
        return shard(SEQ_DIM)
    lay.fwd_comm.append(("all_reduce", out.nbytes))
    return REPLICATE


def _column_input(node: OpNode, x: str, tp: int, lay: NodeLayout) -> None:
    """A column-parallel node's input comm: its input gradient is partial (all-reduced), or,
    for a sequence-sharded input, gathered in forward and reduce-scattered in backward."""
    meta = node.inputs[0]
    if shard_dim(x) == SEQ_DIM:
        lay.inputs[0] = REPLICATE
        lay.fwd_comm.append(("all_gather", meta.nbytes))
        lay.bwd_comm.append(("reduce_scatter", meta.nbytes))
    else:
        lay.bwd_comm.append(("all_reduce", meta.nbytes))


def _linear_like(
    node: OpNode, x: str, tp: int, lay: NodeLayout, sp: bool, router: bool = False
) -> str:
    """linear/conv2d: column-parallel on a replicated (or, with sequence parallelism,
    sequence-sharded) input, row-parallel on one sharded on the contracted dim."""
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
        for name, meta in node.params.items():
            lay.params[name] = shard(1) if len(meta.shape) > 1 else REPLICATE
        return _partial_output(node, tp, lay, sp)
    columnable = out_features % tp == 0 and not (router and out_features * 4 < in_features)
    seq_input = sp and shard_dim(x) == SEQ_DIM and seq_shardable(node.inputs[0], tp)
    if shard_dim(x) is not None and not (columnable and seq_input):
        x = _gather_input(node, 0, tp, lay)
    if not columnable:
        lay.params = {name: REPLICATE for name in node.params}
        return REPLICATE
    lay.strategy = column
    lay.compute_shards = tp
    _column_input(node, x, tp, lay)
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


def _embedding(node: OpNode, edges: list, tp: int, lay: NodeLayout, sp: bool, input_nodes) -> str:
    """The token embedding is vocab-parallel; other tables (GPT's positions) replicated."""
    from_tokens = any(e.src in input_nodes for e in edges)
    weight = next(iter(node.params.values()), None)
    if from_tokens and weight is not None and weight.shape[0] % tp == 0:
        lay.strategy = "vocab"
        lay.params = {name: shard(0) for name in node.params}
        return _partial_output(node, tp, lay, sp)
    if sp and not from_tokens and node.params:
        # a position table, cut to each rank's part of the sequence: its gradient's parts
        # are gathered in backward (the table is replicated)
        lay.bwd_comm.append(("all_gather", node.outputs[0].nbytes))
    return REPLICATE


def _sequence_norm(node: OpNode, tp: int, lay: NodeLayout) -> str:
    """A norm over the hidden dim on its sequence shard: its weights stay replicated and
    their gradients, partial sums over the sequence shards, are all-reduced once per step
    (DTensor keeps them Partial until the optimizer reads them)."""
    lay.strategy = f"dim{SEQ_DIM}"  # the rules' follower name
    lay.compute_shards = lay.saved_shards = tp
    for meta in node.params.values():  # one per parameter, as DTensor reduces them
        lay.step_comm.append(("all_reduce", meta.nbytes))
    return shard(SEQ_DIM)


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


def _reduce(node: OpNode, states: list[str], tp: int, lay: NodeLayout) -> str:
    """A reduction keeps a shard on a dim it does not reduce (a decomposed RMSNorm's mean
    over the hidden dim of a sequence shard, as transformers' norms compute it). A sum or
    mean over the sharded dim reduces each rank's part and all-reduces the (small) result,
    as DTensor runs it (OLMo 2's q/k norms over a tp-split projection), the input's gradient
    reduce-scattered in backward; other reductions of the sharded dim gather first."""
    d = shard_dim(states[0]) if len(states) == 1 and len(node.outputs) == 1 else None
    kept = next(
        (c for c in reduction_choices(node, tp) if d is not None and c.name == f"dim{d}"), None
    )
    if kept is not None and all(shard_dim(out) is not None for out in kept.outputs):
        lay.strategy = f"dim{d}"
        lay.compute_shards = lay.saved_shards = tp
        return kept.outputs[0]
    base = node.op.split(".")[1] if node.op.count(".") >= 2 else node.op
    if d is not None and base in ("sum", "mean"):  # kept: sum's partial; none for a mean
        lay.strategy = f"dim{d}"
        lay.compute_shards = lay.saved_shards = tp
        lay.fwd_comm.append(("all_reduce", node.outputs[0].nbytes))
        # backward: the replicated result's gradient comes back partial, so the input's
        # is a partial sum of its whole shape, reduce-scattered onto the shards
        lay.bwd_comm.append(("reduce_scatter", node.inputs[0].nbytes))
        return REPLICATE
    return _gather_all(node, states, tp, lay)


def _stack(node: OpNode, states: list[str], tp: int, lay: NodeLayout) -> str:
    """Tensors sharded alike, stacked on a new dim (an interleaved rotary embedding's halves,
    Cohere's and ERNIE's): the shard stays on its dim, one further on when the new dim
    comes before it."""
    dims = {shard_dim(s) for s in states}
    if len(dims) != 1 or None in dims or not node.outputs:
        return _gather_all(node, states, tp, lay)
    d = dims.pop()
    assert d is not None
    args = node.attrs.get("args", [])
    at = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
    at %= len(node.outputs[0].shape)
    lay.strategy = f"dim{d}"
    lay.compute_shards = lay.saved_shards = tp
    return shard(d if at > d else d + 1)


class _BroadcastWeights:
    """Parameters whose gradients are partial sums over tp shards without a linear's layout
    saying so: an element-wise op broadcasts a weight (or a tensor computed from weights
    only, as Gemma's 1 + weight) over its output's sharded dim: a decomposed norm's weight
    on a sequence shard (transformers' RMSNorm under sequence parallelism), Qwen3's and
    Gemma 3's q/k norm weights on each rank's heads. Each is all-reduced once per step, as
    DTensor reduces a replicated parameter's gradient."""

    def __init__(self) -> None:
        self.lineage: dict[tuple[str, int], dict[str, TensorMeta]] = {}
        self.reduced: set[str] = set()

    def note(self, node: OpNode, edges: list) -> None:
        """Record the node's output as computed from weights only, where it is."""
        if node.kind not in ("elementwise", "reshape") or not (node.params or edges):
            return
        if all((e.src, e.src_output) in self.lineage for e in edges):
            weights = dict(node.params)
            for e in edges:
                weights.update(self.lineage[(e.src, e.src_output)])
            self.lineage[(node.name, 0)] = weights

    def reduce(self, node: OpNode, edges: list, out: str, lay: NodeLayout) -> None:
        d = shard_dim(out)
        if d is None or not node.outputs or (node.name, 0) in self.lineage:
            return
        rank = len(node.outputs[0].shape)
        operands = [(meta.shape, {name: meta}) for name, meta in node.params.items()]
        operands += [(e.shape, self.lineage.get((e.src, e.src_output), {})) for e in edges]
        for shape, weights in operands:
            offset = rank - len(shape)  # broadcasting aligns shapes from the last dim
            if d >= offset and shape[d - offset] != 1:
                # spanning the shard: each rank uses its slice, and the slice's gradient
                # is gathered back into the replicated weight's (OLMo 2's q/k norms)
                for meta in weights.values():
                    lay.bwd_comm.append(("all_gather", meta.nbytes))
                continue
            for name, meta in weights.items():
                if name not in self.reduced:
                    self.reduced.add(name)
                    lay.step_comm.append(("all_reduce", meta.nbytes))


def tensor_parallel_layout(
    graph: OpGraph,
    tp: int,
    copy_layers: bool = True,
    sequence_parallel: bool = False,
    fold_experts: bool = False,
) -> LayoutMap:
    """Megatron's layout of every node (with sequence parallelism when asked), propagated in
    graph order. A layer identical to an earlier one (same group) that receives the same
    placements from outside it gets that layer's layouts (a LayoutMap copy) instead of
    being propagated again: exact, since a node's layout depends on nothing else.
    `fold_experts` (with sequence parallelism): MoE blocks on their tp rank's sequence shard,
    experts whole (expert tp 1: planner.intra_op.expert_layout.token_shard_layout)."""
    own: dict[str, NodeLayout] = {}
    state: dict[tuple[str, int], str] = {}
    in_edges: dict[str, list] = {}
    for e in graph.edges:
        in_edges.setdefault(e.dst, []).append(e)
    input_nodes = {n.name for n in graph.nodes if n.kind == "input"}
    # tensors whose input gradient a column-parallel module already reduces, with the
    # modules that do (module path of the linears' parent: the executor turns each such
    # module's input into one DTensor, so two modules reading one tensor reduce it twice)
    bwd_reduced: dict[tuple[str, int], set[str]] = defaultdict(set)
    column_nodes: set[str] = set()  # column-parallel nodes (their input's gradient reduced)
    members = graph.layer_nodes
    contiguous = _contiguous_layers(graph) if copy_layers else set()
    sp = sequence_parallel and tp > 1
    routers = _routers(graph)
    latent = _latent_attention_linears(graph)
    # under sequence parallelism, modules run whole on every tp rank (MoE blocks, latent
    # attention): (tensor, block) -> the node where the block gathers that tensor
    blocks = whole_blocks(graph.nodes) if sp else frozenset()
    folded = moe_blocks(graph.nodes) if sp and fold_experts else frozenset()
    blocks -= folded
    entries: dict[tuple[tuple[str, int], str], tuple[str, int]] = {}
    by_name = graph.by_name
    broadcast = _BroadcastWeights()
    source: dict[int, int] = {}
    seen: dict[tuple, int] = {}
    skip_to = 0
    for i, node in enumerate(graph.nodes):
        if i < skip_to:
            continue
        layer = node.layer
        if layer is not None and layer in contiguous and layer not in source:
            key = _arrival_key(graph, members[layer], in_edges, state, input_nodes)
            first = seen.setdefault(key, layer)
            source[layer] = first
            if first != layer:  # copy: replay its effects on the propagation's state
                for mine, theirs in zip(members[layer], members[first], strict=True):
                    lay = own[theirs.name]
                    for k, out in enumerate(lay.outputs):
                        state[(mine.name, k)] = out
                    if theirs.name in column_nodes:
                        edge = min(in_edges[mine.name], key=lambda e: e.dst_input)
                        bwd_reduced[(edge.src, edge.src_output)].add(_parent(mine))
                skip_to = i + len(members[layer])
                continue
        edges = sorted(in_edges.get(node.name, []), key=lambda e: e.dst_input)
        states = [state.get((e.src, e.src_output), REPLICATE) for e in edges]
        if _block_of(node, folded) is not None:  # on this rank's tokens, as they come
            lay = token_shard_layout(node, states, tp, SEQ_DIM)
            for k in range(len(node.outputs)):
                state[(node.name, k)] = lay.outputs[k]
            own[node.name] = lay
            continue
        block = _block_of(node, blocks)
        entering = []
        if block is not None:  # a sequence shard entering a whole block: gathered once
            for j, e in enumerate(edges):
                if shard_dim(states[j]) == SEQ_DIM and _block_of(by_name[e.src], blocks) != block:
                    states[j] = REPLICATE
                    if ((e.src, e.src_output), block) not in entries:
                        nbytes = node.inputs[e.dst_input].nbytes
                        entries[((e.src, e.src_output), block)] = (node.name, nbytes)
                        entering.append(nbytes)
        node_sp = sp and block is None  # inside a whole block, tensors are whole
        lay = _node_layout(
            *(node, edges, states, tp, input_nodes, bwd_reduced, column_nodes, node_sp),
            *(routers, latent),
        )
        for nbytes in entering:
            lay.fwd_comm.append(("all_gather", nbytes))
            lay.bwd_comm.append(("reduce_scatter", nbytes))
        if tp > 1 and node.kind == "elementwise":
            broadcast.reduce(node, edges, lay.outputs[0], lay)
        broadcast.note(node, edges)
        for k in range(len(node.outputs)):
            state[(node.name, k)] = lay.outputs[k]
        own[node.name] = lay
    for layer in members:
        source.setdefault(layer, layer)
    if blocks:
        _whole_gradients(graph, own, blocks, entries)
    if tp > 1:
        expert_tensor_parallel(graph, own, tp)
    return LayoutMap(graph, own, source)


# The latent projection of multi-head latent attention (transformers' DeepSeek-V2/V3): the
# module holding a linear of this name is latent attention
LATENT_PROJECTION = "kv_a_proj_with_mqa"


def whole_blocks(nodes: Iterable) -> frozenset[str]:
    """Modules run whole on every tp rank under sequence parallelism, from nodes with a
    `kind` and a `module` path (the graph's, or a plan's shardings: the executor reads them
    so): transformers' mixture-of-experts blocks (the modules holding the experts' grouped
    matmuls, which Megatron's layout replicates) and multi-head latent attention
    (_latent_modules). The executor gathers each one's input once and cuts its output back
    to the sequence shard (executor.tensor_parallel.ReplicatedBlock)."""
    nodes = list(nodes)
    return moe_blocks(nodes) | _latent_modules(nodes)


def _latent_modules(nodes: Iterable) -> set[str]:
    """Multi-head latent attention modules: those holding a LATENT_PROJECTION linear."""
    return {
        n.module.rpartition(".")[0]
        for n in nodes
        if n.kind == "linear" and n.module and n.module.endswith("." + LATENT_PROJECTION)
    }


def _block_of(node: OpNode, blocks: frozenset[str]) -> str | None:
    if not blocks or not node.module:
        return None
    return next((b for b in blocks if node.module == b or node.module.startswith(b + ".")), None)


def _whole_gradients(graph: OpGraph, own: dict, blocks, entries: dict) -> None:
    """A whole block's gradients are whole, the same on every rank, where all its outputs
    are cut back to the sequence shard by element-wise ops outside it (the residual adds):
    each cut's backward all-gathers the output's gradient, and the entry gather's backward
    is a slice, not a reduce-scatter of partial sums (column-parallel linears inside it
    all-reduce their input's gradient, whole too). A block with another exit keeps the
    reduce-scatter."""
    by_name = graph.by_name
    exits: dict[str, set[tuple[str, int]]] = defaultdict(set)
    other: set[str] = set()
    for e in graph.edges:
        src, dst = by_name[e.src], by_name[e.dst]
        block = _block_of(src, blocks)
        if block is None or _block_of(dst, blocks) == block or e.dst not in own:
            continue
        lay = own[e.dst]
        out = lay.outputs[0] if lay.outputs else REPLICATE
        cut = (
            dst.kind == "elementwise"
            and shard_dim(out) == SEQ_DIM
            and len(dst.outputs[0].shape) == 3
            and lay.inputs[e.dst_input] == REPLICATE
        )
        if cut:
            exits[block].add((e.dst, e.dst_input))
        else:
            other.add(block)
    for (_tensor, block), (name, nbytes) in entries.items():
        if block not in other and exits[block]:
            own[name].bwd_comm.remove(("reduce_scatter", nbytes))
    done: set[tuple[str, int]] = set()
    for block, cuts in exits.items():
        if block in other:
            continue
        for cut in cuts - done:
            name, i = cut
            own[name].bwd_comm.append(("all_gather", by_name[name].inputs[i].nbytes))
        done |= cuts


ROUTER_CONSUMERS = frozenset({"softmax", "sigmoid", "topk"})
# Ops a router's logits may pass through on the way to its softmax (HF Mixtral casts them).
_PASS_THROUGH = ("aten.to.", "aten._to_copy", "aten.view", "aten.reshape", "aten.flatten")


def _routers(graph: OpGraph) -> frozenset[str]:
    """Linear nodes whose output feeds a softmax, sigmoid or top-k (MoE gates), directly or
    through casts and reshapes."""
    by_name = graph.by_name
    consumers: dict[str, list[str]] = {}
    for e in graph.edges:
        consumers.setdefault(e.src, []).append(e.dst)

    def routes(name: str, hops: int) -> bool:
        for dst in consumers.get(name, []):
            node = by_name[dst]
            if node.kind in ROUTER_CONSUMERS or any(w in node.op for w in ROUTER_CONSUMERS):
                return True
            if hops and node.op.startswith(_PASS_THROUGH) and routes(dst, hops - 1):
                return True
        return False

    return frozenset(n.name for n in graph.nodes if n.kind == "linear" and routes(n.name, 3))


def _latent_attention_linears(graph: OpGraph) -> frozenset[str]:
    """The linears of multi-head latent attention modules (DeepSeek's: a kv_a_proj_with_mqa
    beside the q, kv and output projections), kept whole on every tp rank: the latent
    projection's output is split by features (the latent and the shared rotary key), and
    that key, broadcast to every head, would collect a partial gradient from each rank's
    heads; the attention runs replicated, its gradients whole."""
    modules = _latent_modules(graph.nodes)
    return frozenset(
        n.name
        for n in graph.nodes
        if n.kind == "linear" and n.module and n.module.rpartition(".")[0] in modules
    )


def _contiguous_layers(graph: OpGraph) -> set[int]:
    """Layers whose nodes are consecutive in graph order (only those are copied whole)."""
    spans: dict[int, list[int]] = {}
    for i, n in enumerate(graph.nodes):
        if n.layer is not None:
            spans.setdefault(n.layer, []).append(i)
    return {layer for layer, idx in spans.items() if idx[-1] - idx[0] + 1 == len(idx)}


def _parent(node: OpNode) -> str:
    """The module holding a linear (attention, MLP): where the executor gathers its input."""
    return node.module.rpartition(".")[0]


def _arrival_key(graph, nodes, in_edges, state, input_nodes) -> tuple:
    """What a layer's layouts depend on besides its own nodes: its group and, by position,
    the placements of tensors arriving from outside it and whether each comes straight from
    the model's inputs (which modules reduced an arriving tensor's gradient before does
    not matter: each of this layer's modules reduces its own input)."""
    index = {n.name: i for i, n in enumerate(nodes)}
    arriving = []
    for n in nodes:
        for e in in_edges.get(n.name, []):
            if e.src not in index:
                key = (e.src, e.src_output)
                arriving.append(
                    (
                        index[n.name],
                        e.dst_input,
                        state.get(key, REPLICATE),
                        e.src in input_nodes,
                    )
                )
    return graph.layer_groups[nodes[0].layer], tuple(sorted(arriving))


def _node_layout(
    node: OpNode,
    edges: list,
    states: list[str],
    tp: int,
    input_nodes,
    bwd_reduced,
    column_nodes,
    sp: bool = False,
    routers: frozenset[str] = frozenset(),
    latent: frozenset[str] = frozenset(),
) -> NodeLayout:
    """One node's Megatron layout given the placements of its inputs."""
    lay = NodeLayout(inputs=list(states))
    lay.params = {name: REPLICATE for name in node.params}
    if tp == 1 or node.kind in ("input", "constant"):
        out = REPLICATE
    elif node.kind == "embedding":
        out = _embedding(node, edges, tp, lay, sp, input_nodes)
    elif node.kind == "linear" and node.name in latent:
        out = _gather_all(node, states, tp, lay)
    elif node.kind in ("linear", "conv2d") and states:
        out = _linear_like(node, states[0], tp, lay, sp, node.name in routers)
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
        elif sp and d == SEQ_DIM and not channel_norm:
            out = _sequence_norm(node, tp, lay)
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
    elif node.kind == "reduction":
        out = _reduce(node, states, tp, lay)
    elif node.op.startswith("aten.stack."):
        out = _stack(node, states, tp, lay)
    elif node.kind in ("elementwise", "reshape", "concat", "pool", "softmax"):
        out = _follow(node, states, tp, lay)
    else:
        out = _gather_all(node, states, tp, lay)
    # column-parallel: its input gradient is partial (all-reduced, or with sequence
    # parallelism reduce-scattered after the input was all-gathered)
    column = any(name == "all_reduce" for name, _ in lay.bwd_comm) or (
        sp
        and node.inputs
        and lay.compute_shards > 1
        and ("all_gather", node.inputs[0].nbytes) in lay.fwd_comm
    )
    if column and edges:
        # Column-parallel consumers of one tensor in one module (q, k, v) sum their input
        # gradients locally; the backward all-reduce (or the gather and its reduce-scatter)
        # happens once per tensor and module (a parallel block's attention and MLP, reading
        # one norm's output, reduce it once each, as the executor runs them).
        key = (edges[0].src, edges[0].src_output)
        if _parent(node) in bwd_reduced.get(key, ()):
            lay.bwd_comm = [c for c in lay.bwd_comm if c[0] not in ("all_reduce", "reduce_scatter")]
            lay.fwd_comm = [c for c in lay.fwd_comm if c[0] != "all_gather"]
        bwd_reduced[key].add(_parent(node))
        column_nodes.add(node.name)
    lay.outputs = [out] + [REPLICATE] * (len(node.outputs) - 1)
    return lay
