"""Alpa's inter-operator pass in full (Zheng et al., OSDI'22, section 5.2): the layers split
into pipeline stages, each stage on its own submesh of the cluster with its own logical mesh.

A pure function over cost arrays, as planner.inter_op.stage_dp. The cluster is N nodes of M
devices; a stage runs on a submesh of shape (1, 2^k) inside a node (2^k < M) or (n, M), n
whole nodes, and the stages' submeshes use every device (Alpa proves that submeshes of these
shapes whose sizes add up to N x M always tile the cluster; `place` finds the tiling). Each
submesh size comes with options, one per logical mesh the caller prices (a (dp, tp) split of
the submesh, a ZeRO level, checkpointing): StageCosts per option, the stage time being the
option's layer times summed over the stage's range.

The pipeline takes T = sum_s t_s + (B - 1) max_s t_s for B micro-batches. Alpa's recurrence
fixes t_max, the slowest stage allowed, and minimises the sum:
    F(s, k, d) = min over options o (size n_o <= d) and ends j > k with t_o(k, j) <= t_max of
                 t_o(k, j) + F(s - 1, j, d - n_o),       F(0, L, 0) = 0,
F(s, k, d) being layers [k, L) on d devices in s stages. A stage with s - 1 stages after it
holds inflight(s) micro-batches (1F1B: min(s, B); GPipe: B), so its memory is checked for
the s it is placed at. T(t_max) = min_s F(s, 0, D) + (B - 1) t_max, minimised over t_max.
t_max runs over the distinct stage times: the smallest feasible one found by bisection
(feasibility only grows with t_max), then upwards until (B - 1) t_max plus a lower bound of
any split's summed stage times (each layer at its fastest option) cannot beat the best found.
Exact: every t_max that can improve the optimum is tried (tests/planner/test_submesh_dp.py
checks it against enumeration of every split and assignment). The minimisation over j for
all k and d at once is a min-plus product per submesh size (numpy), options of one size
merged elementwise first: O(S x sizes x L^2 x D) per t_max.
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
    """One way to run a stage on a submesh of `devices` devices; `key` is the caller's."""

    devices: int
    key: Hashable
    costs: StageCosts


@dataclass(frozen=True)
class Assignment:
    ranges: tuple[tuple[int, int], ...]  # layers per stage, [start, end), in pipeline order
    options: tuple[int, ...]  # per stage, the index of its SubmeshOption
    stage_times: tuple[float, ...]
    total: float  # sum + (B - 1) x max


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
    """Per submesh size, per stages-left s: the time of stage [k, j) at its best option
    whose memory fits (inf where none), and which option that is."""

    def __init__(self, options: Sequence[SubmeshOption], max_stages: int, inflight):
        self.sizes = sorted({o.devices for o in options})
        n = {o.costs.num_layers for o in options}
        if len(n) != 1:
            raise ValueError("every option must price the same layers")
        self.n = n.pop()
        k, j = np.meshgrid(np.arange(self.n + 1), np.arange(self.n + 1), indexing="ij")
        valid = j > k
        self.time: dict[int, list[np.ndarray]] = {}
        self.choice: dict[int, list[np.ndarray]] = {}
        self.lower = math.inf  # no split's summed stage times are below it
        per_layer = np.full(self.n, math.inf)
        ends = [math.inf, math.inf]
        for size in self.sizes:
            self.time[size], self.choice[size] = [], []
            mine = [(i, o) for i, o in enumerate(options) if o.devices == size]
            stage_t, mem = [], []
            for _, o in mine:
                c = o.costs
                t = np.concatenate([[0.0], np.cumsum(np.asarray(c.layer_time, float))])
                zeros = np.zeros(self.n)
                st = np.concatenate([[0.0], np.cumsum(np.asarray(c.layer_static or zeros, float))])
                act = np.concatenate([[0.0], np.cumsum(np.asarray(c.layer_act or zeros, float))])
                span = t[j] - t[k] + np.where(k == 0, c.first_time, 0.0)
                span = span + np.where(j == self.n, c.last_time, 0.0)
                # every stage sends and receives but a single one holding all layers
                span = span + np.where((k == 0) & (j == self.n), 0.0, c.stage_overhead)
                stage_t.append(np.where(valid, span, math.inf))
                static = st[j] - st[k] + np.where(k == 0, c.first_static, 0.0)
                static = static + np.where(j == self.n, c.last_static, 0.0)
                acts = act[j] - act[k] + np.where(k == 0, c.first_act, 0.0)
                acts = acts + np.where(j == self.n, c.last_act, 0.0)
                mem.append((static, acts, c.capacity))
                per_layer = np.minimum(per_layer, np.asarray(c.layer_time, float))
                ends = [min(ends[0], c.first_time), min(ends[1], c.last_time)]
            for s in range(max_stages + 1):
                if s == 0:
                    self.time[size].append(np.full_like(stage_t[0], math.inf))
                    self.choice[size].append(np.full(stage_t[0].shape, -1))
                    continue
                f = inflight(s)
                best = np.full_like(stage_t[0], math.inf)
                which = np.full(best.shape, -1)
                for (idx, _), t, (static, acts, cap) in zip(mine, stage_t, mem, strict=True):
                    fits = static + f * acts <= cap * (1 + _EPS)
                    cand = np.where(fits, t, math.inf)
                    better = cand < best
                    best = np.where(better, cand, best)
                    which = np.where(better, idx, which)
                self.time[size].append(best)
                self.choice[size].append(which)
        self.lower = float(per_layer.sum()) + sum(ends)

    def candidates(self) -> np.ndarray:
        values = [t[np.isfinite(t)] for ts in self.time.values() for t in ts[1:]]
        values = [v for v in values if v.size]
        return np.unique(np.concatenate(values)) if values else np.empty(0)


