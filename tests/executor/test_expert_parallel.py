"""Expert parallelism (planner/parallel/expert.py, executor/expert_parallel.py) run on 4 gloo
processes against the single-process reference; the shared check
(tests/executor/test_execute.check_case) compares each rank's all-to-alls on the ep group and
the expert weights' synchronisation on the expert-data-parallel group with the plan's ledger,
so a run that kept every expert on every rank, or exchanged no tokens, fails."""

import pytest

from tests.executor.test_execute import check_case

# GShard MoE, 8 experts of 64 -> 128, top-2 with capacity: an MoE layer and a dense one
MOE = ("moe-380m", {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "experts": 8})
CASES = {
    # every rank all the experts: the same model, no exchange
    "dp4-ep1-zero0": ("--mesh", "1x4x1", "--ep", "1", "--zero", "0"),
    # two ep groups of 2: experts synchronised between the groups (edp 2), DDP
    "dp4-ep2-zero0": ("--mesh", "1x4x1", "--ep", "2", "--zero", "0"),
    # every rank its own quarter of the experts (nothing to synchronise), FSDP on the rest
    "dp4-ep4-zero3": ("--mesh", "1x4x1", "--ep", "4", "--zero", "3"),
    # the experts sharded by FSDP over the 2 ranks holding the same (edp 2)
    "dp4-ep2-zero3": ("--mesh", "1x4x1", "--ep", "2", "--zero", "3"),
    # a pipeline of two stages, each dp 2 = ep 2; ZeRO-2 and full recomputation
    "pp2xdp2-ep2-zero2-ckpt": (
        *("--mesh", "2x2x1", "--ep", "2", "--zero", "2", "--checkpointing", "on"),
        *("--schedule", "1f1b", "--microbatch-size", "1"),
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_parallel_matches_the_reference(tmp_path, case):
    check_case(tmp_path, case, CASES[case], model=MOE)
