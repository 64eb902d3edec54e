"""The global batch as a search dimension (planner.search.batch): the batch chosen is the one
whose own plan trains the most tokens per second, checked by planning each batch alone."""

from __future__ import annotations

import pytest

from planner.cluster.profile import load_cluster
from planner.errors import InputError
from planner.planning import plan_request, size_request
from planner.request import resolve_request, search_options
from planner.search.batch import BatchRange, parse_global_batch
from planner.search.sizing import read_run

# Llama-3-8B's widths with 2 of its layers on 16 H100 at 4K tokens, Megatron's tp layout (no
# ILP): the 5 + 5 searches take seconds (the full model on 64 H100: bench/batch_search.py)
MODEL = {"name": "llama3-8b", "config": {"layers": 2}}
OPTIONS = search_options({"tp_layout": "megatron"})


def _plan(batch, cluster, seq=4096):
    request = resolve_request(MODEL, cluster, {"global_batch_size": batch, "seq_len": seq})
    return plan_request(request, OPTIONS).plan


def test_auto_picks_the_batch_whose_own_plan_is_fastest_per_gpu():
    cluster = load_cluster("dgx-h100", nodes=2)  # 16 H100
    chosen = _plan("auto", cluster)
    # auto: 1 to 16 samples per device, doubling
    tried = [16, 32, 64, 128, 256]
    alone = {b: _plan(b, cluster) for b in tried}
    best = max(tried, key=lambda b: alone[b].predicted.tokens_per_s)
    assert chosen.request.training.global_batch_size == best
    assert chosen.predicted.step_time_s == pytest.approx(alone[best].predicted.step_time_s)
    assert chosen.mesh.shape == alone[best].mesh.shape
    # each batch's throughput is listed, and the convergence caveat is stated
    line = next(x for x in chosen.explanation if x.startswith("Global batch"))
    for b in tried:
        assert f"{b}: {alone[b].predicted.tokens_per_s / 16:,.0f}" in line
    assert any("critical batch size" in x for x in chosen.explanation)
    assert any("largest micro-batch" in x for x in chosen.explanation)
    # the smallest batch within 1% of the best is named where it is not the best
    near = next(
        b
        for b in tried
        if alone[b].predicted.tokens_per_s
        >= 0.99 * max(alone[t].predicted.tokens_per_s for t in tried)
    )
    named = [x for x in chosen.explanation if x.startswith(f"Batch {near} is within 1%")]
    assert bool(named) == (near != best)


def test_a_range_keeps_to_its_bounds():
    cluster = load_cluster("dgx-h100", nodes=1)
    plan = _plan("24-40", cluster, seq=2048)
    assert plan.request.training.global_batch_size in (24, 40)
    line = next(x for x in plan.explanation if x.startswith("Global batch"))
    assert "24: " in line and "40: " in line and "48: " not in line


def test_ranges_are_read_and_bad_ones_named():
    assert parse_global_batch("auto", 64) == BatchRange(64, 1024)
    assert parse_global_batch(" 8 - 64 ", 8) == BatchRange(8, 64)
    assert parse_global_batch([8, 64], 8) == BatchRange(8, 64)
    assert parse_global_batch("32", 8) == 32
    assert parse_global_batch("32-32", 8) == 32
    assert BatchRange(24, 100).candidates() == [24, 48, 96, 100]
    for bad in ("0-8", "many", True, "8-", [1, 2, 3], "64-8", 0, "9" * 5000, "1-" + "9" * 5000):
        with pytest.raises(InputError) as err:
            parse_global_batch(bad, 8)
        assert err.value.field == "training.global_batch_size"


def test_sizing_and_export_take_one_batch():
    cluster = load_cluster("dgx-h100", nodes=1)
    request = resolve_request(MODEL, cluster, {"global_batch_size": "8-16", "seq_len": 1024})
    with pytest.raises(InputError, match="one global batch"):
        size_request(request, search_options({}), [1], read_run("1e9", None, "sizing"))


def test_the_service_schema_takes_a_range():
    from pydantic import ValidationError

    from api.service.schemas import PlanTrainingInput, TrainingInput

    for ok in (64, "auto", "64-1024"):
        assert PlanTrainingInput(global_batch_size=ok).global_batch_size == ok
    for bad in ("64-", "all", 0, 1.5, True, 2**63):
        with pytest.raises(ValidationError) as err:
            PlanTrainingInput(global_batch_size=bad)
        assert err.value.errors()[0]["loc"] == ("global_batch_size",)
    with pytest.raises(ValidationError):  # a sizing plans one batch
        TrainingInput(global_batch_size="auto")
