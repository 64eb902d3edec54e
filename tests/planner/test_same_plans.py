"""Same requests, same plans: the plans of Alpa's suite and of `make demo`, recorded before
the restructure into data-flow packages (tests/fixtures/same_plans/), are reproduced exactly
apart from timings and the version string. The quick cases run here; `python
bench/same_plans.py` checks all 24 (about 13 minutes on 2 cores)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from same_plans import FIXTURES, cases, produce  # noqa: E402

# One per entry point: search + baselines, `autopar plan`, `autopar estimate`.
QUICK = ["gpt-350m-1gpu", "demo-plan-cpu", "demo-estimate-gpt-39b"]


def test_every_suite_case_and_the_demo_has_a_fixture():
    assert {p.stem for p in FIXTURES.glob("*.json")} == set(cases())


@pytest.mark.slow
@pytest.mark.parametrize("name", QUICK)
def test_plan_is_the_recorded_one(name):
    got, _ = produce(cases()[name])
    want = json.loads((FIXTURES / f"{name}.json").read_text())
    assert json.loads(json.dumps(got)) == want
