"""From an exported, meta-interpreted program to an OpGraph: one OpNode per call, edges from
producers to consumers (getitem folded into edges), bytes saved for backward per node (each
tensor counted once, views resolved to their base), and whether a value depends on the batch.

`Exported` carries what export learned; `recorder` (planner.graph.tracing) what running the
graph on meta tensors recorded: per-node values, forward FLOPs and saved tensors.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils._pytree import tree_flatten

from planner.graph.op_kinds import ATTENTION_OPS, classify, op_name
from planner.graph.opgraph import OpEdge, OpGraph, OpGraphData, OpNode, TensorMeta

Root = tuple[str, int]  # (producing node, output index)


@dataclass(frozen=True)
class Exported:
    """What `trace` learned from export."""

    gm: torch.fx.GraphModule
    ep: ExportedProgram
    placeholder_param: dict[str, str]  # placeholder name -> canonical parameter name
    user_inputs: list[str]
    param_ids: set[int]
    example_inputs: tuple
    blocks: dict[str, int]  # block module path -> layer index
    strip: Callable[[str], str]
    # module path -> the torch class a subclass extends, where torch's parallel styles shard
    # it as that class (transformers' scaled word embeddings are nn.Embedding's)
    styled_as: dict[str, str] = field(default_factory=dict)


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tensors(value: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(value)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _returns_alias(target: Any) -> bool:
    """True for view ops (their schema marks the result as aliasing an input)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    return all(r.alias_info is not None for r in schema.returns)


def _jsonable(value: Any) -> Any:
    """Op arguments as JSON: tensors become their producer's name, the rest plain values."""
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _mutates_buffer(n: torch.fx.Node, buffer_names: set[str]) -> bool:
    first = n.args[0] if n.args else None
    return (
        op_name(n.target).endswith("_")
        and isinstance(first, torch.fx.Node)
        and first.name in buffer_names
    )


def _fx_args(n: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, torch.fx.Node)]


@dataclass
class _Origins:
    """Where each tensor came from: id -> (node, output index); views resolve to their base."""

    origin: dict[int, Root] = field(default_factory=dict)
    sizes: dict[Root, int] = field(default_factory=dict)

    def root_of(self, t: torch.Tensor) -> Root | None:
        for cand in (t, t._base):
            if cand is not None and id(cand) in self.origin:
                return self.origin[id(cand)]
        return None


def _origins(x: Exported, values: dict[str, Any]) -> _Origins:
    out = _Origins()
    for n in x.gm.graph.nodes:
        if n.op == "placeholder" and n.name in x.placeholder_param:
            continue
        if n.op not in ("placeholder", "call_function") or n.target is operator.getitem:
            continue
        for i, t in enumerate(tensors(values.get(n.name))):
            base = t._base if t._base is not None else t
            root = out.origin.get(id(base), (n.name, i))
            out.origin.setdefault(id(t), root)
            out.sizes.setdefault(root, nbytes(base))
    return out


def _batch_dependence(x: Exported) -> dict[str, bool]:
    """Which values flow from a user input: the rest (RoPE tables, say) stays the same size
    whatever the batch, which rescaling to another batch must know."""
    dep: dict[str, bool] = {}
    for n in x.gm.graph.nodes:
        if n.op == "placeholder":
            dep[n.name] = n.name in x.user_inputs
        else:
            dep[n.name] = any(dep.get(a.name, False) for a in _fx_args(n))
    return dep


