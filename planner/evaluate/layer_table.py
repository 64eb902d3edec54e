"""Per-layer sums of the nodes' costs under one tensor-parallel layout, so that evaluating a
configuration costs O(layers), not O(nodes).

Everything predict() and the stage DP need from the nodes depends only on the layout (kind,
micro-batch size, tp): compute, tp communication and per-step tp gradient sync, bytes saved
for backward and parameter elements per device. The table sums them per layer position
(planner.graph.opgraph.OpGraph.positions: a node outside the layers sits with the last layer
before it), split into nodes inside a layer and outside one (checkpointing recomputes only
the former). Identical layers under identical layouts are priced once: node costs are
computed for the first layer of each group (OpGraph.layer_groups) and copied.

Parameters used by several nodes (a tied LM head) are the one thing a chunk split changes: a
tied parameter costs a copy in every chunk that uses it after the chunk that owns it
(`tied_elements`, replaying predict's ownership rule over the uses in graph order).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import accumulate

from planner.cluster.mesh import LogicalMesh
from planner.cost.model import CostModel
from planner.evaluate.node_costs import NodeCost, node_costs
from planner.graph.opgraph import OpGraph, OpNode
from planner.intra_op.layout_map import LayoutMap
from planner.intra_op.node_layout import NodeLayout
from planner.parallel.checkpointing import output_shards
from planner.placements import REPLICATE, is_shard

_SUMMED = (
    "fwd",
    "bwd",
    "comm_fwd",
    "comm_bwd",
    "step_comm",
    "saved",
    "params",
    "wgrad",
    "selective_kept",
    "selective_recompute",
    "selective_alternate_kept",
    "selective_alternate_recompute",
    "workspace",
    "fixed_fwd",
    "fixed_bwd",
    "wgrad_stash",
)
# The fields that do not grow with the tokens a micro-batch carries (what a sequence split,
# planner.parallel.context, leaves whole): parameter elements, per-step gradient sync.
TOKEN_INDEPENDENT = frozenset({"params", "step_comm", "fixed_fwd", "fixed_bwd"})
# fwd / bwd's token-independent parts (fp8's weight casts), which a sequence split leaves whole
FIXED_PARTS = {"fwd": "fixed_fwd", "bwd": "fixed_bwd"}
# bytes and elements stay exact integers
_INTS = (
    "saved",
    "params",
    "selective_kept",
    "selective_alternate_kept",
    "workspace",
    "wgrad_stash",
)


@dataclass(frozen=True)
class ParamUse:
    """One use of a parameter that is used by more than one node, in graph order."""

    position: int
    layer: int | None
    name: str
    elements: int  # per device under the node's layout
    tied: bool  # listed in the node's shared_params (a copy is due in another chunk)


@dataclass
class LayerTable:
    """Sums per layer position; `inside`/`outside` hold one list per field of _SUMMED."""

    num_positions: int
    inside: dict[str, list[float]]
    outside: dict[str, list[float]]
    layer_inputs: list[int]
    cut_bytes: list[int]
    before_layers: dict[str, float]  # the part of outside[...][0] before the first layer
    uses: list[ParamUse] = field(default_factory=list)
    # Per position, the largest output a node inside the layer returns on a device: the
    # largest gradient its backward makes, beside what a rebuild holds (rebuilt_of).
    largest_outputs: list[int] = field(default_factory=list)
    # Per position, the elements of expert weights a rank holds (1 / ep of the experts:
    # planner.parallel.expert.scaled_table), part of `params`; empty without expert
    # parallelism.
    expert_params: list[int] = field(default_factory=list)
    _prefix: dict[str, list[float]] = field(default_factory=dict, repr=False)
    derived: dict[str, object] = field(default_factory=dict, repr=False)  # callers' caches

    def prefix(self, key: str) -> list[float]:
        """Prefix sums of `inside:<field>`, `outside:<field>` or `all:<field>`."""
        if key not in self._prefix:
            where, name = key.split(":")
            if where == "all":
                values = [a + b for a, b in zip(self.inside[name], self.outside[name], strict=True)]
            else:
                values = getattr(self, where)[name]
            self._prefix[key] = [0, *accumulate(values)]
        return self._prefix[key]

    def to_json(self) -> dict:
        return {
            "num_positions": self.num_positions,
            "inside": self.inside,
            "outside": self.outside,
            "layer_inputs": self.layer_inputs,
            "cut_bytes": self.cut_bytes,
            "before_layers": self.before_layers,
            "uses": [[u.position, u.layer, u.name, u.elements, u.tied] for u in self.uses],
            "largest_outputs": self.largest_outputs,
        }

    @classmethod
    def from_json(cls, obj: dict) -> LayerTable:
        return cls(
            int(obj["num_positions"]),
            {k: list(v) for k, v in obj["inside"].items()},
            {k: list(v) for k, v in obj["outside"].items()},
            [int(x) for x in obj["layer_inputs"]],
            [int(x) for x in obj["cut_bytes"]],
            dict(obj["before_layers"]),
            [ParamUse(int(p), layer, str(n), int(e), bool(t)) for p, layer, n, e, t in obj["uses"]],
            [int(x) for x in obj["largest_outputs"]],
        )

    def saved_after(self, last: int) -> int:
        """What nodes outside layers save after layer position `last` (a chunk's last, the
        head's on the last chunk): those at its position, less what comes before the first
        layer (at position 0 too)."""
        after = self.outside["saved"][last]
        return int(after - self.before_layers["saved"]) if last == 0 else int(after)

    def range_sum(self, key: str, a: int, b: int) -> float:
        p = self.prefix(key)
        return p[b] - p[a]

    def no_worse_than(self, other: LayerTable) -> bool:
        """Whether every per-position cost of this table is at most `other`'s, with the same
        boundaries and parameters: then any configuration priced with it is as fast and as
        small as with `other` (predict's terms grow with each of them), and `other` need not
        be evaluated (the search's fp8 tables against bf16's: planner.parallel.fp8)."""
        same = (self.layer_inputs, self.cut_bytes, self.uses, self.num_positions) == (
            other.layer_inputs,
            other.cut_bytes,
            other.uses,
            other.num_positions,
        )
        if not same:
            return False
        for where in ("inside", "outside"):
            mine, theirs = getattr(self, where), getattr(other, where)
            # a zero-bubble schedule runs bwd's input-gradient part and wgrad apart
            input_grad = (
                [b - w for b, w in zip(t["bwd"], t["wgrad"], strict=True)] for t in (mine, theirs)
            )
            pairs = [(mine[k], theirs.get(k, [])) for k in _SUMMED if k not in FIXED_PARTS.values()]
            for a, b in [*pairs, tuple(input_grad)]:
                if any(x > y for x, y in zip(a, b, strict=True)):
                    return False
        keys = [k for k in self.before_layers if k not in FIXED_PARTS.values()]
        return all(self.before_layers[k] <= other.before_layers.get(k, 0) for k in keys)

    def tied_elements(self, starts: list[int]) -> tuple[list[int], dict[int, int]]:
        """Per chunk (chunk c starts at position starts[c]), extra parameter elements for
        tied parameters used outside the chunk that owns them; and per layer the same extra
        (for the largest layer's parameters under ZeRO-3)."""
        extra = [0] * len(starts)
        per_layer: dict[int, int] = {}
        owner: dict[str, int] = {}
        for use in self.uses:
            chunk = bisect_right(starts, use.position) - 1
            first = owner.setdefault(use.name, chunk)
            if use.tied and first != chunk:
                extra[chunk] += use.elements
                owner[use.name] = chunk
                if use.layer is not None:
                    per_layer[use.layer] = per_layer.get(use.layer, 0) + use.elements
        return extra, per_layer


def layout_key(node: OpNode, lay: NodeLayout) -> tuple:
    """What node_costs reads from a layout (equal keys give equal costs on equal nodes);
    parameters by position, as identical nodes of two layers name them differently."""
    return (
        lay.compute_shards,
        lay.saved_shards,
        tuple(lay.fwd_comm),
        tuple(lay.bwd_comm),
        tuple(lay.step_comm),
        tuple(lay.params.get(p, REPLICATE) for p in node.params),
        tuple(lay.outputs),
    )


def build_table(
    graph: OpGraph, layouts: Mapping[str, NodeLayout], cm: CostModel, mesh: LogicalMesh
) -> tuple[LayerTable, dict[str, NodeCost]]:
    """The table, and the node costs it was built from (for the nodes that were priced:
    every node outside layers and those of the first layer of each identical group)."""
    n = max(graph.num_layers, 1)
    tp = mesh.axis("tp").size
    source = _priced_layers(graph, layouts)
    todo = [node for node in graph.nodes if node.layer is None or source[node.layer] == node.layer]
    costs = node_costs(graph, layouts, cm, mesh, nodes=todo)
    inside = {k: [0 if k in _INTS else 0.0] * n for k in _SUMMED}
    outside = {k: [0 if k in _INTS else 0.0] * n for k in _SUMMED}
    pos = graph.positions
    before = {k: [0 if k in _INTS else 0.0] for k in _SUMMED}
    seen_layer = False
    for node in todo:
        seen_layer = seen_layer or node.layer is not None
        bucket = outside if node.layer is None else inside
        _add(bucket, pos[node.name], costs[node.name])
        if not seen_layer:
            _add(before, 0, costs[node.name])
    largest = [0] * n
    for node in todo:
        if node.layer is not None and node.outputs:
            local = node.outputs[0].nbytes // output_shards(node, layouts[node.name], tp)
            largest[pos[node.name]] = max(largest[pos[node.name]], local)
    if cm.runtime.tp_comm_overlap and tp > 1:
        _overlap_tp_comm(inside)
    for layer, src in source.items():
        if layer != src:
            for k in _SUMMED:
                inside[k][layer] = inside[k][src]
            largest[layer] = largest[src]
    uses = _param_uses(graph, layouts, tp)
    table = LayerTable(
        n,
        inside,
        outside,
        _layer_inputs(graph, layouts, tp),
        graph.cut_bytes,
        {k: v[0] for k, v in before.items()},
        uses,
        largest,
    )
    return table, costs


def _overlap_tp_comm(inside: dict[str, list]) -> None:
    """A runtime that runs each layer's tensor-parallel collectives beside its GEMMs
    (planner.runtime's tp_comm_overlap): per layer, forward and backward, only what the
    layer's compute does not cover is exposed."""
    for key, compute in (("comm_fwd", "fwd"), ("comm_bwd", "bwd")):
        inside[key] = [max(0.0, c - t) for c, t in zip(inside[key], inside[compute], strict=True)]


def _layer_inputs(graph: OpGraph, layouts: Mapping[str, NodeLayout], tp: int) -> list[int]:
    """graph.layer_input_bytes per device: a tensor its producer's layout shards on tp (the
    residual stream under sequence parallelism) is kept 1/tp per device."""
    whole = graph.layer_input_bytes
    if tp == 1:
        return whole
    out = [0] * len(whole)
    for layer, e in graph.layer_input_edges:
        outputs = layouts[e.src].outputs
        placement = outputs[e.src_output] if e.src_output < len(outputs) else REPLICATE
        out[layer] += e.bytes // (tp if is_shard(placement) else 1)
    return out


def _add(bucket: dict[str, list[float]], position: int, c: NodeCost) -> None:
    for key in _SUMMED:
        bucket[key][position] += getattr(c, key)


def _priced_layers(graph: OpGraph, layouts: Mapping[str, NodeLayout]) -> dict[int, int]:
    """layer -> the layer whose sums it copies (itself when it is priced): the first layer
    of its identical group with the same layouts, node for node (a LayoutMap knows)."""
    if isinstance(layouts, LayoutMap) and layouts.graph is graph:
        return dict(layouts.layer_source)
    first: dict[tuple, int] = {}
    out = {}
    by_layer = graph.layer_nodes
    for layer, rep in graph.layer_groups.items():
        key = (rep, tuple(layout_key(n, layouts[n.name]) for n in by_layer[layer]))
        out[layer] = first.setdefault(key, layer)
    return out


def _param_uses(graph, layouts, tp: int) -> list[ParamUse]:
    """Uses of parameters that more than one node uses (usually none but a tied head)."""
    pos = graph.positions
    out = []
    for node, name in graph.tied_param_uses:
        sharded = is_shard(layouts[node.name].params.get(name, REPLICATE))
        elements = node.params[name].numel // tp if sharded else node.params[name].numel
        out.append(ParamUse(pos[node.name], node.layer, name, elements, name in node.shared_params))
    return out
