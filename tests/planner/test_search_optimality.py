"""The search is optimal over its own space: on small clusters an exhaustive enumeration of
every configuration (written here, independently of the search: no pruning, no dominance
rules, no stage DP, every contiguous split of the layers) finds nothing faster than the plan
under the same cost model (planner.evaluate.predict). Ties are allowed."""

import itertools

import pytest

from planner.cluster.profile import load_cluster
from planner.errors import InputError
from planner.evaluate.config import ParallelConfig
from planner.evaluate.predict import predict
from planner.request import resolve_request
from planner.search.layout_cache import LayoutCache
from planner.search.search import search
from planner.search.space import SearchOptions

GIB = 2**30


def _splits(layers: int, chunks: int):
    for cuts in itertools.combinations(range(1, layers), chunks - 1):
        bounds = [0, *cuts, layers]
        yield [(bounds[i], bounds[i + 1]) for i in range(chunks)]


def _exhaustive_best(inputs, layers: int) -> float:
    cluster, training = inputs.cluster, inputs.training
    n, per_node, gb = cluster.num_devices, cluster.devices_per_node, training.global_batch_size
    cache = LayoutCache(inputs, SearchOptions(), lambda *_: None)
    best = float("inf")
    for pp, tp in itertools.product(range(1, n + 1), repeat=2):
        if n % (pp * tp) or not (per_node % tp == 0 or tp % per_node == 0):
            continue
        dp = n // (pp * tp)
        for mbs in range(1, 33):
            if gb % (dp * mbs):
                continue
            m = gb // (dp * mbs)
            cache.prepare([(mbs, tp)])
            for kind, (schedule, v), zero, ckpt in itertools.product(
                ("megatron", "ilp"),
                # interleaved 1F1B with 2 to 8 chunks per device and the zero-bubble
                # schedule with 1 to 8, ZB-V and DualPipeV with 2 (not with ZeRO-3: validate refuses
                # them), as the search documents
                [("gpipe", 1), ("1f1b", 1)]
                + [("interleaved_1f1b", v) for v in range(2, 9)]
                + [("interleaved_zero_bubble", v) for v in range(1, 9)]
                + [("zbv_zero_bubble", 2), ("dualpipe_v", 2)],
                (0, 1, 2, 3),
                (False, True),
            ):
                cfg = ParallelConfig(dp, tp, pp, m, schedule, v, zero, ckpt)
                try:
                    cfg.validate(cluster, gb, layers, inputs.model.config)
                except InputError:
                    continue
                if (zero and dp == 1) or (v > 1 and pp == 1):
                    continue  # the same as ZeRO-0 / as 1F1B
                lay = cache.get(kind, mbs, tp)
                if lay is None:
                    continue
                for ranges in _splits(layers, pp * v):
                    pred = predict(
                        cache.graph(mbs), cluster, training, cfg, layouts=lay, ranges=ranges
                    )
                    if pred.fits_in_memory:
                        best = min(best, pred.step_time_s)
    return best


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nodes", "per_node", "memory_gib", "layers"),
    [(1, 8, 80, 4), (2, 8, 1.5, 4), (1, 4, 0.6, 4), (1, 4, 80, 6)],
    ids=["8gpu-roomy", "16gpu-tight", "4gpu-tighter", "4gpu-6layers"],  # 6: up to 3 chunks
)
def test_no_configuration_beats_the_plan(nodes, per_node, memory_gib, layers):
    base = load_cluster("dgx-a100-80g")
    device = base.device.model_copy(update={"memory_bytes": int(memory_gib * GIB)})
    cluster = base.model_copy(
        update={"nodes": nodes, "devices_per_node": per_node, "device": device}
    )
    request = resolve_request(
        {"name": "gpt-350m", "config": {"layers": layers, "hidden": 512, "heads": 8}},
        cluster,
        {"global_batch_size": 16, "seq_len": 256, "dtype": "bf16"},
    )
    inputs = request.trace()
    # the whole space the exhaustive enumeration covers, runnable or not
    plan = search(inputs, SearchOptions(executable_only=False)).plan
    exhaustive = _exhaustive_best(inputs, layers)
    assert exhaustive < float("inf")
    assert plan.predicted.step_time_s <= exhaustive * (1 + 1e-9)


def test_a_time_limit_returns_the_best_plan_so_far(monkeypatch):
    """A clock that advances 1 s per reading: the search stops after a few combinations and
    returns the best it found, saying so; with no time at all it says nothing was found."""
    from planner.search import search as search_module
    from planner.search.search import NoFeasiblePlan

    cluster = load_cluster("dgx-a100-80g")
    request = resolve_request(
        {"name": "gpt-350m", "config": {"layers": 4, "hidden": 256, "heads": 4}},
        cluster,
        {"global_batch_size": 16, "seq_len": 128, "dtype": "bf16"},
    )
    inputs = request.trace()
    full = search(inputs, SearchOptions()).plan
    ticks = itertools.count()
    monkeypatch.setattr(search_module.time, "perf_counter", lambda: float(next(ticks)))
    cut = search(inputs, SearchOptions(time_limit=6)).plan
    assert cut.search.complete is False and full.search.complete is True
    assert any("cut at its time limit of 6 s" in line for line in cut.explanation)
    assert cut.search.candidates_evaluated < full.search.candidates_evaluated
    assert cut.predicted.step_time_s >= full.predicted.step_time_s * (1 - 1e-9)
    with pytest.raises(NoFeasiblePlan, match="time limit") as err:
        search(inputs, SearchOptions(time_limit=0))
    assert err.value.reason == "time"
