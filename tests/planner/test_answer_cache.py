"""Warm answers (issue 42, part 1): a request answered before, with the same code, comes from
the disk cache without torch, transformers or pulp; anything the answer depends on misses;
the baselines evaluated beside the search equal those evaluated after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cluster.profile import load_cluster
from planner.planning import RunAsked, plan_request
from planner.request import resolve_request, search_options

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"name": "gpt-350m", "config": {"layers": 2, "hidden": 256, "heads": 8}}
TRAINING = {"global_batch_size": 16, "seq_len": 256}
FLAGS = ["--model", "gpt-350m", "--config", "layers=2", "hidden=256", "heads=8"]
FLAGS += ["--cluster", "dgx-a100-80g", "--global-batch", "16", "--seq", "256"]

# One `autopar plan` in a fresh interpreter; prints its plan's JSON and which heavy packages
# it imported.
CHILD = """
import contextlib, io, json, sys
from api.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(["plan", *sys.argv[1:], "--json"])
heavy = sorted(m for m in ("torch", "transformers", "pulp", "highspy") if m in sys.modules)
print(json.dumps({"code": code, "plan": out.getvalue(), "imported": heavy}))
"""


def _cli(cache: Path) -> dict:
    env = {**os.environ, "AUTOPAR_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *FLAGS],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _without_timing(plan_json: str) -> dict:
    plan = json.loads(plan_json)
    plan["search"].pop("time_s")
    return plan


def test_a_warm_answer_loads_no_torch_and_is_the_same_plan(tmp_path):
    cold = _cli(tmp_path)
    assert cold["code"] == 0 and "torch" in cold["imported"]  # traced: torch was needed
    warm = _cli(tmp_path)
    assert warm["code"] == 0 and warm["imported"] == []
    assert _without_timing(warm["plan"]) == _without_timing(cold["plan"])


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    return tmp_path


def _answer(options: dict | None = None, training: dict | None = None, baselines=False):
    cluster = load_cluster("dgx-a100-80g")
    request = resolve_request(MODEL, cluster, {**TRAINING, **(training or {})})
    return plan_request(request, search_options(options or {}), baselines=baselines)


def test_the_same_request_is_answered_from_the_cache(cache_dir):
    first = _answer({"top_k": 3})
    again = _answer({"top_k": 3})
    assert first.inputs is not None and again.inputs is None  # nothing traced or searched
    assert again.plan.to_json() == first.plan.to_json()
    assert list((cache_dir / "answer").glob("*.json.gz"))


def test_what_the_answer_depends_on_misses(cache_dir):
    _answer({"top_k": 3})
    assert _answer({"top_k": 2}).inputs is not None  # a search option
    assert _answer({"top_k": 3}, {"seq_len": 128}).inputs is not None  # a training setting
    assert _answer({"top_k": 3}, baselines=True).inputs is not None  # baselines asked
    assert _answer({"top_k": 3, "workers": 2}).inputs is None  # workers: only how fast


def test_another_run_of_the_same_plan_is_answered_from_the_cache_priced_for_it(cache_dir):
    """The search does not depend on the run's tokens, price or goodput: a request that
    differs only there reuses the answer, and its run is priced for what it asked."""
    cluster = load_cluster("dgx-a100-80g")
    request = resolve_request(MODEL, cluster, TRAINING)
    options = search_options({})
    first = plan_request(request, options, run=RunAsked(1e9, 2.0, 0.9))
    again = plan_request(request, options, run=RunAsked(4e9, 3.0, 0.9))
    assert first.inputs is not None and again.inputs is None  # nothing traced or searched
    assert len(list((cache_dir / "answer").glob("*.json.gz"))) == 1
    assert again.plan.model_copy(update={"run": None}) == first.plan.model_copy(
        update={"run": None}
    )
    assert again.plan.run.gpu_hours == pytest.approx(4 * first.plan.run.gpu_hours, rel=1e-9)
    assert again.plan.run.cost == pytest.approx(6 * first.plan.run.cost, rel=1e-9)
    plain = plan_request(request, options)  # no run asked: none priced
    assert plain.inputs is None and plain.plan.run is None


def test_a_corrupt_answer_is_planned_again(cache_dir):
    first = _answer()
    (entry,) = (cache_dir / "answer").glob("*.json.gz")
    entry.write_bytes(b"not gzip")
    again = _answer()
    assert again.inputs is not None
    # searched again (its layouts now from the cache: fewer ILP solves, another time)
    assert again.plan.model_copy(update={"search": first.plan.search}) == first.plan


def test_baselines_beside_the_search_equal_those_after_it(monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", "off")
    alone = _answer({"workers": 1}, baselines=True)
    beside = _answer({"workers": 2}, baselines=True)
    assert [b.kind for b in beside.baselines] == [b.kind for b in alone.baselines]
    for a, b in zip(alone.baselines, beside.baselines, strict=True):
        assert a.evaluated == b.evaluated > 0
        assert (a.plan is None) == (b.plan is None)
        if a.plan is not None:
            assert _without_timing(a.plan.to_json()) == _without_timing(b.plan.to_json())
    assert _without_timing(beside.plan.to_json()) == _without_timing(alone.plan.to_json())


def test_baselines_are_shared_by_requests_that_differ_in_pins(cache_dir, monkeypatch):
    from planner.search import baselines

    calls = []
    real = baselines.baseline

    def counting(kind, inputs, shared=None):
        calls.append(kind)
        return real(kind, inputs, shared)

    monkeypatch.setattr(baselines, "baseline", counting)
    first = _answer({"top_k": 3}, baselines=True)
    assert len(calls) == 4
    other = _answer({"top_k": 2}, baselines=True)  # a new answer, the same baselines
    assert other.inputs is not None and len(calls) == 4
    assert [b.plan for b in other.baselines] == [b.plan for b in first.baselines]
    _answer({"top_k": 3}, {"seq_len": 128}, baselines=True)  # other inputs: evaluated
    assert len(calls) == 8
