"""Identical repeated blocks: which layers of a graph are copies of an earlier one, node for
node (same operators, shapes, FLOPs, bytes and parameter shapes), so that what depends only
on a node's own figures (its cost under a layout, its strategies) is worked out once per
group. Names, module paths and parameter names may differ; internal edges must match."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def node_signature(node: Any) -> tuple:
    """Everything about a node that its cost, strategies and memory depend on."""
    return (
        node.op,
        node.kind,
        node.module_type,
        tuple((tuple(t.shape), t.dtype) for t in node.inputs),
        tuple((tuple(t.shape), t.dtype) for t in node.outputs),
        tuple((tuple(m.shape), m.dtype, p in node.shared_params) for p, m in node.params.items()),
        repr(_without_names(node.attrs)),
        node.fwd_flops,
        node.bwd_flops,
        node.bytes_read,
        node.bytes_written,
        node.param_bytes,
        node.saved_bytes,
        node.saved_fixed_bytes,
        node.batch_invariant,
        node.is_view,
    )


def layer_signature(members: Sequence[Any], edges: Sequence[Any]) -> tuple:
    """A layer's nodes in order and its internal edges by position."""
    index = {n.name: i for i, n in enumerate(members)}
    internal = tuple(
        sorted(
            (index[e.src], e.src_output, index[e.dst], e.dst_input, _edge_bytes(e))
            for e in edges
            if e.src in index and e.dst in index
        )
    )
    return tuple(node_signature(n) for n in members), internal


def group_layers(by_layer: dict[int, list[Any]], edges_by_layer: dict[int, list[Any]]) -> dict:
    """layer -> the first layer with the same signature (itself when it is the first)."""
    first: dict[tuple, int] = {}
    out = {}
    for layer in sorted(by_layer):
        sig = layer_signature(by_layer[layer], edges_by_layer.get(layer, []))
        out[layer] = first.setdefault(sig, layer)
    return out


def _edge_bytes(edge: Any) -> int:
    """An OpEdge's bytes, or a sharding problem's EdgeRef's."""
    return edge.bytes if hasattr(edge, "bytes") else edge.nbytes


_NAMED = ("param", "buffer", "constant")  # operands named by the module's state


def _without_names(value: Any) -> Any:
    """Op arguments with references to other nodes and parameters (by name) left out: the
    positions of the operands are kept, their names are not part of what a node computes."""
    if isinstance(value, dict):
        if set(value) == {"node"}:
            return "<node>"
        return tuple(sorted((k, _without_names(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        if len(value) == 2 and value[0] in _NAMED and isinstance(value[1], str):
            return (value[0],)
        return tuple(_without_names(v) for v in value)
    return value
