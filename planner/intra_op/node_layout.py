"""A node's tensor-parallel layout: the contract between the layouts (Megatron's, the ILP's)
and the evaluator. Placements are on the tp axis only; dp is modelled by the evaluator."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from planner.graph.opgraph import OpNode
from planner.placements import REPLICATE


@dataclass
class NodeLayout:
    strategy: str = "replicate"  # the sharding rules' names (planner.intra_op.sharding_rules)
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


def same_tp_placements(node: OpNode, a: NodeLayout, b: NodeLayout) -> bool:
    """Whether two layouts place this node's parameters, inputs and outputs alike on tp."""

    def padded(xs: list[str], n: int) -> list[str]:
        return list(xs) + [REPLICATE] * (n - len(xs))

    return (
        all(a.params.get(p, REPLICATE) == b.params.get(p, REPLICATE) for p in node.params)
        and padded(a.inputs, len(node.inputs)) == padded(b.inputs, len(node.inputs))
        and padded(a.outputs, len(node.outputs)) == padded(b.outputs, len(node.outputs))
    )


# What a stored layout holds besides its parameters' placements (those name the layer's own
# parameters, so identical layers differ only there).
_BASE_FIELDS = (
    "strategy",
    "compute_shards",
    "saved_shards",
    "fwd_comm",
    "bwd_comm",
    "step_comm",
    "inputs",
    "outputs",
)


def layouts_to_json(layouts: dict[str, NodeLayout]) -> dict:
    """Compact JSON: identical layers repeat the same few layouts, so each distinct layout
    (parameters aside) is written once and nodes refer to it."""
    distinct: dict[tuple, int] = {}
    bases: list[dict] = []
    nodes: dict[str, list] = {}
    for name, lay in layouts.items():
        values = [getattr(lay, f) for f in _BASE_FIELDS]
        key = tuple(tuple(v) if isinstance(v, list) else v for v in values)
        if key not in distinct:
            distinct[key] = len(bases)
            bases.append(dict(zip(_BASE_FIELDS, values, strict=True)))
        nodes[name] = [distinct[key], dict(lay.params)]
    return {"layouts": bases, "nodes": nodes}


def layouts_from_json(obj: dict) -> dict[str, NodeLayout]:
    """Inverse of layouts_to_json. Nodes share their base layout's lists (layouts are not
    mutated once built)."""

    def events(xs: list) -> list[tuple[str, int]]:
        return [(str(name), int(nbytes)) for name, nbytes in xs]

    bases = [
        NodeLayout(
            strategy=v["strategy"],
            compute_shards=v["compute_shards"],
            saved_shards=v["saved_shards"],
            fwd_comm=events(v["fwd_comm"]),
            bwd_comm=events(v["bwd_comm"]),
            step_comm=events(v["step_comm"]),
            inputs=list(v["inputs"]),
            outputs=list(v["outputs"]),
        )
        for v in obj["layouts"]
    ]
    out: dict[str, NodeLayout] = {}
    for name, (index, params) in obj["nodes"].items():
        base = bases[index]
        out[name] = base if not params else replace(base, params=dict(params))
    return out
