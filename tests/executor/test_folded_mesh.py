"""Context parallelism with expert tp 1 (executor.mesh._context_and_folded_expert_mesh): the
groups DeviceMesh gives every rank are the plan's, written out here from the rank order
ranks[dp][cp][tp] (tp innermost): ep groups of ep neighbouring ranks (whole tp groups, then
cp groups), cp groups of the ranks of one dp replica and tp index, dp over the dp x cp ranks
of one tp index. The 8-rank nesting (ep groups of whole cp groups) has no gloo run (the CPU
cases have 4 ranks); the 4-rank ones run in tests/executor/test_hf_models.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = [(2, 2, 2, 8), (2, 2, 2, 4), (2, 2, 2, 2), (1, 4, 2, 4)]  # dp, cp, tp, ep


def test_folded_ep_groups_nest_with_the_cp_groups_as_planned():
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "executor" / "folded_mesh_groups.py"),
            json.dumps(CASES),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.splitlines()[-1])
    for dp, cp, tp, ep in CASES:
        world = dp * cp * tp
        for rank, groups in enumerate(got[f"{dp} {cp} {tp} {ep}"]):
            replica, middle, t = rank // (cp * tp), rank // tp % cp, rank % tp
            assert groups["tp"] == [rank - t + i for i in range(tp)]
            assert groups["ep"] == list(range(rank - rank % ep, rank - rank % ep + ep))
            first = replica * cp * tp + t
            assert groups["cp"] == [first + i * tp for i in range(cp)], (rank, middle)
            assert groups["dp"] == list(range(t, world, tp))
