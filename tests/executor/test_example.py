"""examples/train_hf_llama.py: autopar.plan + autopar.parallelize in a user's own loop, on 4
gloo processes under torchrun, gives the losses of the same loop on one process without
autopar."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_hf_llama.py"


def _run(args: list[str], cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_example_trains_with_a_plan_like_the_single_process_loop(tmp_path):
    _run([str(SCRIPT), "plan", "--out", "plan.json", "--mesh", "2x1x2"], tmp_path)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh"]["shape"] == [2, 1, 2] and plan["request"]["model"]["family"] == "hf"
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    _run(
        [*torchrun, str(SCRIPT), "train", "plan.json", "--steps", "3", "--losses", "a.json"],
        tmp_path,
    )
    _run(
        [str(SCRIPT), "train", "plan.json", "--steps", "3", "--single", "--losses", "b.json"],
        tmp_path,
    )
    parallel = json.loads((tmp_path / "a.json").read_text())
    single = json.loads((tmp_path / "b.json").read_text())
    assert parallel == pytest.approx(single, rel=1e-5)