def _solve(tables: _Tables, devices: int, max_stages: int, t_max: float, keep: bool):
    """F(s, 0, D) for s = 1..max_stages under t_max, and the argmins when `keep`."""
    n, inf = tables.n, math.inf
    f_prev = np.full((n + 1, devices + 1), inf)
    f_prev[n, 0] = 0.0
    best_per_s = [inf]
    moves = []
    for s in range(1, max_stages + 1):
        f = np.full((n + 1, devices + 1), inf)
        arg_j = np.full(f.shape, -1) if keep else None
        arg_size = np.full(f.shape, -1) if keep else None
        for size in tables.sizes:
            if size > devices:
                continue
            a = tables.time[size][s]
            a = np.where(a <= t_max * (1 + _EPS), a, inf)
            # cand[k, j, d] = a[k, j] + f_prev[j, d - size], d from size to D
            cand = a[:, :, None] + f_prev[None, :, : devices + 1 - size]
            j = np.argmin(cand, axis=1)
            val = np.take_along_axis(cand, j[:, None, :], axis=1)[:, 0, :]
            cur = f[:, size:]
            better = val < cur
            f[:, size:] = np.where(better, val, cur)
            if keep:
                arg_j[:, size:] = np.where(better, j, arg_j[:, size:])
                arg_size[:, size:] = np.where(better, size, arg_size[:, size:])
        best_per_s.append(float(f[0, devices]))
        if keep:
            moves.append((arg_j, arg_size))
        f_prev = f
    return best_per_s, moves


def assign_submeshes(
    options: Sequence[SubmeshOption],
    devices: int,
    microbatches: int,
    inflight: Callable[[int], float],
    max_stages: int | None = None,
    allowed_stages: Callable[[int], bool] | None = None,
) -> Assignment | None:
    """The split of the layers into stages and of `devices` into their submeshes (one
    option per stage) with the least pipeline time; None when nothing fits. `allowed_stages`
    may rule out stage counts (e.g. a schedule that needs m >= S)."""
    if not options:
        return None
    n = options[0].costs.num_layers
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
    for t_max in cands[lo:]:
        t_max = float(t_max)
        if (microbatches - 1) * t_max + tables.lower >= best_total * (1 + 1e-12):
            break
        summed, stages = total_at(t_max)
        if not math.isfinite(summed):
            continue
        total = summed + (microbatches - 1) * t_max
        if total < best_total * (1 - 1e-12):
            best_total, best_t, best_s = total, t_max, stages
    return _backtrack(tables, options, devices, max_stages, best_t, best_s, microbatches)


def _backtrack(tables, options, devices, max_stages, t_max, stages, microbatches) -> Assignment:
    _, moves = _solve(tables, devices, max_stages, t_max, keep=True)
    ranges, picked, times = [], [], []
    k, d = 0, devices
    for s in range(stages, 0, -1):
        arg_j, arg_size = moves[s - 1]
        j, size = int(arg_j[k, d]), int(arg_size[k, d])
        option = int(tables.choice[size][s][k, j])
        ranges.append((k, j))
        picked.append(option)
        times.append(float(tables.time[size][s][k, j]))
        k, d = j, d - size
    assert k == tables.n and d == 0, "the backtrack ends at the last layer on no devices left"
    total = sum(times) + (microbatches - 1) * max(times)
    return Assignment(tuple(ranges), tuple(picked), tuple(times), total)
