"""Inter-operator pass: split L layers into S pipeline stages (Alpa, section 5.2).

A pure function over cost arrays. For micro-batch count B the pipeline takes
    T = sum_s t_s + (B - 1) * max_s t_s
(GPipe/1F1B with per-micro-batch stage times t_s). Stage time t(i, j) = sum of layer times in
[i, j) + the first stage's extra (embedding) + the last stage's extra (head, loss) + a
per-stage constant (pipeline send/receive). Stage memory = static bytes (parameters,
optimizer state) + activation bytes x in-flight micro-batches of that stage (1F1B: S - s;
GPipe: B).

Alpa's recurrence fixes t_max, the slowest stage allowed, minimises sum_s t_s under it, and
scans t_max upwards. Here every stage pays the same constant, so sum_s t_s is the same for
every split (all layers + first + last + S x constant) and T(t_max) grows with t_max: the
best split is one whose slowest stage is as fast as memory allows. So the pass is a
bottleneck partition: binary search over the distinct stage times for the smallest t_max
under which some split fits, each test a reachability sweep over stages (which layer counts
can stages 0..s cover with every stage within t_max and its memory), O(S L log L) with numpy
instead of Alpa's O(S L^2) per t_max. Among the splits at the optimum it returns the one with
the latest stages largest (the first stages, which hold the most micro-batches in flight,
smallest).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_EPS = 1e-12  # relative slack for float sums compared with t_max and the capacity


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


def pipeline_total(stage_times: Sequence[float], microbatches: int) -> float:
    return sum(stage_times) + (microbatches - 1) * max(stage_times)


class _Sweep:
    """Prefix sums and, per t_max, the furthest end J_s(i) of a stage s starting at i: the
    memory limit per stage is worked out once, the time limit once per t_max."""

    def __init__(self, c: StageCosts, stages: int, inflight: Sequence[float]):
        n = c.num_layers
        self.c, self.n, self.stages = c, n, stages
        zeros = np.zeros(n)
        self.t = np.concatenate([[0.0], np.cumsum(np.asarray(c.layer_time, float))])
        st = np.concatenate([[0.0], np.cumsum(np.asarray(c.layer_static or zeros, float))])
        act = np.concatenate([[0.0], np.cumsum(np.asarray(c.layer_act or zeros, float))])
        self.overhead = c.stage_overhead if stages > 1 else 0.0
        i = self.starts = np.arange(n + 1)
        self.first = np.where(i == 0, c.first_time, 0.0)
        self.end_time = self.t[n] - self.t + self.overhead + self.first + c.last_time
        # Per stage: the furthest end memory allows (an end at n adds the last stage's part);
        # stages holding as many micro-batches share one.
        self.mem_limit = []
        limits: dict[float, np.ndarray] = {}
        for f in inflight:
            if f in limits:
                self.mem_limit.append(limits[f])
                continue
            mem = st + f * act
            first_m = np.where(i == 0, c.first_static + f * c.first_act, 0.0)
            budget = mem[i] + (c.capacity - first_m) * (1 + _EPS)
            j = np.searchsorted(mem, budget, side="right") - 1
            end_m = mem[n] - mem + first_m + c.last_static + f * c.last_act
            j = np.where((j >= n) & (end_m > c.capacity * (1 + _EPS)), n - 1, j)
            limits[f] = j
            self.mem_limit.append(j)
        # One limit for every stage: the furthest end from a start never depends on the
        # stage, so covering the layers greedily (each stage as far as it can go) uses the
        # fewest stages (the furthest end never falls as the start moves on, and a stage cut
        # shorter still fits): feasible() needs no reach sets.
        self.same_limits = len(limits) == 1

    def time(self, i: int, j: int) -> float:
        c = self.c
        t = self.t[j] - self.t[i] + self.overhead
        return t + (c.first_time if i == 0 else 0.0) + (c.last_time if j == self.n else 0.0)

    def time_limit(self, t_max: float) -> np.ndarray:
        """The furthest end t_max allows from every start."""
        budget = self.t + (t_max - self.overhead - self.first) * (1 + _EPS)
        j = np.searchsorted(self.t, budget, side="right") - 1
        return np.where((j >= self.n) & (self.end_time > t_max * (1 + _EPS)), self.n - 1, j)

    def furthest(self, s: int, t_max: float, by_time: np.ndarray | None = None) -> np.ndarray:
        """J_s(i) for every start i: the largest j with [i, j) within t_max and memory."""
        by_time = self.time_limit(t_max) if by_time is None else by_time
        return np.minimum(by_time, self.mem_limit[s])

    def feasible(self, t_max: float) -> bool:
        """Whether some split into the stages keeps every stage within t_max and memory."""
        if not self.same_limits:
            return self.reach(t_max) is not None
        far = np.minimum(self.time_limit(t_max), self.mem_limit[0]).tolist()
        start, used = 0, 0
        while start < self.n:
            end = far[start]
            if end <= start or used == self.stages:
                return False
            start, used = end, used + 1
        return True  # fewer stages than asked: any stage splits further within both limits

    def reach(self, t_max: float) -> list[np.ndarray] | None:
        """reach[s][j]: stages 0..s-1 can cover layers [0, j) (each stage non-empty, leaving
        a layer for every later stage); None when stage S cannot end at layer n."""
        n, stages = self.n, self.stages
        cur = np.zeros(n + 1, bool)
        cur[0] = True
        out = [cur]
        by_time = self.time_limit(t_max)
        for s in range(stages):
            j = np.where(cur, np.minimum(by_time, self.mem_limit[s]), -1)
            best = np.maximum.accumulate(j)  # furthest end from any start <= i
            nxt = np.zeros(n + 1, bool)
            nxt[1:] = best[:-1] >= self.starts[1:]  # some start < j reaches j
            nxt[n - (stages - s - 1) + 1 :] = False  # leave a layer per later stage
            if not nxt.any():
                return None
            out.append(nxt)
            cur = nxt
        return out if cur[n] else None


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
    sweep = _Sweep(costs, stages, inflight)
    times = _stage_times(sweep)
    # The slowest stage is at least the average one, and where an even split fits at most
    # its slowest stage: only the distinct stage times between are searched (sorted).
    average = (sweep.time(0, n) + (stages - 1) * sweep.overhead) / stages
    even = _even_split_time(sweep)
    low, high = average * (1 - 1e-9), math.inf if even is None else even * (1 + 1e-9)
    candidates = np.unique(times[(times >= low) & (times <= high)])
    lo, hi = 0, len(candidates)
    while lo < hi:
        mid = (lo + hi) // 2
        if sweep.feasible(float(candidates[mid])):
            hi = mid
        else:
            lo = mid + 1
    if lo >= len(candidates):  # none within: the next stage time past the even split's
        beyond = times[times > high]
        if not len(beyond):
            return None
        candidates, lo = np.array([beyond.min()]), 0
    reach = sweep.reach(float(candidates[lo]))
    if reach is None:
        return None
    ranges = _backtrack(sweep, float(candidates[lo]), reach)
    times = tuple(sweep.time(i, j) for i, j in ranges)
    return Partition(tuple(ranges), times, pipeline_total(times, microbatches))


def _even_split_time(sweep: _Sweep) -> float | None:
    """The slowest stage of layers split as evenly as they go (later stages take the one
    more), or None when that split does not fit in memory."""
    n, stages = sweep.n, sweep.stages
    base, extra = divmod(n, stages)
    ends = [0]
    for s in range(stages):
        ends.append(ends[-1] + base + (1 if s >= stages - extra else 0))
    if any(sweep.mem_limit[s][ends[s]] < ends[s + 1] for s in range(stages)):
        return None
    return max(sweep.time(ends[s], ends[s + 1]) for s in range(stages))


def _stage_times(sweep: _Sweep) -> np.ndarray:
    """Every stage time t(i, j), one per (i, j)."""
    c, n, t = sweep.c, sweep.n, sweep.t
    i, j = np.triu_indices(n + 1, k=1)
    times = t[j] - t[i] + sweep.overhead
    return times + np.where(i == 0, c.first_time, 0.0) + np.where(j == n, c.last_time, 0.0)


def _backtrack(sweep: _Sweep, t_max: float, reach: list[np.ndarray]) -> list[tuple[int, int]]:
    """From the last stage back: each stage starts at the earliest start that earlier stages
    reach and from which it can end where the next stage begins."""
    ranges = []
    end = sweep.n
    by_time = sweep.time_limit(t_max)
    for s in range(sweep.stages - 1, -1, -1):
        far = sweep.furthest(s, t_max, by_time)
        ok = reach[s][:end] & (far[:end] >= end)
        start = int(np.argmax(ok))
        ranges.append((start, end))
        end = start
    return ranges[::-1]
