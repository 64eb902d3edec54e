"""Alpha-beta fits recover known link parameters from synthetic timings; a profile built from
raw timings validates and drives the cost model."""

from __future__ import annotations

import random

import pytest

from planner.cluster.mesh import MeshAxis
from planner.cluster.profile import MeasuredPoint, load_cluster
from planner.cluster.profile_fit import build_profile, fit_collective, ring_terms
from planner.cost.model import CostModel

SIZES = [2**k for k in range(12, 27, 2)]


def synthetic(collective: str, n: int, latency: float, bandwidth: float, noise: float = 0.0):
    rng = random.Random(0)
    hops, volume = ring_terms(collective, n)
    return [
        MeasuredPoint(
            group_size=n,
            bytes=b,
            seconds=(hops * latency + volume * b / bandwidth) * (1 + rng.uniform(-noise, noise)),
        )
        for b in SIZES
    ]


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "all_to_all", "send_recv"])
def test_fit_recovers_known_parameters(collective):
    fit = fit_collective(collective, synthetic(collective, 4, 25e-6, 12e9))
    assert fit.latency == pytest.approx(25e-6, rel=1e-6)
    assert fit.bandwidth == pytest.approx(12e9, rel=1e-6)
    assert fit.rel_residual < 1e-9


def test_fit_with_noise_stays_close_and_reports_residual():
    fit = fit_collective("all_reduce", synthetic("all_reduce", 8, 10e-6, 50e9, noise=0.05))
    assert fit.latency == pytest.approx(10e-6, rel=0.15)
    assert fit.bandwidth == pytest.approx(50e9, rel=0.1)
    assert 0.005 < fit.rel_residual < 0.06


def test_built_profile_validates_and_feeds_the_cost_model():
    base = load_cluster("cpu-local")
    rows = [
        {"tier": "intra_node", "collective": "all_reduce", **p.model_dump()}
        for p in synthetic("all_reduce", 4, 40e-6, 2e9)
    ]
    raw = {
        "when": "2026-11-21T00:00:00+00:00",
        "where": "test",
        "nnodes": 1,
        "procs_per_node": 4,
        "collectives": rows,
        "matmuls": [{"dtype": "fp32", "shape": [512, 512, 512], "flops_per_s": 30e9}],
        "attention": [{"dtype": "fp32", "flops_per_s": 10e9}],
        "memory_bandwidth": 8e9,
    }
    profile = build_profile(base, raw)
    assert profile.name == "cpu-local-measured"
    assert profile.links.intra_node.bandwidth == pytest.approx(2e9, rel=1e-6)
    assert profile.links.inter_node.latency == pytest.approx(40e-6, rel=1e-6)
    assert profile.measured.fits["intra_node"]["all_reduce"].points == len(SIZES)
    cm = CostModel(profile, "fp32")
    assert cm.matmul_rate == 30e9 and cm.mem_rate == 8e9
    axis = MeshAxis("dp", 4, profile.links.intra_node.bandwidth, 40e-6, False)
    # Measured points are interpolated; between them they agree with the fit.
    nbytes = 3 * 2**20
    hops, volume = ring_terms("all_reduce", 4)
    assert cm.all_reduce(nbytes, axis) == pytest.approx(
        hops * 40e-6 + volume * nbytes / 2e9, rel=0.02
    )


def test_executor_overhead_adds_per_layer_and_per_microbatch_time(small_gpt):
    from planner.cluster.profile import ExecutorOverhead, Measured
    from planner.evaluate.config import ParallelConfig
    from planner.evaluate.estimate import evaluate
    from planner.plan import ModelRef, TrainingSettings

    base = load_cluster("cpu-local")
    training = TrainingSettings(global_batch_size=8, seq_len=64, dtype="fp32")
    model = ModelRef(name="g", family="gpt", config={}, params=1, content_hash="x")
    layers = small_gpt.num_layers

    def step(overhead: ExecutorOverhead | None, cfg: ParallelConfig) -> float:
        cluster = base.model_copy(update={"measured": Measured(executor_overhead=overhead)})
        graph = small_gpt  # traced at batch 2: the micro-batch of both configurations
        return evaluate(graph, cluster, training, cfg, model).predicted.step_time_s

    dp = ParallelConfig(dp=4, tp=1, pp=1, microbatches=1)
    fsdp = ExecutorOverhead(fsdp_layer_step_s=0.1, fsdp_layer_microbatch_s=0.01)
    assert step(fsdp, dp) - step(None, dp) == pytest.approx(0.1 * layers + 0.01 * layers)
    pp = ParallelConfig(dp=2, tp=1, pp=2, microbatches=2)
    pipe = ExecutorOverhead(pp_microbatch_s=0.05)
    assert step(pipe, pp) - step(None, pp) == pytest.approx(0.05 * (2 + 2 - 1))
