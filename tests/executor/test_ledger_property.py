"""A seeded sample of random pinned plans (tests/executor/ledger_property.py): the default
search's plan under each draw runs on gloo without the executor refusing it, and its ledger
matches the plan's (bench/ledger_property.py runs 50 and records the result)."""

import random

import pytest

from executor.local_ranks import run_local
from tests.executor.ledger_check import check_ledger
from tests.executor.ledger_property import draw, plan_for

SAMPLE = 8


def _draws() -> list[tuple[str, list[str]]]:
    rng = random.Random(36)
    return [draw(rng) for _ in range(SAMPLE)]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "family,pins", _draws(), ids=lambda v: v if isinstance(v, str) else " ".join(v)
)
def test_a_random_pinned_plan_runs_and_its_ledger_matches(tmp_path, family, pins):
    plan = plan_for(family, pins, tmp_path)
    if plan is None:
        pytest.skip("no plan fits these pins")
    assert plan.executable, plan.not_executable_reason
    ranks = run_local(plan, steps=2, timeout_s=240)
    check_ledger(plan, ranks)
