"""Alpa's inter-operator pass in full (Zheng et al., OSDI'22, section 5.2): the layers split
into pipeline stages, each stage on its own submesh of the cluster with its own logical mesh.

A pure function over cost arrays, as planner.inter_op.stage_dp. The cluster is N nodes of M
devices; a stage runs on a submesh of shape (1, 2^k) inside a node (2^k < M) or (n, M), n
whole nodes, and the stages' submeshes use every device (Alpa proves that submeshes of these
shapes whose sizes add up to N x M always tile the cluster; `place` finds the tiling). Each
submesh size comes with options, one per logical mesh the caller prices (a (dp, tp) split of
the submesh, a ZeRO level, checkpointing): StageCosts per option, the stage time being the
option's layer times summed over the stage's range.

The pipeline takes T = sum_s t_s + (B - 1) max_s t_s for B micro-batches, plus what each
stage pays once a step (u_s: its gradient sync and optimizer step), added to the sum (an
upper bound of the step's max_s u_s, exact for one stage). Alpa's recurrence fixes t_max, the
slowest stage allowed, and minimises the sum:
    F(s, k, d) = min over options o (size n_o <= d) and ends j > k with t_o(k, j) <= t_max of
                 t_o(k, j) + u_o(k, j) + F(s - 1, j, d - n_o),       F(0, L, 0) = 0,
F(s, k, d) being layers [k, L) on d devices in s stages. A stage with s - 1 stages after it
holds inflight(s) micro-batches (1F1B: min(s, B); GPipe: B), so its memory is checked for
the s it is placed at. T(t_max) = min_s F(s, 0, D) + (B - 1) t_max, minimised over t_max.
t_max runs over the distinct stage times: the smallest feasible one found by bisection
(feasibility only grows with t_max), then upwards until (B - 1) t_max plus the least sum of
any split (F with no t_max) cannot beat the best found.
Exact: every t_max that can improve the optimum is tried (tests/planner/test_submesh_dp.py
checks it against enumeration of every split and assignment). The minimisation over j for
all k and d at once is a min-plus product per submesh size (numpy), options of one size
merged elementwise first: O(S x (options x L^2 + sizes x L^2 x D)) per t_max.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from planner.inter_op.stage_dp import StageCosts

_EPS = 1e-12


@dataclass(frozen=True)
class SubmeshOption:
    """One way to run a stage on a submesh of `devices` devices; `key` is the caller's. Per
    stage [k, j) as (L + 1) x (L + 1) arrays (rows k, columns j; inf where j <= k): `time`,
    its seconds per micro-batch (what t_max bounds); `once`, what it pays once a step (its
    gradient sync and optimizer step: added to the sum only); `static` and `acts`, its
    memory: static + inflight x acts must be at most `capacity`."""

    devices: int
    key: Hashable
    time: np.ndarray
    once: np.ndarray
    static: np.ndarray
    acts: np.ndarray
    capacity: float

    @property
    def num_layers(self) -> int:
        return self.time.shape[0] - 1

    @classmethod
    def additive(
        cls,
        devices: int,
        key: Hashable,
        costs: StageCosts,
        once: Sequence[float] | None = None,
        first_once: float = 0.0,
        last_once: float = 0.0,
    ) -> SubmeshOption:
        """Stage terms summed over its layers, as planner.inter_op.stage_dp prices them (the
        first stage adds what lies before the layers, the last what lies after; every stage
        but a lone one its send), with `once` per layer and at the two ends."""
        c, n = costs, costs.num_layers
        k, j = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
        first, last, zeros = k == 0, j == n, np.zeros(n)

        def spans(values, head: float, tail: float) -> np.ndarray:
            p = np.concatenate([[0.0], np.cumsum(np.asarray(values, float))])
            return p[j] - p[k] + np.where(first, head, 0.0) + np.where(last, tail, 0.0)

        t = spans(c.layer_time, c.first_time, c.last_time)
        t = np.where(j > k, t + np.where(first & last, 0.0, c.stage_overhead), math.inf)
        return cls(
            devices,
            key,
            t,
            spans(once if once is not None else zeros, first_once, last_once),
            spans(c.layer_static or zeros, c.first_static, c.last_static),
            spans(c.layer_act or zeros, c.first_act, c.last_act),
            c.capacity,
        )


@dataclass(frozen=True)
class Assignment:
    ranges: tuple[tuple[int, int], ...]  # layers per stage, [start, end), in pipeline order
    options: tuple[int, ...]  # per stage, the index of its SubmeshOption
    stage_times: tuple[float, ...]
    total: float  # sum + (B - 1) x max


def undominated(options: Sequence[SubmeshOption]) -> list[SubmeshOption]:
    """The options no other of the same size matches or beats on every stage's time, once
    term and memory (a dominated one is never the only best choice; of equal ones the first
    is kept)."""
    kept: list[SubmeshOption] = []
    for o in options:
        if any(_dominates(k, o) for k in kept if k.devices == o.devices):
            continue
        kept = [k for k in kept if k.devices != o.devices or not _dominates(o, k)]
        kept.append(o)
    return kept


def _dominates(a: SubmeshOption, b: SubmeshOption) -> bool:
    return bool(
        a.capacity >= b.capacity
        and np.all(a.time <= b.time)
        and np.all(a.once <= b.once)
        and np.all(a.static <= b.static)
        and np.all(a.acts <= b.acts)
    )


def submesh_sizes(nodes: int, per_node: int) -> list[int]:
    """The device counts of Alpa's submesh shapes: (1, 2^k) below a node, (n, M) above."""
    inside = [1 << k for k in range(per_node.bit_length()) if (1 << k) < per_node]
    return inside + [n * per_node for n in range(1, nodes + 1)]


