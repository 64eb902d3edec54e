"""Inter-operator pass: split L layers into S pipeline stages (Alpa, section 5.2).

A pure function over cost arrays. For micro-batch count B the pipeline takes
    T = sum_s t_s + (B - 1) * max_s t_s
(GPipe/1F1B with per-micro-batch stage times t_s). Alpa's recurrence fixes t_max, the slowest
stage allowed, and solves
    F(s, j) = min_{i < j} F(s - 1, i) + t(i, j)   over stages with t(i, j) <= t_max and
                                                  memory(s - 1, i, j) <= capacity,
then T(t_max) = F(S, L) + (B - 1) t_max; t_max runs over the distinct stage times in increasing
order and stops once (B - 1) t_max alone reaches the best T found (early pruning).
Stage time t(i, j) = sum of layer times in [i, j) + the first stage's extra (embedding) + the
last stage's extra (head, loss) + a per-stage constant (pipeline send/receive).
Stage memory = static bytes (parameters, optimizer state) + activation bytes x in-flight
micro-batches of that stage (1F1B: S - s; GPipe: B).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageCosts:
    layer_time: Sequence[float]
    layer_static: Sequence[float] | None = None  # bytes per layer that do not grow with B
    layer_act: Sequence[float] | None = None  # activation bytes per layer per micro-batch
    first_time: float = 0.0
    last_time: float = 0.0
    first_static: float = 0.0
    last_static: float = 0.0
    first_act: float = 0.0
    last_act: float = 0.0
    stage_overhead: float = 0.0  # added to every stage when S > 1 (p2p)
    capacity: float = math.inf

    @property
    def num_layers(self) -> int:
        return len(self.layer_time)


@dataclass(frozen=True)
class Partition:
    ranges: tuple[tuple[int, int], ...]
    stage_times: tuple[float, ...]
    total: float


def _prefix(values: Sequence[float] | None, n: int) -> list[float]:
    out = [0.0]
    for i in range(n):
        out.append(out[-1] + (values[i] if values is not None else 0.0))
    return out


class _Model:
    def __init__(self, c: StageCosts, stages: int, inflight: Sequence[float]):
        n = c.num_layers
        self.c, self.n, self.stages, self.inflight = c, n, stages, inflight
        self.t = _prefix(c.layer_time, n)
        self.st = _prefix(c.layer_static, n)
        self.act = _prefix(c.layer_act, n)

    def time(self, i: int, j: int) -> float:
        c = self.c
        t = self.t[j] - self.t[i] + (c.stage_overhead if self.stages > 1 else 0.0)
        if i == 0:
            t += c.first_time
        if j == self.n:
            t += c.last_time
        return t

    def memory(self, s: int, i: int, j: int) -> float:
        c = self.c
        static = self.st[j] - self.st[i]
        act = self.act[j] - self.act[i]
        if i == 0:
            static, act = static + c.first_static, act + c.first_act
        if j == self.n:
            static, act = static + c.last_static, act + c.last_act
        return static + act * self.inflight[s]


def pipeline_total(stage_times: Sequence[float], microbatches: int) -> float:
    return sum(stage_times) + (microbatches - 1) * max(stage_times)


def partition_stages(
    costs: StageCosts,
    stages: int,
    microbatches: int,
    inflight: Sequence[float] | None = None,
) -> Partition | None:
    """The best split into `stages` contiguous non-empty stages, or None if none fits."""
    n = costs.num_layers
    if stages < 1 or stages > n:
        return None
    inflight = inflight if inflight is not None else [stages - s for s in range(stages)]
    model = _Model(costs, stages, inflight)
    feasible = {
        (s, i, j): model.memory(s, i, j) <= costs.capacity
        for s in range(stages)
        for i in range(n)
        for j in range(i + 1, n + 1)
    }
    candidates = sorted({model.time(i, j) for i in range(n) for j in range(i + 1, n + 1)})
    # Feasibility only grows with t_max, and the slowest stage is at least the average one:
    # binary-search the smallest feasible t_max, then scan upwards with Alpa's pruning.
    average = model.time(0, n) + (stages - 1) * (costs.stage_overhead if stages > 1 else 0.0)
    lo = next((k for k, t in enumerate(candidates) if t * stages >= average - 1e-12), 0)
    hi = len(candidates)
    while lo < hi:
        mid = (lo + hi) // 2
        if _best_sum(model, stages, candidates[mid], feasible) is None:
            lo = mid + 1
        else:
            hi = mid
    best: Partition | None = None
    for t_max in candidates[lo:]:
        if best is not None and (microbatches - 1) * t_max >= best.total:
            break
        found = _best_sum(model, stages, t_max, feasible)
        if found is None:
            continue
        ranges = found
        times = tuple(model.time(i, j) for i, j in ranges)
        total = pipeline_total(times, microbatches)
        if best is None or total < best.total - 1e-15:
            best = Partition(tuple(ranges), times, total)
    return best


def _best_sum(model: _Model, stages: int, t_max: float, feasible) -> list[tuple[int, int]] | None:
    n = model.n
    inf = math.inf
    f = [[inf] * (n + 1) for _ in range(stages + 1)]
    back = [[-1] * (n + 1) for _ in range(stages + 1)]
    f[0][0] = 0.0
    for s in range(1, stages + 1):
        # Stage s-1 must leave at least one layer for each later stage.
        for j in range(s, n - (stages - s) + 1):
            best, arg = inf, -1
            for i in range(s - 1, j):
                if f[s - 1][i] == inf or not feasible[(s - 1, i, j)]:
                    continue
                t = model.time(i, j)
                if t > t_max + 1e-15:
                    continue
                value = f[s - 1][i] + t
                if value < best:
                    best, arg = value, i
            f[s][j], back[s][j] = best, arg
    if f[stages][n] == inf:
        return None
    ranges = []
    j = n
    for s in range(stages, 0, -1):
        i = back[s][j]
        ranges.append((i, j))
        j = i
    return ranges[::-1]
