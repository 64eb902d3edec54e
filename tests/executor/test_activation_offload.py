"""Activation offload (planner/parallel/activation_offload.py, executor/activation_offload.py)
run on 4 gloo processes against the single-process reference: FSDP2 over dp with a
pipeline, and tensor parallelism (DTensors, whose local shards travel). The shared check
(tests/executor/test_execute.check_case) also finds every rank moved activations to the host."""

import pytest

from tests.executor.test_execute import check_case

CASES = {
    "pp2xdp2-activation-offload": (
        "--mesh",
        "2x2x1",
        "--schedule",
        "1f1b",
        "--zero",
        "1",
        "--checkpointing",
        "offload",
    ),
    "dp2xtp2-activation-offload": (
        "--mesh",
        "1x2x2",
        "--checkpointing",
        "offload",
        "--sequence-parallel",
        "off",
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_offloaded_plan_matches_the_reference(tmp_path, case):
    check_case(tmp_path, case, CASES[case])
