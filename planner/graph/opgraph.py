"""OpGraph: the traced training forward as a DAG of operator nodes, JSON round-trippable.

A node is one operator call (a leaf module call such as Linear or LayerNorm shows up as one
op: `linear`, `layer_norm`) with its shapes, forward and backward FLOPs, bytes moved,
parameter bytes, bytes saved for backward, and the repeated block ("layer") it belongs to.
An edge is a tensor from one node's output to another node's input.

JSON form (schema_version "1"): {"schema_version", "model", "batch", "seq", "dtype",
"nodes": [...], "edges": [...], "outputs": [...]}; `OpGraph.from_json` validates it and names
the offending node or edge on error.
"""

from __future__ import annotations

import json
from collections import defaultdict
from functools import cached_property
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.errors import InputError, input_error_from
from planner.graph.layer_groups import group_layers
from planner.limits import (
    MAX_GLOBAL_BATCH,
    MAX_GRAPH_INT,
    MAX_LAYERS,
    MAX_SEQ,
    MODEL_NAME,
    BoundedGraphInt,
)

if TYPE_CHECKING:
    import networkx as nx

GRAPH_SCHEMA_VERSION = "1"

NODE_KINDS = (
    "input",
    "linear",
    "matmul",
    "grouped_mm",
    "einsum",
    "embedding",
    "attention",
    "norm",
    "conv2d",
    "pool",
    "softmax",
    "loss",
    "elementwise",
    "reshape",
    "concat",
    "reduction",
    "scatter",
    "constant",
    "other",
)

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    # rotary embeddings as complex rotations (DeepSeek-V2/V3 in transformers)
    "complex64": 8,
    "complex128": 16,
}


class TensorMeta(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    shape: list[Annotated[int, Field(ge=0, le=MAX_GRAPH_INT)]] = Field(max_length=16)
    dtype: str = Field(max_length=32)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)