def place(sizes: Sequence[int], nodes: int, per_node: int) -> list[int] | None:
    """The first device of each submesh (in the order given) tiling N x M devices: whole-node
    submeshes first from device 0, then the others largest first, each inside one node (sizes
    that are powers of two below M, packed largest first, never straddle a node). None when
    the sizes do not tile the cluster."""
    if sum(sizes) != nodes * per_node:
        return None
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    first = [0] * len(sizes)
    cursor = 0
    for i in order:
        n = sizes[i]
        if n < per_node and (n & (n - 1) or per_node % n):
            return None  # not one of Alpa's shapes
        if n >= per_node and n % per_node:
            return None
        if n < per_node and cursor // per_node != (cursor + n - 1) // per_node:
            return None
        first[i] = cursor
        cursor += n
    return first


def gpipe_inflight(microbatches: int) -> Callable[[int], float]:
    return lambda _s: float(microbatches)


def one_f_one_b_inflight(microbatches: int) -> Callable[[int], float]:
    """1F1B: the stage with s - 1 stages after it holds min(s, B) micro-batches."""
    return lambda s: float(min(s, microbatches))


class _Tables:
    """Per option: the time t and the weight t + u of stage [k, j) (inf where j <= k), and
    whether its memory fits with s stages from it to the end, per s."""

    def __init__(self, options: Sequence[SubmeshOption], max_stages: int, inflight):
        n = {o.num_layers for o in options}
        if len(n) != 1:
            raise ValueError("every option must price the same layers")
        self.n = n.pop()
        self.options = options
        self.sizes = sorted({o.devices for o in options})
        self.by_size = {
            size: [i for i, o in enumerate(options) if o.devices == size] for size in self.sizes
        }
        self.time = [o.time for o in options]
        self.weight = [o.time + o.once for o in options]
        self.fits = [
            [None]
            + [
                o.static + inflight(s) * o.acts <= o.capacity * (1 + _EPS)
                for s in range(1, max_stages + 1)
            ]
            for o in options
        ]
        # per size, the options stacked: best() takes the least weight over them at once
        self.stacked = {}
        # per size and s, the first s' <= s whose options fit exactly where they fit at s
        # (memory that does not bind at any s): best() is the same there
        self.fit_class: dict[int, list[int]] = {}
        for size, idx in self.by_size.items():
            fits = [
                None if s == 0 else np.stack([self.fits[i][s] for i in idx])
                for s in range(max_stages + 1)
            ]
            cls = [0]
            for s in range(1, max_stages + 1):
                same = s > 1 and np.array_equal(fits[s], fits[s - 1])
                cls.append(cls[s - 1] if same else s)
            self.fit_class[size] = cls
            self.stacked[size] = (
                np.stack([self.time[i] for i in idx]),
                np.stack([self.weight[i] for i in idx]),
                fits,
                np.asarray(idx),
            )

    def candidates(self) -> np.ndarray:
        """Every stage time some option has where it fits somewhere."""
        values = []
        for t, fits in zip(self.time, self.fits, strict=True):
            anywhere = np.logical_or.reduce(fits[1:])
            values.append(t[anywhere & np.isfinite(t)])
        values = [v for v in values if v.size]
        return np.unique(np.concatenate(values)) if values else np.empty(0)

    def best(self, size: int, s: int, t_max: float, keep: bool) -> tuple[np.ndarray, np.ndarray]:
        """Per (k, j), the least weight among the options of this size within t_max that
        fit at s, and (with `keep`) which option that is."""
        time, weight, fits, idx = self.stacked[size]
        w = np.where((time <= t_max * (1 + _EPS)) & fits[s], weight, math.inf)
        if not keep:
            return w.min(axis=0), idx[:0]
        which = w.argmin(axis=0)
        return np.take_along_axis(w, which[None], axis=0)[0], idx[which]


