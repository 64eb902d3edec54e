import itertools
import random

import pytest

from planner.inter_op.stage_dp import StageCosts, partition_stages


def brute_force(c: StageCosts, stages: int, microbatches: int, inflight=None) -> float | None:
    """The best pipeline time over every split of the layers into `stages` parts, written
    from the cost model's definition (module docstring of stage_dp) with plain sums: stage
    time = its layers + embedding on the first + head on the last + the p2p constant; stage
    memory = static + activations x in-flight micro-batches (1F1B: stages - s);
    T = sum of stage times + (B - 1) x the slowest. None when no split fits."""
    n = len(c.layer_time)
    static = c.layer_static or [0.0] * n
    act = c.layer_act or [0.0] * n
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        times, fits = [], True
        for s in range(stages):
            lo, hi = bounds[s], bounds[s + 1]
            first, last = lo == 0, hi == n
            t = sum(c.layer_time[lo:hi]) + (c.stage_overhead if stages > 1 else 0.0)
            t += (c.first_time if first else 0.0) + (c.last_time if last else 0.0)
            mem_static = sum(static[lo:hi]) + (c.first_static if first else 0.0)
            mem_static += c.last_static if last else 0.0
            mem_act = sum(act[lo:hi]) + (c.first_act if first else 0.0)
            mem_act += c.last_act if last else 0.0
            held = inflight[s] if inflight else stages - s
            fits = fits and mem_static + mem_act * held <= c.capacity
            times.append(t)
        if fits:
            total = sum(times) + (microbatches - 1) * max(times)
            best = total if best is None else min(best, total)
    return best


def _random_costs(rng: random.Random, n: int, capacity: tuple[float, float]) -> StageCosts:
    """n layers of random time and memory; a random capacity within `capacity`, or none."""
    return StageCosts(
        layer_time=[rng.uniform(0.1, 5) for _ in range(n)],
        layer_static=[rng.uniform(0, 10) for _ in range(n)],
        layer_act=[rng.uniform(0, 3) for _ in range(n)],
        first_time=rng.uniform(0, 3),
        last_time=rng.uniform(0, 3),
        first_static=rng.uniform(0, 5),
        last_act=rng.uniform(0, 2),
        stage_overhead=rng.uniform(0, 0.5),
        capacity=rng.uniform(*capacity) if rng.random() < 0.7 else float("inf"),
    )


@pytest.mark.parametrize("seed", range(60))
def test_stage_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    stages = rng.randint(1, n)
    costs = _random_costs(rng, n, (10, 60))
    microbatches = rng.randint(1, 16)
    expected = brute_force(costs, stages, microbatches)
    got = partition_stages(costs, stages, microbatches)
    if expected is None:
        assert got is None
    else:
        assert got is not None
        assert got.total == pytest.approx(expected, rel=1e-12)
        assert [r[0] for r in got.ranges] == sorted(r[0] for r in got.ranges)
        assert got.ranges[0][0] == 0 and got.ranges[-1][1] == n


@pytest.mark.parametrize("seed", range(40))
def test_stage_dp_with_any_inflight_counts_equals_brute_force(seed):
    """Deeper splits, uneven in-flight counts (GPipe holds every micro-batch), tight memory,
    and the split returned is one of those brute force finds optimal and fitting."""
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 11)
    stages = rng.randint(1, min(n, 6))
    uniform = rng.random() < 0.4
    costs = StageCosts(
        layer_time=[1.0] * n if uniform else [rng.uniform(0.1, 5) for _ in range(n)],
        layer_static=[rng.uniform(0, 10) for _ in range(n)],
        layer_act=[rng.uniform(0, 3) for _ in range(n)],
        first_time=rng.uniform(0, 3),
        last_time=rng.uniform(0, 3),
        first_static=rng.uniform(0, 5),
        last_static=rng.uniform(0, 5),
        first_act=rng.uniform(0, 2),
        last_act=rng.uniform(0, 2),
        stage_overhead=rng.uniform(0, 0.5),
        capacity=rng.uniform(15, 80),
    )
    microbatches = rng.randint(1, 16)
    inflight = [rng.choice([microbatches, stages - s, 1]) for s in range(stages)]
    expected = brute_force(costs, stages, microbatches, inflight)
    got = partition_stages(costs, stages, microbatches, inflight)
    if expected is None:
        assert got is None
        return
    assert got is not None and got.total == pytest.approx(expected, rel=1e-12)
    bounds = [a for a, _ in got.ranges] + [n]
    assert bounds == sorted(set(bounds)) and bounds[0] == 0
    for s, (a, b) in enumerate(got.ranges):
        static = sum(costs.layer_static[a:b]) + (costs.first_static if a == 0 else 0)
        static += costs.last_static if b == n else 0
        act = sum(costs.layer_act[a:b]) + (costs.first_act if a == 0 else 0)
        act += costs.last_act if b == n else 0
        assert static + act * inflight[s] <= costs.capacity * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(40))
def test_stage_dp_with_equal_inflight_counts_equals_brute_force(seed):
    """Every stage holding as many micro-batches (GPipe's, and the chunk split's one each,
    memory aside or not): the case where the DP covers the layers greedily."""
    rng = random.Random(2000 + seed)
    n = rng.randint(2, 11)
    stages = rng.randint(1, min(n, 6))
    costs = _random_costs(rng, n, (15, 80))
    microbatches = rng.randint(1, 16)
    inflight = [rng.choice([1, microbatches])] * stages
    expected = brute_force(costs, stages, microbatches, inflight)
    got = partition_stages(costs, stages, microbatches, inflight)
    if expected is None:
        assert got is None
    else:
        assert got is not None and got.total == pytest.approx(expected, rel=1e-12)


def test_uniform_layers_split_evenly():
    got = partition_stages(StageCosts(layer_time=[1.0] * 12), 4, 8)
    assert got.ranges == ((0, 3), (3, 6), (6, 9), (9, 12))
    assert got.total == pytest.approx((8 + 4 - 1) * 3)


def test_heavy_head_gets_fewer_layers():
    got = partition_stages(StageCosts(layer_time=[1.0] * 8, last_time=2.0), 2, 16)
    assert got.ranges == ((0, 5), (5, 8))
