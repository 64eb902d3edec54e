"""A seeded sample of random pinned plans (tests/executor/ledger_property.py): the default
search's plan under each draw runs on gloo without the executor refusing it, its ledger
matches the plan's and its activation peak is within ledger_check.ACTIVATION_TOLERANCE but
where listed (bench/ledger_property.py runs 50 and records the result)."""

import random

import pytest

from executor.local_ranks import run_local
from tests.executor.ledger_check import check_activations, check_ledger
from tests.executor.ledger_property import draw, plan_for

SAMPLE = 8
# Draws (by their place in the sample) whose activation peak is outside the tolerance.
ACTIVATION_GAPS = {
    2: "+26%: eager torchao rowwise under checkpointing keeps fp32 temporaries of the "
    "gathered weights at the peak (as test_execute's dp4-zero3-fp8-rowwise); not priced",
    5: "+15%: eager fp8 under torch's sequence-parallel styles (their all-gather staging "
    "buffers, as test_execute's llama-pp2xtp2-sequence-parallel); not priced",
}


def _draws() -> list[tuple[int, str, list[str]]]:
    rng = random.Random(36)
    return [(i, *draw(rng)) for i in range(SAMPLE)]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "index,family,pins",
    _draws(),
    ids=lambda v: v if isinstance(v, str) else " ".join(v) if isinstance(v, list) else str(v),
)
def test_a_random_pinned_plan_runs_and_its_ledger_matches(tmp_path, index, family, pins):
    plan = plan_for(family, pins, tmp_path)
    if plan is None:
        pytest.skip("no plan fits these pins")
    assert plan.executable, plan.not_executable_reason
    ranks = run_local(plan, steps=2, timeout_s=240)
    check_ledger(plan, ranks)
    check_activations(plan, ranks, ACTIVATION_GAPS.get(index))
