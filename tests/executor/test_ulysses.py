"""Ulysses context parallelism (planner/parallel/ulysses.py, executor/ulysses.py) run on 4
gloo processes against the single-process reference; the shared check
(tests/executor/test_execute.check_case) compares each rank's all-to-alls with the plan's
ledger, so a run that gathered keys and values instead, or exchanged nothing, fails."""

import pytest

from tests.executor.test_execute import TINY, check_case

LLAMA = ("llama3-8b", {**TINY, "kv_heads": 2, "ffn_hidden": 128})
CASES = {
    # dp 2 x cp 2 with full checkpointing (the forward's exchanges run again)
    "dp2xcp2-ckpt": (
        "--mesh",
        "1x2x1",
        "--cp",
        "2",
        "--cp-comm",
        "ulysses",
        "--checkpointing",
        "on",
    ),
    # with tensor parallelism: each tp rank's 2 query heads over cp 2, its one kv head
    # repeated to two so that cp divides it
    "cp2xtp2-sequence-parallel-zero3": (
        *("--mesh", "1x1x2", "--zero", "3", "--cp", "2", "--cp-comm", "ulysses"),
        *("--sequence-parallel", "on"),
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_ulysses_plan_matches_the_reference(tmp_path, case):
    check_case(tmp_path, case, CASES[case], model=LLAMA)
