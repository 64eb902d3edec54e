"""Shape-dependent matmul and attention rates from measured tables.

A GEMM's achieved FLOP/s depends on its shape: thin GEMMs from high tensor-parallel degrees
and short sequences fill fewer tiles and waves and run far below the large-GEMM rate (on the
H100 SXM measured by `bench/gpu_measure.py`, `bench/results/h100_measure.json`: 8192 x 4096
x 256 at 35% of the bf16 peak, 8192 x 4096 x 4096 at 68%). Where a profile carries such a
table (`measured.matmuls`), a linear layer's forward GEMM (m, k, n), its input-gradient GEMM
(m, n, k) and its weight-gradient GEMM (n, m, k) are each timed at the rate interpolated for
their own local shape; causal attention likewise from `measured.attention_times` by
batch x heads and sequence length. Without a table the scalar efficiency applies.

Interpolation is linear in log2 of each dimension on the grid of measured values (every grid
point of a full sweep is measured), clamped to the grid's range (large GEMMs saturate; the
smallest measured ones bound tiny ones from above); where a corner was not measured (a sparse
table such as profile-cluster's four shapes), the nearest measured point in log2 distance.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from planner.graph.opgraph import OpNode

LINEAR_OPS = frozenset({"aten.linear.default", "aten.mm.default"})
ATTENTION_OPS = frozenset({"aten.scaled_dot_product_attention.default"})
_MEMO_LIMIT = 1 << 16  # interpolated shapes kept per table


class GridRates:
    """Rates (FLOP/s) measured at points of a grid in d dimensions, interpolated in log2."""

    def __init__(self, points: Sequence[tuple[tuple[int, ...], float]]):
        self.points = {tuple(p): r for p, r in points if r > 0}
        dims = len(next(iter(self.points))) if self.points else 0
        self.axes = [sorted({p[i] for p in self.points}) for i in range(dims)]
        self._memo: dict[tuple[int, ...], float] = {}

    def __bool__(self) -> bool:
        return bool(self.points)

    @cached_property
    def _logs(self) -> list[tuple[tuple[float, ...], float]]:
        return [(tuple(math.log2(v) for v in p), r) for p, r in self.points.items()]

    def rate(self, at: tuple[int, ...]) -> float:
        hit = self._memo.get(at)
        if hit is None:
            if len(self._memo) >= _MEMO_LIMIT:  # a long-lived service sees unbounded shapes
                self._memo.clear()
            hit = self._memo[at] = self._interpolate(at)
        return hit

    def _interpolate(self, at: tuple[int, ...]) -> float:
        brackets = []
        for axis, v in zip(self.axes, at, strict=True):
            v = min(max(v, axis[0]), axis[-1])
            i = min(max(bisect.bisect_left(axis, v), 1), len(axis) - 1) if len(axis) > 1 else 0
            lo, hi = axis[max(i - 1, 0)], axis[i]
            frac = 0.0 if hi == lo else (math.log2(v) - math.log2(lo)) / math.log2(hi / lo)
            brackets.append(((lo, 1.0 - frac), (hi, frac)))
        total = 0.0
        for corner in range(2 ** len(brackets)):
            point, weight = [], 1.0
            for d, pair in enumerate(brackets):
                value, w = pair[(corner >> d) & 1]
                point.append(value)
                weight *= w
            if weight == 0.0:
                continue
            rate = self.points.get(tuple(point))
            if rate is None:
                return self._nearest(at)
            total += weight * rate
        return total

    def _nearest(self, at: tuple[int, ...]) -> float:
        logs = tuple(math.log2(max(v, 1)) for v in at)
        return min(
            self._logs, key=lambda pr: sum(abs(a - b) for a, b in zip(pr[0], logs, strict=True))
        )[1]


def gemm_dims(node: OpNode, weight_places: Sequence[str] = (), sizes: Sequence[int] = ()):
    """(m, k, n) of the forward GEMM of a linear layer (or 2-D mm) on one device: for each mesh
    axis that splits its compute (`sizes`), the weight's placement there (`weight_places`)
    names the split GEMM dim (a sharded weight: its output or reduction dim; a replicated one:
    the rows, i.e. batch or sequence). None for other ops."""
    from planner.placements import shard_dim

    traced = gemm_operands(node)
    if traced is None:
        return None
    x, w = traced
    if not x or len(w) != 2:
        return None
    m, k = math.prod(x[:-1]), x[-1]
    linear = node.op == "aten.linear.default"
    n = w[0] if linear else w[1]
    for place, size in zip(weight_places, sizes, strict=False):
        d = shard_dim(place)
        if d is None:
            m = max(m // size, 1)
        elif (d % 2 == 0) == linear:  # the output dim: (n, k) for linear, (k, n) for mm
            n = max(n // size, 1)
        else:
            k = max(k // size, 1)
    return (m, k, n) if m and k and n else None


def split_gemm(node: OpNode, weight_places: Sequence[str], sizes: Sequence[int]):
    """gemm_dims for a layout whose compute is split (None where nothing is split: the traced
    shape is then the local one)."""
    if node.op not in LINEAR_OPS or math.prod(sizes) <= 1:
        return None
    return gemm_dims(node, weight_places, sizes)


def gemm_operands(node: OpNode) -> tuple[list[int], list[int]] | None:
    """Traced (input, weight) shapes of a linear layer or a 2-D mm."""
    if node.op == "aten.linear.default" and node.inputs:
        name = linear_weight_name(node)
        weight = None if name is None else node.params.get(name)
        return None if weight is None else (list(node.inputs[0].shape), list(weight.shape))
    if node.op == "aten.mm.default" and len(node.inputs) == 2:
        return list(node.inputs[0].shape), list(node.inputs[1].shape)
    return None


def linear_weight_name(node: OpNode) -> str | None:
    """The parameter a linear layer multiplies by (its second operand), None if not one."""
    operands = node.attrs.get("operands") or []
    if len(operands) > 1 and operands[1][0] == "param":
        return operands[1][1]
    names = [p for p in node.params if len(node.params[p].shape) == 2]
    return names[0] if len(names) == 1 else None


def is_causal(node: OpNode) -> bool:
    args = node.attrs.get("args") or []
    kwargs = node.attrs.get("kwargs") or {}
    return bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))


def attention_key(node: OpNode, shards: int) -> tuple[int, int] | None:
    """(batch x heads per device, sequence) of a causal attention node with head dim 128 (the
    measured one); None otherwise."""
    if node.op not in ATTENTION_OPS or not node.inputs or not is_causal(node):
        return None
    q = node.inputs[0].shape
    if len(q) != 4 or q[-1] != 128:
        return None
    return max(q[0] * q[1] // max(shards, 1), 1), q[2]


@dataclass(frozen=True)
class RateTables:
    """A profile's measured rates for one dtype (empty grids where it has none)."""

    gemm: GridRates
    attention_fwd: GridRates  # in the trace's FLOP convention: the whole s x s product
    attention_bwd: GridRates  # backward counted twice the forward


