"""The viewer's shardings, by layer: layers whose every operator has the same strategy and
placements collapse into one row ("layers 2–77: same sharding", or "0, 2, …, 14 (every
2nd)" where dense and MoE layers alternate), expandable to the operators of the first. The
layer is the first numeric part of a module path (`blocks.12.attn.q_proj`,
`model.layers.3.mlp`); operators outside any layer (embeddings, the head, the loss) get a
row of their own."""

from __future__ import annotations

import re
from itertools import pairwise

from planner.plan import Stage

SHOWN_KINDS = ("linear", "embedding", "attention", "loss", "conv2d", "einsum")
MAX_ROWS = 400  # operators listed per group
_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def _layer_of(module: str) -> tuple[int, str] | None:
    """(layer index, the path with it replaced by "*") or None outside the layers."""
    found = _INDEX.search(module)
    if found is None:
        return None
    a, b = found.span(1)
    return int(found.group(1)), module[:a] + "*" + module[b:]


def layer_groups(stage: Stage) -> list[dict]:
    """Rows for one stage: runs of identically sharded layers, then what is outside them."""
    per_layer: dict[int, list] = {}
    outside = []
    for s in stage.shardings:
        where = _layer_of(s.module or "")
        if where is None:
            outside.append(s)
            continue
        per_layer.setdefault(where[0], []).append(s)

    def signature(ops) -> tuple:
        return tuple(
            (
                _layer_of(o.module)[1],
                o.kind,
                o.strategy,
                str(o.outputs),
                str(sorted(o.params.values())),
            )
            for o in ops
        )

    groups: dict[tuple, dict] = {}  # by signature, in order of first appearance
    for index in sorted(per_layer):
        ops = per_layer[index]
        group = groups.setdefault(signature(ops), {"layers": [], "ops": ops})
        group["layers"].append(index)
    rows = []
    for g in groups.values():
        layers = g["layers"]
        title = (
            f"layers {spans(layers)}: same sharding ({len(layers)} layers)"
            if len(layers) > 1
            else f"layer {layers[0]}"
        )
        rows.append(_row(title, g["ops"], len(layers)))
    if outside:
        rows.append(_row("outside the layers (embeddings, head, loss)", outside, 0))
    return rows


def spans(layers: list[int]) -> str:
    """Sorted layer indices as people write them: "2–77", "0, 2, …, 14 (every 2nd)",
    "0–1, 3–4"."""
    if len(layers) > 2:
        step = layers[1] - layers[0]
        if step > 1 and all(b - a == step for a, b in pairwise(layers)):
            nth = {2: "2nd", 3: "3rd"}.get(step, f"{step}th")
            return f"{layers[0]}, {layers[1]}, …, {layers[-1]} (every {nth})"
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}–{b}" if b > a else f"{a}" for a, b in runs)


def _row(title: str, ops, layers: int) -> dict:
    shown = [o for o in ops if o.kind in SHOWN_KINDS][:MAX_ROWS]
    return {
        "title": title,
        "layers": layers,
        "rows": [[o.module or o.node, o.kind, o.strategy] for o in shown],
        "operators": len(ops),
    }
