"""The graph at other batch sizes (rescaled from one trace, or extrapolated exactly from two)
and balanced layers for graphs without repeated blocks."""

from __future__ import annotations

from planner.errors import InputError
from planner.graph.opgraph import OpGraph, TensorMeta


def rescale_batch(graph: OpGraph, batch: int) -> OpGraph:
    """The same graph at another batch size, scaling batch-proportional quantities.

    Exact for models whose work is linear in the batch (every model in the zoo); used when a
    user plans from a graph JSON traced at a different batch than the micro-batch needs.
    """
    old = graph.data.batch
    if batch == old:
        return graph
    if batch <= 0:
        raise InputError("batch", f"{batch} is not positive", ">= 1")

    def shape(meta: TensorMeta) -> TensorMeta:
        if meta.shape and meta.shape[0] == old:
            return TensorMeta(shape=[batch, *meta.shape[1:]], dtype=meta.dtype)
        return meta

    def scaled(n: int) -> int:
        return n * batch // old

    nodes = []
    invariant = {n.name for n in graph.data.nodes if n.batch_invariant}
    for n in graph.data.nodes:
        fixed = n.saved_fixed_bytes
        if n.batch_invariant:  # e.g. RoPE tables: the same at any batch size
            nodes.append(n)
            continue
        params = sum(m.nbytes for m in n.params.values())
        nodes.append(
            n.model_copy(
                update={
                    "inputs": [shape(t) for t in n.inputs],
                    "outputs": [shape(t) for t in n.outputs],
                    "fwd_flops": scaled(n.fwd_flops),
                    "bwd_flops": scaled(n.bwd_flops),
                    "bytes_read": params + scaled(max(n.bytes_read - params, 0)),
                    "bytes_written": scaled(n.bytes_written),
                    "saved_bytes": fixed + scaled(n.saved_bytes - fixed),
                }
            )
        )
    edges = []
    for e in graph.data.edges:
        if e.src in invariant:
            edges.append(e)
            continue
        new_shape = [batch, *e.shape[1:]] if e.shape and e.shape[0] == old else e.shape
        edges.append(e.model_copy(update={"shape": new_shape, "bytes": scaled(e.bytes)}))
    data = graph.data.model_copy(update={"batch": batch, "nodes": nodes, "edges": edges})
    return OpGraph.resized(data, graph)


def cluster_layers(graph: OpGraph, max_layers: int = 16) -> OpGraph:
    """Give a graph without repeated blocks layers of balanced cost (Alpa's operator
    clustering, simplified to contiguous groups in graph order): each node goes to layer
    floor(cost before it / (total / L)), cost = forward + backward FLOPs, L = min(max_layers,
    matmul-like nodes). Graphs that have layers, even one, are returned as they are: a stage's
    layers are the model's blocks (a one-block model's plan covers [0, 1), Plan checks it).
    """
    if graph.num_layers >= 1:
        return graph
    heavy = [n for n in graph.nodes if n.fwd_flops > 0]
    count = min(max_layers, len(heavy))
    if count < 2:
        return graph
    total = sum(n.fwd_flops + n.bwd_flops for n in graph.nodes)
    target = total / count
    nodes, before = [], 0
    for n in graph.nodes:
        cost = n.fwd_flops + n.bwd_flops
        # A node belongs to the layer its cost mostly falls into.
        layer = min(count - 1, int((before + cost / 2) // target)) if n.kind != "input" else None
        before += cost
        nodes.append(n.model_copy(update={"layer": layer}))
    return OpGraph.resized(graph.data.model_copy(update={"nodes": nodes}), graph)


def extrapolate_batch(g1: OpGraph, g2: OpGraph, batch: int) -> OpGraph:
    """The graph at `batch` from the same model traced at two batch sizes: every count and
    every shape is affine in the batch, so v(b) = v1 + (v2 - v1) (b - b1) / (b2 - b1) is exact
    (including sizes that follow the batch through shapes only, like MoE dispatch buffers)."""
    b1, b2 = g1.data.batch, g2.data.batch
    if batch == b1:
        return g1
    if batch == b2:
        return g2
    if len(g1.data.nodes) != len(g2.data.nodes) or len(g1.data.edges) != len(g2.data.edges):
        raise InputError("graph", "the two traces differ in structure; cannot extrapolate")

    def at(v1: int, v2: int) -> int:
        return v1 + (v2 - v1) * (batch - b1) // (b2 - b1)

    metas: dict[tuple, TensorMeta] = {}  # the few distinct shapes, validated once each

    def meta(m1: TensorMeta, m2: TensorMeta) -> TensorMeta:
        key = (*m1.shape, None, *m2.shape, m1.dtype)
        out = metas.get(key)
        if out is None:
            shape = [at(x, y) for x, y in zip(m1.shape, m2.shape, strict=True)]
            out = metas[key] = TensorMeta(shape=shape, dtype=m1.dtype)
        return out

    fields = (
        "fwd_flops",
        "bwd_flops",
        "bytes_read",
        "bytes_written",
        "param_bytes",
        "saved_bytes",
        "saved_fixed_bytes",
    )
    nodes = []
    for n1, n2 in zip(g1.data.nodes, g2.data.nodes, strict=True):
        update = {f: at(getattr(n1, f), getattr(n2, f)) for f in fields}
        update["inputs"] = [meta(a, b) for a, b in zip(n1.inputs, n2.inputs, strict=True)]
        update["outputs"] = [meta(a, b) for a, b in zip(n1.outputs, n2.outputs, strict=True)]
        nodes.append(n1.model_copy(update=update))
    edges = [
        e1.model_copy(
            update={
                "bytes": at(e1.bytes, e2.bytes),
                "shape": [at(x, y) for x, y in zip(e1.shape, e2.shape, strict=True)],
            }
        )
        for e1, e2 in zip(g1.data.edges, g2.data.edges, strict=True)
    ]
    data = g1.data.model_copy(update={"batch": batch, "nodes": nodes, "edges": edges})
    out = OpGraph.resized(data, g1)
    # Every figure is affine in the batch: layers identical at two batch sizes are identical
    # at all (the cached grouping is that of both traces).
    pair = {layer: (g1.layer_groups[layer], g2.layer_groups[layer]) for layer in g1.layer_groups}
    first: dict[tuple, int] = {}
    out.__dict__["layer_groups"] = {k: first.setdefault(v, k) for k, v in pair.items()}
    return out


def graph_at(base: OpGraph, second: OpGraph | None, batch: int) -> OpGraph:
    """The graph at `batch`: extrapolated from two traces when there are two (exact),
    otherwise rescaled from one (exact for work proportional to the batch)."""
    if second is not None:
        return extrapolate_batch(base, second, batch)
    return rescale_batch(base, batch)