_TABLES: OrderedDict[tuple[int, str], tuple[Any, RateTables]] = OrderedDict()
_KEEP = 8


def rate_tables(measured: Any, dtype: str) -> RateTables:
    """The tables of a profile's `measured` block, built once per block and dtype (the search
    builds a CostModel per configuration; profiles copied with other node counts share the
    block). The entry holds the block, so its id cannot be reused while cached."""
    key = (id(measured), dtype)
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is measured:
        _TABLES.move_to_end(key)
        return hit[1]
    points = [] if measured is None else measured.matmuls
    attention = [] if measured is None else measured.attention_times
    attention = [a for a in attention if a.dtype == dtype]
    tables = RateTables(
        GridRates([(tuple(p.shape), p.flops_per_s) for p in points if p.dtype == dtype]),
        GridRates([((a.batch_heads, a.seq), _attn_flops(a) / a.fwd_s) for a in attention]),
        GridRates([((a.batch_heads, a.seq), 2 * _attn_flops(a) / a.bwd_s) for a in attention]),
    )
    _TABLES[key] = (measured, tables)
    while len(_TABLES) > _KEEP:
        _TABLES.popitem(last=False)
    return tables


def _attn_flops(a: Any) -> float:
    """Forward FLOPs of attention as the trace counts them: q k^T and p v over all s x s."""
    return 4.0 * a.batch_heads * a.seq * a.seq * a.head_dim