def _saved_bytes(x: Exported, rec: Any, org: _Origins, batch_dep: dict[str, bool]):
    """(bytes saved for backward per node, of which batch-independent), each tensor once.
    Attention keeps q, k, v, its output and a float32 logsumexp (flash/memory-efficient)."""
    saved: dict[str, int] = {}
    fixed_by_node: dict[str, int] = {}
    counted_roots: set[Root] = set()
    counted_internal: set[int] = set()
    attention = {
        n.name
        for n in x.gm.graph.nodes
        if n.op == "call_function" and op_name(n.target) in ATTENTION_OPS
    }

    def is_param(t: torch.Tensor) -> bool:
        return id(t) in x.param_ids or (t._base is not None and id(t._base) in x.param_ids)

    # buffers and constants (a RoPE table of every position): a view of one saved for
    # backward holds no new memory, and the table is there once, not per micro-batch
    held_anyway = {
        n.name for n in x.gm.graph.nodes if n.op == "placeholder" and n.name not in x.user_inputs
    }
    for node_name, t in rec.saved:
        if node_name in attention or is_param(t):
            continue
        root = org.root_of(t)
        if root is not None and root[0] in held_anyway:
            continue
        if root is not None:
            if root in counted_roots:
                continue
            counted_roots.add(root)
            size = org.sizes[root]
            fixed = not batch_dep.get(root[0], True)
        else:
            base = t._base if t._base is not None else t
            if id(base) in counted_internal:
                continue
            counted_internal.add(id(base))
            size = nbytes(base)
            fixed = not batch_dep.get(node_name, True)
        saved[node_name] = saved.get(node_name, 0) + size
        if fixed:
            fixed_by_node[node_name] = fixed_by_node.get(node_name, 0) + size
    for n in x.gm.graph.nodes:
        if n.name not in attention:
            continue
        extra = 0
        for arg in n.args[:3]:
            root = org.root_of(rec.values[arg.name]) if isinstance(arg, torch.fx.Node) else None
            if root is not None and root not in counted_roots:
                counted_roots.add(root)
                extra += org.sizes[root]
        out = tensors(rec.values[n.name])[0]
        extra += nbytes(out) + out[..., 0].numel() * 4  # output + float32 logsumexp
        counted_roots.add(org.origin[id(out)])
        saved[n.name] = saved.get(n.name, 0) + extra
    return saved, fixed_by_node


@dataclass
class _Builder:
    """Accumulates nodes and edges in graph order."""

    x: Exported
    rec: Any
    source_of: dict[str, Root] = field(default_factory=dict)
    nodes: list[OpNode] = field(default_factory=list)
    edges: list[OpEdge] = field(default_factory=list)
    owned_params: set[str] = field(default_factory=set)

    def add_inputs(self) -> None:
        for pos, pname in enumerate(self.x.user_inputs):
            t = self.x.example_inputs[pos]
            self.nodes.append(
                OpNode(
                    name=pname,
                    op="input",
                    kind="input",
                    outputs=[tensor_meta(t)],
                    bytes_written=nbytes(t),
                )
            )
            self.source_of[pname] = (pname, 0)

    def operands(self, n: torch.fx.Node):
        """(params, tied params seen before, inputs, bytes read, operand list) of a call,
        adding an edge per activation input."""
        params: dict[str, TensorMeta] = {}
        shared: list[str] = []
        inputs: list[TensorMeta] = []
        read = 0
        operands: list[list[Any]] = []  # tensor arguments in call order
        for a in _fx_args(n):
            if a.name in self.x.placeholder_param:
                pname = self.x.placeholder_param[a.name]
                operands.append(["param", pname])
                t = self.rec.values[a.name]
                params[pname] = tensor_meta(t)
                read += nbytes(t)
                if pname in self.owned_params:
                    shared.append(pname)
                self.owned_params.add(pname)
                continue
            if a.name not in self.source_of:
                operands.append(["buffer", a.name])  # buffers and constants: not activations
                continue
            ts = tensors(self.rec.values[a.name])
            if not ts:
                continue
            operands.append(["input", len(inputs)])
            t = ts[0]
            src, idx = self.source_of[a.name]
            self.edges.append(
                OpEdge(
                    src=src,
                    dst=n.name,
                    src_output=idx,
                    dst_input=len(inputs),
                    shape=list(t.shape),
                    dtype=str(t.dtype).removeprefix("torch."),
                    bytes=nbytes(t),
                )
            )
            inputs.append(tensor_meta(t))
            read += nbytes(t)
        return params, shared, inputs, read, operands

    def where(self, n: torch.fx.Node) -> tuple[str, str, int | None]:
        """(module path, module type, layer index) of a call."""
        stack = n.meta.get("nn_module_stack") or {}
        paths = [(self.x.strip(p), getattr(t, "__name__", str(t))) for p, t in stack.values()]
        module_path, module_type = paths[-1] if paths else ("", "")
        module_type = self.x.styled_as.get(module_path, module_type)
        layer = next((self.x.blocks[p] for p, _ in reversed(paths) if p in self.x.blocks), None)
        return module_path, module_type, layer


