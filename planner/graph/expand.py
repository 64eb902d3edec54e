"""One trace of a repeated block stands for all of them: the graph of an L-layer model from a
trace of the same model with a few layers.

A model whose layers repeat with period p (GPT, Llama: 1; the GShard MoE, dense and expert
layers alternating: 2) is traced with d = 2p + (L mod p) layers: a first period (layer 0
differs slightly: tensors shared by every layer, like RoPE tables, are counted where they are
first saved), the block [p, 2p) and the remainder. The block is copied (L - d) / p times
after itself, renamed exactly as torch.export names the nodes of the deeper model: a node
named `<op>_<k>` in copy c is `<op>_<k + c * s>` with s the number of `<op>` nodes one
period adds (read off the trace: the block's node minus its twin in the first period), module
paths and parameters `<container>.<layer>` renumbered; nodes after the block shift by all the
copies. Edges into a copy come from the previous copy where the block's come from the first
period, from the same node where they come from before the layers.

Exactness is tested against full traces (tests/planner/test_expand.py); a trace that does not
have this shape (layers not contiguous, twins that differ in their operators, names that do
not follow) raises NotRepeating and the caller traces the whole model.
"""

from __future__ import annotations

import re
from typing import Any

from planner.graph.opgraph import OpGraph, OpNode

_NAME = re.compile(r"^(.*?)(?:_(\d+))?$")


class NotRepeatingError(ValueError):
    """The trace is not a repeated block this expansion reproduces exactly."""


def _split(name: str) -> tuple[str, int]:
    m = _NAME.match(name)
    assert m is not None
    return m.group(1), int(m.group(2) or 0)


def _join(base: str, k: int) -> str:
    return base if k == 0 else f"{base}_{k}"


def expand_layers(compact: OpGraph, layers: int, period: int) -> OpGraph:
    """The graph of the same model with `layers` layers (see the module docstring)."""
    d = compact.num_layers
    if d == layers:
        return compact
    copies, rest = divmod(layers - d, period)
    if rest or copies < 0 or d < 2 * period:
        raise NotRepeatingError(f"{d} traced layers do not extend to {layers} by {period}")
    x = _Expansion(compact, period, copies)
    return x.graph()


