"""Layouts of a graph whose identical layers share theirs: the layouts of the nodes outside
layers and of the first layer of each distinct (layer group, layout) are held; every other
layer takes its source layer's layouts under its own parameter names, built on first access.
An 80-layer model's layout then costs what a few layers cost to build, store and price
(planner.evaluate.layer_table reads `layer_source` instead of comparing every layer)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace

from planner.graph.opgraph import OpGraph, OpNode
from planner.intra_op.node_layout import NodeLayout, layouts_from_json, layouts_to_json


class LayoutMap(Mapping[str, NodeLayout]):
    """node name -> NodeLayout for every node of `graph`."""

    def __init__(self, graph: OpGraph, own: dict[str, NodeLayout], layer_source: dict[int, int]):
        self.graph = graph
        self.own = own  # outside layers and in source layers (layer_source[l] == l)
        self.layer_source = layer_source  # every layer -> the layer whose layouts it takes
        self._built: dict[str, NodeLayout] = {}
        self._index: dict[str, int] | None = None

    def __getitem__(self, name: str) -> NodeLayout:
        lay = self.own.get(name) or self._built.get(name)
        if lay is None:
            lay = self._built[name] = self._copied(name)
        return lay

    def strategy(self, name: str) -> str:
        """The node's strategy, without building a copied layer's layout (its source's)."""
        lay = self.own.get(name) or self._built.get(name)
        return (lay or self.own[self._source(name).name]).strategy

    def _source(self, name: str) -> OpNode:
        """The node of the source layer whose layout this copied node takes."""
        node = self.graph.by_name[name]
        if node.layer is None:
            raise KeyError(name)
        if self._index is None:
            nodes = self.graph.layer_nodes.values()
            self._index = {n.name: i for members in nodes for i, n in enumerate(members)}
        return self.graph.layer_nodes[self.layer_source[node.layer]][self._index[name]]

    def _copied(self, name: str) -> NodeLayout:
        node, src = self.graph.by_name[name], self._source(name)
        base = self.own[src.name]
        # Identical layers list their parameters in the same order (planner.graph.layer_groups).
        names = dict(zip(src.params, node.params, strict=True))
        return replace(base, params={names.get(p, p): pl for p, pl in base.params.items()})

    def __iter__(self) -> Iterator[str]:
        return (n.name for n in self.graph.nodes)

    def __len__(self) -> int:
        return len(self.graph.nodes)

    def __contains__(self, name: object) -> bool:
        return name in self.graph.by_name


def strategy_of(layouts: Mapping[str, NodeLayout], name: str) -> str:
    """A node's strategy in any layouts (a LayoutMap's without building a copy)."""
    return layouts.strategy(name) if isinstance(layouts, LayoutMap) else layouts[name].strategy


def dump_layouts(layouts: Mapping[str, NodeLayout]) -> dict:
    """JSON for the disk cache: a LayoutMap keeps its shape (own layouts and sources)."""
    if isinstance(layouts, LayoutMap):
        sources = sorted(layouts.layer_source.items())
        return {"own": layouts_to_json(layouts.own), "layer_source": sources}
    return layouts_to_json(dict(layouts))


def load_layouts(obj: dict, graph: OpGraph) -> Mapping[str, NodeLayout]:
    """Inverse of dump_layouts (the graph they were built for names the copies)."""
    if "layer_source" in obj:
        sources = {int(layer): int(src) for layer, src in obj["layer_source"]}
        return LayoutMap(graph, layouts_from_json(obj["own"]), sources)
    return layouts_from_json(obj)