def _solve(tables: _Tables, devices: int, max_stages: int, t_max: float, keep: bool):
    """F(s, 0, D) for s = 1..max_stages under t_max, and the argmins when `keep`."""
    n, inf = tables.n, math.inf
    f_prev = np.full((n + 1, devices + 1), inf)
    f_prev[n, 0] = 0.0
    best_per_s = [inf]
    moves = []
    merged: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for s in range(1, max_stages + 1):
        f = np.full((n + 1, devices + 1), inf)
        arg_j = np.full(f.shape, -1)
        arg_o = np.full(f.shape, -1)
        for size in tables.sizes:
            if size > devices:
                continue
            cls = tables.fit_class[size][s]
            if (size, cls) not in merged:
                merged[size, cls] = tables.best(size, s, t_max, keep)
            a, which = merged[size, cls]
            # cand[k, j, d] = a[k, j] + f_prev[j, d - size], d from size to D
            cand = a[:, :, None] + f_prev[None, :, : devices + 1 - size]
            if not keep:
                np.minimum(f[:, size:], cand.min(axis=1), out=f[:, size:])
                continue
            j = np.argmin(cand, axis=1)
            val = np.take_along_axis(cand, j[:, None, :], axis=1)[:, 0, :]
            cur = f[:, size:]
            better = val < cur
            f[:, size:] = np.where(better, val, cur)
            if keep:
                option = np.take_along_axis(which, j, axis=1)
                arg_j[:, size:] = np.where(better, j, arg_j[:, size:])
                arg_o[:, size:] = np.where(better, option, arg_o[:, size:])
        best_per_s.append(float(f[0, devices]))
        if keep:
            moves.append((arg_j, arg_o))
        f_prev = f
    return best_per_s, moves


def assign_submeshes(
    options: Sequence[SubmeshOption],
    devices: int,
    microbatches: int,
    inflight: Callable[[int], float],
    max_stages: int | None = None,
    allowed_stages: Callable[[int], bool] | None = None,
    tolerance: float = 0.0,
) -> Assignment | None:
    """The split of the layers into stages and of `devices` into their submeshes (one
    option per stage) with the least pipeline time; None when nothing fits. `allowed_stages`
    may rule out stage counts (e.g. a schedule that needs m >= S). `tolerance` > 0 trades
    exactness for fewer t_max: consecutive t_max tried are at most tolerance x best / (B - 1)
    apart (Alpa's epsilon), so the answer is within that share of the optimum."""
    if not options:
        return None
    n = options[0].num_layers
    max_stages = min(max_stages or n, n, devices)
    tables = _Tables(options, max_stages, inflight)
    allowed = allowed_stages or (lambda _s: True)
    cands = tables.candidates()

    def total_at(t_max: float) -> tuple[float, int]:
        per_s, _ = _solve(tables, devices, max_stages, t_max, keep=False)
        best, stages = math.inf, 0
        for s in range(1, max_stages + 1):
            if allowed(s) and per_s[s] < best:
                best, stages = per_s[s], s
        return best, stages

    if not len(cands) or not math.isfinite(total_at(float(cands[-1]))[0]):
        return None
    # the least sum any split has, whatever its slowest stage: a t_max with (B - 1) t_max
    # plus it at or above the best total found cannot do better, nor can any larger one
    least_sum = total_at(float(cands[-1]))[0]
    lo, hi = 0, len(cands)
    while lo < hi:  # the smallest feasible t_max
        mid = (lo + hi) // 2
        if math.isfinite(total_at(float(cands[mid]))[0]):
            hi = mid
        else:
            lo = mid + 1
    if lo == len(cands):
        return None
    best_total, best_t, best_s = math.inf, 0.0, 0
    i = lo
    while i < len(cands):
        t_max = float(cands[i])
        if (microbatches - 1) * t_max + least_sum >= best_total * (1 + 1e-12):
            break
        summed, stages = total_at(t_max)
        if math.isfinite(summed):
            total = summed + (microbatches - 1) * t_max
            if total < best_total * (1 - 1e-12):
                best_total, best_t, best_s = total, t_max, stages
        i += 1
        if tolerance > 0 and microbatches > 1 and math.isfinite(best_total) and i < len(cands):
            # the largest t_max within the gap from this one (a split whose slowest stage
            # lies between is priced at most gap x (B - 1) above its total there)
            gap = tolerance * best_total / (microbatches - 1)
            far = int(np.searchsorted(cands, t_max + gap, side="right")) - 1
            i = max(i, far)
    return _backtrack(tables, options, devices, max_stages, best_t, best_s, microbatches)


def _backtrack(tables, options, devices, max_stages, t_max, stages, microbatches) -> Assignment:
    _, moves = _solve(tables, devices, max_stages, t_max, keep=True)
    ranges, picked = [], []
    k, d = 0, devices
    for s in range(stages, 0, -1):
        arg_j, arg_o = moves[s - 1]
        j, option = int(arg_j[k, d]), int(arg_o[k, d])
        ranges.append((k, j))
        picked.append(option)
        k, d = j, d - options[option].devices
    assert k == tables.n and d == 0, "the backtrack ends at the last layer on no devices left"
    times = [float(tables.time[o][a, b]) for o, (a, b) in zip(picked, ranges, strict=True)]
    weights = [float(tables.weight[o][a, b]) for o, (a, b) in zip(picked, ranges, strict=True)]
    total = sum(weights) + (microbatches - 1) * max(times)
    return Assignment(tuple(ranges), tuple(picked), tuple(times), total)
