"""examples/train_hf_llama.py: autopar.plan + autopar.parallelize in a user's own loop, on 4
gloo processes under torchrun, gives the losses of the same loop on one process without
autopar."""

import argparse
import importlib.util
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


def _example():
    """The script as a module (its plan and single-process steps run in this process)."""
    spec = importlib.util.spec_from_file_location("train_hf_llama", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.distributed
@pytest.mark.slow
def test_example_trains_with_a_plan_like_the_single_process_loop(tmp_path):
    example = _example()
    example.make_plan(argparse.Namespace(out=str(tmp_path / "plan.json"), mesh="2x1x2"))
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh"]["shape"] == [2, 1, 2] and plan["request"]["model"]["family"] == "hf"
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    _run(
        [*torchrun, str(SCRIPT), "train", "plan.json", "--steps", "3", "--losses", "a.json"],
        tmp_path,
    )
    parallel = json.loads((tmp_path / "a.json").read_text())
    assert parallel == pytest.approx(example.train_single(3), rel=1e-5)
