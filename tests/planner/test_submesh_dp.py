"""The stage-submesh DP (planner.inter_op.submesh_dp) against enumeration of every split of
the layers into stages, every submesh size per stage and every option per submesh, on
clusters of up to 8 devices. The checker below is written from Alpa's formulation, not from
the DP: it lists whole assignments and prices each one directly."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

import pytest

from planner.inter_op.stage_dp import StageCosts
from planner.inter_op.submesh_dp import (
    SubmeshOption,
    assign_submeshes,
    gpipe_inflight,
    one_f_one_b_inflight,
    place,
    submesh_sizes,
)


def _alpa_shapes(nodes: int, per_node: int) -> set[int]:
    shapes = set()
    k = 1
    while k < per_node:
        shapes.add(k)  # (1, 2^k) inside a node
        k *= 2
    shapes.update(n * per_node for n in range(1, nodes + 1))  # (n, M)
    return shapes


@dataclass(frozen=True)
class Spec:
    """An option as the checker reads it: per-layer terms, summed by the checker itself."""

    devices: int
    key: object
    costs: StageCosts
    once: list[float] | None = None
    first_once: float = 0.0
    last_once: float = 0.0

    def option(self) -> SubmeshOption:
        args = (self.once, self.first_once, self.last_once)
        return SubmeshOption.additive(self.devices, self.key, self.costs, *args)


def _stage_time(c: StageCosts, a: int, b: int, n: int, single: bool) -> float:
    t = sum(c.layer_time[a:b])
    t += c.first_time if a == 0 else 0.0
    t += c.last_time if b == n else 0.0
    return t + (0.0 if single else c.stage_overhead)


def _stage_once(sp: Spec, a: int, b: int, n: int) -> float:
    u = sum(sp.once[a:b]) if sp.once else 0.0
    return u + (sp.first_once if a == 0 else 0.0) + (sp.last_once if b == n else 0.0)


def _stage_fits(c: StageCosts, a: int, b: int, n: int, inflight: float) -> bool:
    static = sum(c.layer_static[a:b]) + (c.first_static if a == 0 else 0.0)
    static += c.last_static if b == n else 0.0
    acts = sum(c.layer_act[a:b]) + (c.first_act if a == 0 else 0.0)
    acts += c.last_act if b == n else 0.0
    return static + inflight * acts <= c.capacity * (1 + 1e-12)


def _total(specs, ranges, picked, n, microbatches, inflight) -> float:
    """The objective of one assignment, inf where a stage does not fit."""
    stages = len(ranges)
    times, once = [], 0.0
    for pos, ((a, b), i) in enumerate(zip(ranges, picked, strict=True)):
        c = specs[i].costs
        if not _stage_fits(c, a, b, n, inflight(stages - pos)):
            return math.inf
        times.append(_stage_time(c, a, b, n, stages == 1))
        once += _stage_once(specs[i], a, b, n)
    return once + sum(times) + (microbatches - 1) * max(times)


def _brute_force(specs, nodes, per_node, microbatches, inflight):
    n = specs[0].costs.num_layers
    devices = nodes * per_node
    shapes = _alpa_shapes(nodes, per_node)
    best = math.inf
    for stages in range(1, min(n, devices) + 1):
        for cuts in itertools.combinations(range(1, n), stages - 1):
            bounds = [0, *cuts, n]
            ranges = list(itertools.pairwise(bounds))
            for picked in itertools.product(range(len(specs)), repeat=stages):
                sizes = [specs[i].devices for i in picked]
                if sum(sizes) != devices or any(s not in shapes for s in sizes):
                    continue
                best = min(best, _total(specs, ranges, picked, n, microbatches, inflight))
    return best


def _random_specs(rng: random.Random, layers: int, nodes: int, per_node: int) -> list[Spec]:
    """Layers of different work and different scaling with the devices (a layer's exponent
    from 0.2, mostly communication, to 1, perfect), each option's speed jittered; most
    options pay something once a step."""
    out = []
    capacity = rng.uniform(6.0, 14.0)
    work = [rng.uniform(0.5, 3.0) for _ in range(layers)]
    scaling = [rng.uniform(0.2, 1.0) for _ in range(layers)]
    for size in sorted(_alpa_shapes(nodes, per_node)):
        tp = 1
        while tp <= min(size, per_node):
            jitter = rng.uniform(0.8, 1.2)
            costs = StageCosts(
                layer_time=[w * jitter / size**a for w, a in zip(work, scaling, strict=True)],
                layer_static=[rng.uniform(0.5, 2.0) / tp for _ in range(layers)],
                layer_act=[rng.uniform(0.1, 0.6) / size for _ in range(layers)],
                first_time=rng.uniform(0, 1) * jitter / size,
                last_time=rng.uniform(0, 2) * jitter / size,
                first_static=rng.uniform(0, 1),
                last_static=rng.uniform(0, 2),
                stage_overhead=rng.uniform(0, 0.2),
                capacity=capacity,
            )
            key = (size // tp, tp)
            if rng.random() < 0.3:
                out.append(Spec(size, key, costs))
            else:
                once = [rng.uniform(0, 0.5) * (tp / size) for _ in range(layers)]
                out.append(Spec(size, key, costs, once, rng.uniform(0, 0.3), 0.1))
            tp *= 2
    return out


CLUSTERS = [(1, 2), (1, 4), (2, 2), (1, 8), (2, 4), (4, 2)]
SEEDS = 40


@pytest.mark.parametrize("seed", range(SEEDS))
def test_dp_optimum_equals_enumeration(seed):
    rng = random.Random(seed)
    nodes, per_node = CLUSTERS[seed % len(CLUSTERS)]
    layers = rng.randint(2, 5)
    microbatches = rng.choice([1, 3, 8, 16, 32])
    specs = _random_specs(rng, layers, nodes, per_node)
    schedule = gpipe_inflight if seed % 3 == 0 else one_f_one_b_inflight
    inflight = schedule(microbatches)
    expected = _brute_force(specs, nodes, per_node, microbatches, inflight)
    found = assign_submeshes(
        [sp.option() for sp in specs], nodes * per_node, microbatches, inflight
    )
    if math.isinf(expected):
        assert found is None
        return
    assert found is not None
    assert found.total == pytest.approx(expected, rel=1e-9)
    # what it returns is an assignment that tiles the cluster and costs what it says
    assert place([specs[i].devices for i in found.options], nodes, per_node) is not None
    assert [a for a, _ in found.ranges] == [0] + [b for _, b in found.ranges[:-1]]
    assert found.ranges[-1][1] == layers
    total = _total(specs, found.ranges, found.options, layers, microbatches, inflight)
    assert total == pytest.approx(found.total, rel=1e-9)
    # with Alpa's epsilon on the t_max steps: within that share of the optimum
    options = [sp.option() for sp in specs]
    coarse = assign_submeshes(options, nodes * per_node, microbatches, inflight, tolerance=0.05)
    assert expected * (1 - 1e-9) <= coarse.total <= expected * 1.05


def test_some_random_cases_use_different_submeshes_per_stage():
    """The cases above are not all answered by one submesh size."""
    mixed = 0
    for seed in range(SEEDS):
        rng = random.Random(seed)
        nodes, per_node = CLUSTERS[seed % len(CLUSTERS)]
        layers = rng.randint(2, 5)
        microbatches = rng.choice([1, 3, 8, 16, 32])
        options = [sp.option() for sp in _random_specs(rng, layers, nodes, per_node)]
        found = assign_submeshes(
            options, nodes * per_node, microbatches, one_f_one_b_inflight(microbatches)
        )
        if found and len({options[i].devices for i in found.options}) > 1:
            mixed += 1
    assert mixed >= 3


def test_a_heavy_layer_gets_a_larger_submesh_than_light_ones():
    """Layer 0 scales with its devices (8 / n s); layers 1 and 2 do not, and pay 0.05 s per
    device (a collective): on a node of 8 with 16 micro-batches, the heavy layer on (1, 4)
    and each light one on (1, 2) gives stages of 2, 0.6 and 0.6 s: 3.2 + 15 x 2 = 33.2 s,
    against 2.8 x 16 = 44.8 s for the model on all 8 and 3.4 + 15 x 2 = 33.4 s for 4 + 4."""

    def costs(size: int) -> StageCosts:
        light = 0.5 + 0.05 * size
        return StageCosts(layer_time=[8.0 / size, light, light], capacity=math.inf)

    options = [SubmeshOption.additive(s, s, costs(s)) for s in submesh_sizes(1, 8)]
    found = assign_submeshes(options, 8, 16, one_f_one_b_inflight(16))
    assert found.total == pytest.approx(33.2)
    assert [options[i].devices for i in found.options] == [4, 2, 2]
    assert found.ranges == ((0, 1), (1, 2), (2, 3))


def test_memory_limits_the_first_stage_by_its_inflight_microbatches():
    """The first of S stages holds S micro-batches under 1F1B and m under GPipe: with room
    for 2 micro-batches of a layer's activations, 1F1B fits 2 stages, GPipe with m = 4 none."""
    costs = StageCosts(layer_time=[1.0, 1.0], layer_act=[1.0, 1.0], capacity=2.0)
    options = [SubmeshOption.additive(1, "one", costs)]
    assert assign_submeshes(options, 2, 4, one_f_one_b_inflight(4)).ranges == ((0, 1), (1, 2))
    assert assign_submeshes(options, 2, 4, gpipe_inflight(4)) is None
    # with room for 1.5 micro-batches, the first of two stages (2 in flight) does not fit
    tight = StageCosts(layer_time=[1.0, 1.0], layer_act=[1.0, 1.0], capacity=1.5)
    tight_options = [SubmeshOption.additive(1, "one", tight)]
    assert assign_submeshes(tight_options, 2, 4, one_f_one_b_inflight(4)) is None
    # ... and the last stage alone (1 in flight) does: one device each for 2 layers on 2
    # devices, the first stage holding one layer's 2 micro-batches = 2 > 1.5: still none; on
    # a 2-device option holding both layers (1 stage, 1 in flight) it fits
    both = SubmeshOption.additive(
        2, "two", StageCosts([0.5, 0.5], layer_act=[0.5, 0.5], capacity=1.5)
    )
    found = assign_submeshes([*tight_options, both], 2, 4, one_f_one_b_inflight(4))
    assert found.ranges == ((0, 2),) and found.options == (1,)


def test_place_tiles_alpa_shapes_and_refuses_others():
    assert place([2, 8, 4, 1, 1], 2, 8) == [12, 0, 8, 14, 15]  # 8, 4, 2, 1, 1 in turn
    assert place([3, 5], 1, 8) is None  # not (1, 2^k) shapes
    assert place([4, 4], 2, 8) is None  # leaves a node empty
    assert submesh_sizes(2, 8) == [1, 2, 4, 8, 16]
    assert submesh_sizes(4, 1) == [1, 2, 3, 4]