class _Expansion:
    def __init__(self, compact: OpGraph, period: int, copies: int):
        self.g, self.p, self.copies = compact, period, copies
        self.by_layer = compact.layer_nodes
        self.block = range(period, 2 * period)
        self._pre = set()
        for n in compact.nodes:
            if n.layer is not None:
                break
            self._pre.add(n.name)
        self._check_order()
        self.twin = self._twins()
        self._twin_of = {t.name: b for b, t in self.twin.items()}
        self.shift = self._name_shifts()
        self.container = self._container()

    # --- checks and what is read off the trace ---------------------------------------------
    def _check_order(self) -> None:
        """Nodes before the layers, then each layer's nodes contiguously, then the rest."""
        seen_after = False
        last = -1
        for n in self.g.nodes:
            if n.layer is None:
                seen_after = seen_after or last >= 0
                continue
            if seen_after or n.layer < last:
                raise NotRepeatingError(f"node {n.name} of layer {n.layer} is out of order")
            last = n.layer

    def _twins(self) -> dict[str, OpNode]:
        """Block node -> the node at its place in the first period (its twin)."""
        out = {}
        for layer in self.block:
            a, b = self.by_layer[layer - self.p], self.by_layer[layer]
            if [(n.op, _split(n.name)[0]) for n in a] != [(n.op, _split(n.name)[0]) for n in b]:
                raise NotRepeatingError(f"layer {layer} is not a copy of layer {layer - self.p}")
            out.update({nb.name: na for na, nb in zip(a, b, strict=True)})
        return out

    def _name_shifts(self) -> dict[str, int]:
        """Per operator name, how many nodes one period adds: from the block's nodes and
        their twins, and from the names their arguments refer to (export's getitem nodes
        are not graph nodes but are numbered all the same)."""
        shift: dict[str, int] = {}
        pairs: list[tuple[str, str]] = []
        for name, twin in self.twin.items():
            pairs.append((name, twin.name))
            pairs += _refs_pairs(self.g.node(name).attrs, twin.attrs)
        for name, twin_name in pairs:
            base, k = _split(name)
            if base != _split(twin_name)[0] or (name in self.g.by_name and twin_name == name):
                continue
            step = k - _split(twin_name)[1]
            if step <= 0 or shift.setdefault(base, step) != step:
                raise NotRepeatingError(f"node names of {base!r} do not repeat per layer")
        return shift

    def _container(self) -> str:
        """The module path that holds the blocks: `blocks` in `blocks.3.attn`."""
        for n in self.by_layer[self.p]:
            parts = n.module.split(".")
            if str(self.p) in parts:
                return ".".join(parts[: parts.index(str(self.p))])
        raise NotRepeatingError("no module path names the block's index")

    # --- renaming ------------------------------------------------------------------------
    def _name(self, name: str, copies_before: int) -> str:
        base, k = _split(name)
        return _join(base, k + copies_before * self.shift.get(base, 0))

    def _path(self, path: str, layer: int, new_layer: int) -> str:
        """A module path or parameter name (`blocks.1.ln.weight`), or an export placeholder
        (`p_model_blocks_1_ln_weight`, `b_model_layers_1_rope_cos`), in another layer."""
        old = f"{self.container}.{layer}" if self.container else str(layer)
        new = f"{self.container}.{new_layer}" if self.container else str(new_layer)
        if path == old or path.startswith(old + "."):
            return new + path[len(old) :]
        old_u, new_u = old.replace(".", "_") + "_", new.replace(".", "_") + "_"
        at = path.find("_" + old_u)
        if at >= 0:
            return path[: at + 1] + new_u + path[at + 1 + len(old_u) :]
        return path

    def _where(self, node: OpNode) -> str:
        if node.layer is None:
            return "before" if node.name in self._pre else "after"
        if node.layer < self.p:
            return "first"
        return "block" if node.layer in self.block else "tail"

    # --- building ------------------------------------------------------------------------
    def graph(self) -> OpGraph:
        g = self.g
        incoming: dict[str, list] = {}
        for e in g.edges:
            incoming.setdefault(e.dst, []).append(e)
        nodes, edges = [], []
        # (compact node, copy index: 0 = as traced, 1..copies inserted; tail/after: copies)
        order: list[tuple[OpNode, int]] = []
        for n in g.nodes:
            where = self._where(n)
            if where == "block" and n is self.by_layer[self.p + self.p - 1][-1]:
                order.append((n, 0))
                for layer_copy in range(1, self.copies + 1):
                    for layer in self.block:
                        order += [(m, layer_copy) for m in self.by_layer[layer]]
                continue
            order.append((n, self.copies if where in ("tail", "after") else 0))
        for n, c in order:
            new = self._node(n, c)
            nodes.append(new)
            for e in incoming.get(n.name, []):
                src = self._source(g.node(e.src), n, c)
                edges.append(e.model_copy(update={"src": src, "dst": new.name}))
        outputs = [self._name(o, self.copies) for o in g.data.outputs]
        data = g.data.model_copy(update={"nodes": nodes, "edges": edges, "outputs": outputs})
        return OpGraph(data)

    def _node(self, n: OpNode, c: int) -> OpNode:
        where = self._where(n)
        if where in ("before", "first") or (where == "block" and c == 0):
            return n
        layer = None if n.layer is None else n.layer + c * self.p
        name = self._name(n.name, c)

        def rename(path: str) -> str:
            return path if n.layer is None else self._path(path, n.layer, layer)

        params = {rename(p): m for p, m in n.params.items()}
        update: dict[str, Any] = {
            "name": name,
            "layer": layer,
            "module": rename(n.module),
            "params": params,
            "shared_params": [rename(p) for p in n.shared_params],
            "attrs": self._attrs(n.attrs, n, c, rename),
        }
        return n.model_copy(update=update)

    def _source(self, src: OpNode, dst: OpNode, c: int) -> str:
        """The name of `src` as seen by copy c of `dst` (c = copies for nodes after)."""
        where_src, where_dst = self._where(src), self._where(dst)
        if where_src == "before":
            return src.name
        if where_src == "first":
            if where_dst == "block" and c > 0:  # the previous copy's twin
                return self._name(self._twin_of[src.name], c - 1)
            if where_dst in ("block", "first"):
                return src.name
            raise NotRepeatingError(f"{dst.name} reads {src.name} across the repeated block")
        return self._name(src.name, c)

    def _attrs(self, attrs: dict, n: OpNode, c: int, rename) -> dict:
        """Op arguments name their producers ({"node": ...}) and parameters."""

        def walk(v: Any) -> Any:
            if isinstance(v, dict):
                if set(v) == {"node"} and v["node"] in self.g.by_name:
                    return {"node": self._source(self.g.node(v["node"]), n, c)}
                if set(v) == {"node"}:
                    return {"node": ref(v["node"])}
                return {k: walk(x) for k, x in v.items()}
            if isinstance(v, list):
                return [walk(x) for x in v]
            if isinstance(v, str):
                return rename(v)
            return v

        def ref(name: str) -> str:
            renamed = rename(name)
            if renamed != name or n.layer is None or n.layer < self.p:
                return renamed
            return self._name(name, c)  # a node export numbers but the graph leaves out

        return walk(attrs)


def _refs_pairs(a: Any, b: Any) -> list[tuple[str, str]]:
    """Names referred to ({"node": ...}) at the same places of two argument structures."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) == {"node"} and set(b) == {"node"}:
            return [(a["node"], b["node"])]
        return [p for k in a.keys() & b.keys() for p in _refs_pairs(a[k], b[k])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for x, y in zip(a, b, strict=True) for p in _refs_pairs(x, y)]
    return []
