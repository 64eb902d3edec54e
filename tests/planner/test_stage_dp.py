import random

import pytest

from planner.stage_dp import StageCosts, brute_force, partition_stages


@pytest.mark.parametrize("seed", range(60))
def test_stage_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    stages = rng.randint(1, n)
    costs = StageCosts(
        layer_time=[rng.uniform(0.1, 5) for _ in range(n)],
        layer_static=[rng.uniform(0, 10) for _ in range(n)],
        layer_act=[rng.uniform(0, 3) for _ in range(n)],
        first_time=rng.uniform(0, 3),
        last_time=rng.uniform(0, 3),
        first_static=rng.uniform(0, 5),
        last_act=rng.uniform(0, 2),
        stage_overhead=rng.uniform(0, 0.5),
        capacity=rng.uniform(10, 60) if rng.random() < 0.7 else float("inf"),
    )
    microbatches = rng.randint(1, 16)
    expected = brute_force(costs, stages, microbatches)
    got = partition_stages(costs, stages, microbatches)
    if expected is None:
        assert got is None
    else:
        assert got is not None
        assert got.total == pytest.approx(expected.total, rel=1e-12)
        assert [r[0] for r in got.ranges] == sorted(r[0] for r in got.ranges)
        assert got.ranges[0][0] == 0 and got.ranges[-1][1] == n


def test_uniform_layers_split_evenly():
    got = partition_stages(StageCosts(layer_time=[1.0] * 12), 4, 8)
    assert got.ranges == ((0, 3), (3, 6), (6, 9), (9, 12))
    assert got.total == pytest.approx((8 + 4 - 1) * 3)


def test_heavy_head_gets_fewer_layers():
    got = partition_stages(StageCosts(layer_time=[1.0] * 8, last_time=2.0), 2, 16)
    assert got.ranges == ((0, 5), (5, 8))
