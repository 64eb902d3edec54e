"""Ring attention (planner/parallel/ring_attention.py, executor/ring_attention.py) run on 4
gloo processes against the single-process reference; the shared check
(tests/executor/test_execute.check_case) compares each rank's sends and receives on the cp
group with the plan's ledger, so a run that gathered keys and values instead, or passed
fewer blocks, fails."""

import pytest

from tests.executor.test_execute import TINY, check_case

LLAMA = ("llama3-8b", {**TINY, "kv_heads": 2, "ffn_hidden": 128})
CASES = {
    # four ranks in one ring, full checkpointing (the forward's ring runs again): every
    # block crosses three hops, the gradients four
    "cp4-ckpt": ("--mesh", "1x1x1", "--cp", "4", "--cp-comm", "ring", "--checkpointing", "on"),
    # with tensor parallelism and ZeRO-3: each tp rank's one kv head goes round
    "cp2xtp2-sequence-parallel-zero3": (
        *("--mesh", "1x1x2", "--zero", "3", "--cp", "2", "--cp-comm", "ring"),
        *("--sequence-parallel", "on"),
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_ring_plan_matches_the_reference(tmp_path, case):
    check_case(tmp_path, case, CASES[case], model=LLAMA)
