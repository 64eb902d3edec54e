"""`autopar export --to deepspeed` checked by DeepSpeed itself: each exported JSON is read by
its own DeepSpeedConfig at the plan's world size (torch's fake process group, DeepSpeed's
communication backend on it, the plan's data-parallel size reported as an mpu does, as its
engine's is under AutoTP), which asserts the batch arithmetic and parses every block; the
parsed settings must be the plan's. Run in a child process: the process group is global."""

import importlib.util
import json
import subprocess
import sys

import pytest

from api.cli import main as cli_main
from planner.plan import Plan

# found, not imported: importing DeepSpeed takes seconds, and the child process does it
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed"
)

WORLD = 16  # dgx-a100-80g x 2
PLANS = {  # name: estimate flags (llama3-8b, global batch 64, seq 512)
    "zero0": ("--dp", "16", "--zero", "0"),
    "zero1": ("--dp", "16", "--zero", "1"),
    "zero2": ("--dp", "16", "--zero", "2"),
    "zero3": ("--dp", "16", "--zero", "3"),
    "zero3-offload": ("--dp", "16", "--zero", "3", "--cpu-offload"),
    "zero1-ckpt-accumulate": (
        "--dp",
        "16",
        "--zero",
        "1",
        "--checkpointing",
        "--microbatches",
        "2",
    ),
    "zero2-fp16": ("--dp", "16", "--zero", "2", "--dtype", "fp16"),
    "tp2-zero1": ("--dp", "8", "--tp", "2", "--zero", "1"),
    "tp4-zero2": ("--dp", "4", "--tp", "4", "--zero", "2"),
    "tp8-zero3-ckpt": ("--dp", "2", "--tp", "8", "--zero", "3", "--checkpointing"),
    "tp2-zero0-accumulate": ("--dp", "8", "--tp", "2", "--zero", "0", "--microbatches", "4"),
}

CHECK = """
import json, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import deepspeed
import deepspeed.comm.torch
from deepspeed.runtime.config import DeepSpeedConfig

# Its shared-memory all-reduce for CPU ranks, compiled at init (35 s on 2 cores): nothing a
# config check uses. Patched through sys.modules: the attribute deepspeed.comm.torch is torch
# itself (deepspeed.comm re-exports the names of its comm module, torch among them).
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
cases, world = json.loads(sys.stdin.read()), int(sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
deepspeed.init_distributed(dist_backend="gloo")

class DataParallel:  # what DeepSpeed's engine asks of an mpu for the batch arithmetic
    def __init__(self, dp):
        self.dp = dp
    def get_data_parallel_world_size(self):
        return self.dp
    def get_data_parallel_rank(self):
        return 0

out = {}
for name, (config, dp) in cases.items():
    try:
        c = DeepSpeedConfig(config, mpu=DataParallel(dp))
    except Exception as err:
        out[name] = {"error": f"{type(err).__name__}: {err}"}
        continue
    out[name] = {
        "world": c.world_size,
        "batch": [c.train_batch_size, c.train_micro_batch_size_per_gpu,
                  c.gradient_accumulation_steps],
        "zero": c.zero_optimization_stage,
        "offload_param": c.zero_config.offload_param is not None,
        "bf16": c.bfloat16_config.enabled,
        "fp16": c.float16_config.enabled,
        "optimizer": c.optimizer_name,
        "autotp": (config.get("tensor_parallel") or {}).get("autotp_size", 1),
    }
print(json.dumps(out))
"""


def _exported(tmp_path, name: str, flags: tuple[str, ...]) -> tuple[Plan, dict]:
    path, out = tmp_path / f"{name}.json", tmp_path / f"{name}.ds.json"
    args = ["estimate", "--model", "llama3-8b", "--config", "layers=2", "--cluster", "dgx-a100-80g"]
    args += ["--nodes", "2"]
    args += ["--global-batch", "64", "--seq", "512", "--pp", "1", "--tp", "1", "--microbatches"]
    args += ["1", *flags, "-o", str(path)]
    assert cli_main(args) == 0, name
    assert cli_main(["export", str(path), "--to", "deepspeed", "-o", str(out)]) == 0, name
    return Plan.from_json(path.read_text()), json.loads(out.read_text())


def _deepspeed_reads(cases: dict) -> dict:
    """{name: what DeepSpeedConfig made of it, or its error} in a child process."""
    run = subprocess.run(
        [sys.executable, "-c", CHECK, str(WORLD)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_deepspeeds_own_config_accepts_every_exported_plan(tmp_path):
    plans, cases = {}, {}
    for name, flags in PLANS.items():
        plan, config = _exported(tmp_path, name, flags)
        plans[name] = plan
        cases[name] = (config, plan.mesh.dims.dp)
    # and DeepSpeed's check is real: a batch that does not add up is refused (one child
    # process for all: importing DeepSpeed takes most of its time)
    config, dp = cases["zero1"]
    cases["broken"] = ({**config, "train_batch_size": config["train_batch_size"] + dp}, dp)
    parsed = _deepspeed_reads(cases)
    assert "train_batch_size is not equal" in parsed.pop("broken")["error"]
    assert not {k: v for k, v in parsed.items() if "error" in v}, parsed
    for name, plan in plans.items():
        got, d = parsed[name], plan.mesh.dims
        m = plan.schedule.microbatches
        mbs = plan.request.training.global_batch_size // (d.dp * m)
        assert got["world"] == d.dp, name
        assert got["batch"] == [plan.request.training.global_batch_size, mbs, m], name
        assert got["zero"] == plan.stages[0].zero, name
        assert got["offload_param"] == plan.stages[0].cpu_offload, name
        dtype = plan.request.training.dtype
        assert (got["bf16"], got["fp16"]) == (dtype == "bf16", dtype == "fp16"), name
        assert got["autotp"] == d.tp, name
        assert got["optimizer"] == plan.request.training.optimizer, name