def _op_node(b: _Builder, n, out_tensors, bwd_flops, saved, fixed, batch_dep) -> OpNode:
    module_path, module_type, layer = b.where(n)
    params, shared, inputs, read, operands = b.operands(n)
    is_view = _returns_alias(n.target)
    kind = classify(n.target, bool(params))
    attrs: dict[str, Any] = {"args": [_jsonable(a) for a in n.args], "operands": operands}
    attrs.update({k: _jsonable(v) for k, v in n.kwargs.items()})
    if kind == "einsum" and n.args and isinstance(n.args[0], str):
        attrs["equation"] = n.args[0]
    return OpNode(
        name=n.name,
        op=str(n.target),
        kind=kind,
        module=module_path,
        module_type=module_type,
        layer=layer,
        inputs=inputs,
        outputs=[tensor_meta(t) for t in out_tensors],
        params=params,
        shared_params=shared,
        attrs=attrs,
        fwd_flops=int(b.rec.fwd_flops.get(n.name, 0)),
        bwd_flops=int(bwd_flops.get(n.name, 0)),
        bytes_read=0 if is_view else read,
        bytes_written=0 if is_view else sum(nbytes(t) for t in out_tensors),
        param_bytes=sum(m.nbytes for k, m in params.items() if k not in shared),
        saved_bytes=saved.get(n.name, 0),
        saved_fixed_bytes=fixed.get(n.name, 0),
        batch_invariant=not batch_dep.get(n.name, True),
        is_view=is_view,
    )


def assemble(
    x: Exported, rec: Any, bwd_flops: dict[str, int], name: str | None, seq: int | None
) -> OpGraph:
    batch_dep = _batch_dependence(x)
    saved, fixed = _saved_bytes(x, rec, _origins(x, rec.values), batch_dep)
    buffer_names = {
        spec.arg.name
        for spec in x.ep.graph_signature.input_specs
        if spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    }
    b = _Builder(x, rec)
    b.add_inputs()
    for n in x.gm.graph.nodes:
        if n.op != "call_function":
            continue
        if _mutates_buffer(n, buffer_names):
            continue  # e.g. BatchNorm's num_batches_tracked += 1: not part of the step's math
        if n.target is operator.getitem:
            src, _ = b.source_of.get(n.args[0].name, (n.args[0].name, 0))
            b.source_of[n.name] = (src, int(n.args[1]))
            continue
        out_tensors = tensors(rec.values.get(n.name))
        if not out_tensors:
            continue
        b.source_of[n.name] = (n.name, 0)
        b.nodes.append(_op_node(b, n, out_tensors, bwd_flops, saved, fixed, batch_dep))
    out_node = next(n for n in x.gm.graph.nodes if n.op == "output")
    user_out = [a for a in tree_flatten(out_node.args)[0] if isinstance(a, torch.fx.Node)]
    outputs = [b.source_of[a.name][0] for a in user_out[:1] if a.name in b.source_of]
    first = x.example_inputs[0]
    params = x.ep.state_dict.values()
    dtype_of = next((p.dtype for p in params if p.is_floating_point()), first.dtype)
    data = OpGraphData(
        model=name,
        batch=int(first.shape[0]) if first.dim() else 1,
        seq=int(seq if seq is not None else (first.shape[1] if first.dim() > 1 else 1)),
        dtype=str(dtype_of).removeprefix("torch."),
        nodes=b.nodes,
        edges=b.edges,
        outputs=outputs,
    )
    return OpGraph(data)