class OpNode(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    op: str = Field(description="operator, e.g. aten.linear.default")
    kind: str = Field(description="one of NODE_KINDS")
    module: str = Field("", description="path of the innermost module that made the call")
    module_type: str = ""
    layer: int | None = Field(
        None, ge=0, le=MAX_LAYERS, description="index of the repeated block, None outside"
    )
    inputs: list[TensorMeta] = Field(default_factory=list, description="activation inputs")
    outputs: list[TensorMeta] = Field(default_factory=list)
    params: dict[str, TensorMeta] = Field(default_factory=dict, description="params it uses")
    shared_params: list[str] = Field(
        default_factory=list, description="params used here but counted at an earlier node"
    )
    attrs: dict[str, Any] = Field(default_factory=dict, description="op arguments of note")
    fwd_flops: BoundedGraphInt = 0
    bwd_flops: BoundedGraphInt = 0
    bytes_read: BoundedGraphInt = 0
    bytes_written: BoundedGraphInt = 0
    param_bytes: BoundedGraphInt = 0
    saved_bytes: BoundedGraphInt = Field(
        0, description="activation bytes kept for backward, counted once"
    )
    saved_fixed_bytes: BoundedGraphInt = Field(
        0, description="part of saved_bytes that does not grow with the batch"
    )
    batch_invariant: bool = Field(False, description="computes nothing that depends on the batch")
    is_view: bool = False


class OpEdge(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    src: str
    dst: str
    src_output: int = Field(0, ge=0, le=MAX_GRAPH_INT)
    dst_input: int = Field(0, ge=0, le=MAX_GRAPH_INT)
    shape: list[Annotated[int, Field(ge=0, le=MAX_GRAPH_INT)]] = Field(max_length=16)
    dtype: str = Field(max_length=32)
    bytes: BoundedGraphInt


class OpGraphData(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: str = GRAPH_SCHEMA_VERSION
    model: str | None = Field(None, pattern=MODEL_NAME.pattern)
    batch: int = Field(ge=1, le=MAX_GLOBAL_BATCH)
    seq: int = Field(ge=1, le=MAX_SEQ)
    dtype: str = Field(max_length=32)
    nodes: list[OpNode]
    edges: list[OpEdge]
    outputs: list[str] = Field(default_factory=list)


def _check_node(node: OpNode) -> None:
    where = f"nodes[{node.name}]"
    if node.kind not in NODE_KINDS:
        raise InputError(f"{where}.kind", f"unknown kind {node.kind!r}", ", ".join(NODE_KINDS))
    for field in ("fwd_flops", "bwd_flops", "bytes_read", "bytes_written", "param_bytes"):
        if getattr(node, field) < 0:
            raise InputError(f"{where}.{field}", f"negative value {getattr(node, field)}", ">= 0")
    if node.saved_bytes < 0:
        raise InputError(f"{where}.saved_bytes", f"negative value {node.saved_bytes}", ">= 0")
    metas = [("inputs", t) for t in node.inputs] + [("outputs", t) for t in node.outputs]
    metas += [(f"params.{k}", t) for k, t in node.params.items()]
    for label, meta in metas:
        if any(d < 0 for d in meta.shape):
            raise InputError(f"{where}.{label}.shape", f"negative size in {meta.shape}", ">= 0")
        if meta.dtype not in DTYPE_BYTES:
            raise InputError(
                f"{where}.{label}.dtype", f"unknown dtype {meta.dtype!r}", ", ".join(DTYPE_BYTES)
            )
    if node.layer is not None and node.layer < 0:
        raise InputError(f"{where}.layer", f"negative layer {node.layer}", ">= 0 or null")


class OpGraph:
    """Validated graph data plus a networkx view and aggregate queries."""

    def __init__(self, data: OpGraphData):
        self.data = data
        self._validate()

    @classmethod
    def resized(cls, data: OpGraphData, like: OpGraph) -> OpGraph:
        """A graph with `like`'s structure (its nodes, edges and outputs, same names in the
        same order) and new values, e.g. another batch size: the values are checked, the
        structure (unique names, edges between known nodes, no cycle) was checked in `like`."""
        same = (
            len(data.nodes) == len(like.data.nodes)
            and data.outputs == like.data.outputs
            and all(a.name == b.name for a, b in zip(data.nodes, like.data.nodes, strict=True))
            and len(data.edges) == len(like.data.edges)
            and all(
                (a.src, a.dst) == (b.src, b.dst)
                for a, b in zip(data.edges, like.data.edges, strict=True)
            )
        )
        if not same:
            return cls(data)
        graph = cls.__new__(cls)
        graph.data = data
        for node in data.nodes:
            _check_node(node)
        graph._check_edge_sizes()
        return graph

    # --- construction and JSON ---------------------------------------------------------
    @classmethod
    def from_dict(cls, obj: Any, field: str = "graph") -> OpGraph:
        if not isinstance(obj, dict):
            raise InputError(field, "not a JSON object", "an OpGraph object")
        version = obj.get("schema_version")
        if version != GRAPH_SCHEMA_VERSION:
            raise InputError(
                f"{field}.schema_version", f"unsupported {version!r}", repr(GRAPH_SCHEMA_VERSION)
            )
        try:
            data = OpGraphData.model_validate(obj)
        except ValidationError as err:
            raise input_error_from(err, prefix=field) from None
        if not any(n.fwd_flops or n.bytes_read or n.bytes_written for n in data.nodes):
            raise InputError(  # nothing to time: a plan's step time would be 0
                f"{field}.nodes",
                "the graph does no work: every node has 0 FLOPs and moves 0 bytes",
                "a training graph written by autopar trace",
            )
        return cls(data)

    @classmethod
    def from_json(cls, text: str, field: str = "graph") -> OpGraph:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            raise InputError(field, f"not valid JSON: {err}") from None
        return cls.from_dict(obj, field)

    def to_dict(self) -> dict[str, Any]:
        return self.data.model_dump(mode="json")

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def _validate(self) -> None:
        seen: set[str] = set()
        for node in self.data.nodes:
            if node.name in seen:
                raise InputError(f"nodes[{node.name}]", "duplicate node name")
            seen.add(node.name)
            _check_node(node)
        for i, edge in enumerate(self.data.edges):
            for end in ("src", "dst"):
                ref = getattr(edge, end)
                if ref not in seen:
                    raise InputError(
                        f"edges[{i}].{end}",
                        f"dangling edge {edge.src}->{edge.dst}: no node named {ref!r}",
                    )
        self._check_edge_sizes()
        for out in self.data.outputs:
            if out not in seen:
                raise InputError("outputs", f"no node named {out!r}")
        import networkx as nx  # here: importing it costs every command ~0.1 s

        if not nx.is_directed_acyclic_graph(self.nx):
            cycle = nx.find_cycle(self.nx)
            raise InputError("edges", f"graph has a cycle through node {cycle[0][0]!r}")

    def _check_edge_sizes(self) -> None:
        for i, edge in enumerate(self.data.edges):
            if edge.bytes < 0 or any(d < 0 for d in edge.shape):
                raise InputError(
                    f"edges[{i}]", f"negative size on edge {edge.src}->{edge.dst}", ">= 0"
                )

    # --- access --------------------------------------------------------------------------
    @cached_property
    def nx(self) -> nx.DiGraph:
        import networkx as nx

        g = nx.DiGraph()
        for node in self.data.nodes:
            g.add_node(node.name, op=node)
        for edge in self.data.edges:
            if g.has_edge(edge.src, edge.dst):
                g.edges[edge.src, edge.dst]["tensors"].append(edge)
            else:
                g.add_edge(edge.src, edge.dst, tensors=[edge])
        return g

    @property
    def nodes(self) -> list[OpNode]:
        return list(self.data.nodes)

    @property
    def edges(self) -> list[OpEdge]:
        return list(self.data.edges)

    @cached_property
    def by_name(self) -> dict[str, OpNode]:
        return {n.name: n for n in self.data.nodes}

    def node(self, name: str) -> OpNode:
        return self.by_name[name]

    @cached_property
    def num_layers(self) -> int:
        layers = [n.layer for n in self.data.nodes if n.layer is not None]
        return max(layers) + 1 if layers else 0

    @cached_property
    def layer_nodes(self) -> dict[int, list[OpNode]]:
        """Each layer's nodes in graph order."""
        out: dict[int, list[OpNode]] = defaultdict(list)
        for node in self.data.nodes:
            if node.layer is not None:
                out[node.layer].append(node)
        return dict(out)

    @cached_property
    def layer_groups(self) -> dict[int, int]:
        """layer -> the first layer identical to it (planner.graph.layer_groups)."""
        by_name = self.by_name
        internal: dict[int, list[OpEdge]] = defaultdict(list)
        for e in self.data.edges:
            layer = by_name[e.dst].layer
            if layer is not None and by_name[e.src].layer == layer:
                internal[layer].append(e)
        return group_layers(self.layer_nodes, internal)

    @cached_property
    def positions(self) -> dict[str, int]:
        """Layer position of every node: its layer, or the last layer seen before it in
        order (nodes before the first layer get 0). Pipeline cuts fall between positions."""
        out: dict[str, int] = {}
        current = 0
        for node in self.data.nodes:
            if node.layer is not None:
                current = node.layer
            out[node.name] = current
        return out

    @cached_property
    def layer_input_edges(self) -> list[tuple[int, OpEdge]]:
        """(layer, edge) for each distinct tensor entering a layer from outside it (what
        per-layer activation checkpointing keeps); graph inputs and constants excluded."""
        out = []
        seen: set[tuple[str, int, int]] = set()
        by_name = self.by_name
        for e in self.data.edges:
            dst_layer = by_name[e.dst].layer
            if dst_layer is None or by_name[e.src].layer == dst_layer:
                continue
            if by_name[e.src].kind in ("input", "constant"):
                continue
            key = (e.src, e.src_output, dst_layer)
            if key not in seen:
                seen.add(key)
                out.append((dst_layer, e))
        return out

    @cached_property
    def layer_input_bytes(self) -> list[int]:
        """Per layer, bytes of the tensors entering it from outside (layer_input_edges)."""
        out = [0] * max(self.num_layers, 1)
        for layer, e in self.layer_input_edges:
            out[layer] += e.bytes
        return out

    @cached_property
    def cut_bytes(self) -> list[int]:
        """cut_bytes[b]: bytes of the distinct tensors crossing a pipeline cut between layer
        positions b-1 and b (what a stage sends to the next). Values that depend on no
        parameter are not sent: each stage computes its rotary tables and masks from the
        positions, and the labels go to the last stage with the batch (executor.pipeline)."""
        n = max(self.num_layers, 1)
        out = [0] * (n + 1)
        pos = self.positions
        seen: set[tuple[str, int, int]] = set()
        from planner.graph.dependence import parameter_free

        free = parameter_free(self)
        for e in self.data.edges:
            a, b = pos[e.src], pos[e.dst]
            if a >= b or e.src in free:
                continue
            for cut in range(a + 1, b + 1):
                key = (e.src, e.src_output, cut)
                if key not in seen:
                    seen.add(key)
                    out[cut] += e.bytes
        return out

    @cached_property
    def tied_param_uses(self) -> list[tuple[OpNode, str]]:
        """(node, parameter) for every use of a parameter some node lists as shared (a tied
        LM head's weight, used by the embedding and the head), in graph order."""
        tied = {p for node in self.data.nodes for p in node.shared_params}
        if not tied:
            return []
        return [(n, p) for n in self.data.nodes for p in n.params if p in tied]

    # --- totals --------------------------------------------------------------------------
    def total(self, field: str, nodes: list[OpNode] | None = None) -> int:
        return sum(getattr(n, field) for n in (self.data.nodes if nodes is None else nodes))

    @property
    def param_count(self) -> int:
        count = 0
        for node in self.data.nodes:
            for name, meta in node.params.items():
                if name not in node.shared_params:
                    count += meta.numel
        return count

    @cached_property
    def train_flops(self) -> int:
        return self.total("fwd_flops") + self.total("bwd_flops")

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = defaultdict(int)
        for node in self.data.nodes:
            kinds[node.kind] += 1
        return {
            "model": self.data.model,
            "nodes": len(self.data.nodes),
            "edges": len(self.data.edges),
            "layers": self.num_layers,
            "params": self.param_count,
            "fwd_flops": self.total("fwd_flops"),
            "bwd_flops": self.total("bwd_flops"),
            "saved_bytes": self.total("saved_bytes"),
            "kinds": dict(sorted(kinds.items())),
        }
