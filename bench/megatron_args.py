"""`autopar export --to megatron` checked by Megatron-LM itself: each exported argument list
goes through Megatron-LM's own `parse_args` and `validate_args`
(megatron/training/arguments.py) at the plan's world size, in a child process with a
Megatron-LM checkout on its path. Megatron-LM is not on the package registries (only
megatron-core, which lacks the training arguments), so this is a bench run against a
checkout, recorded with its commit; the tests check the model and parallel part with
megatron-core's TransformerConfig (tests/api/test_megatron_config.py).

Two shims, for this machine only: Python 3.11 lacks typing.override (3.12), which
Megatron-LM's training package imports; and validate_args asks the GPU's architecture for
a CUDA_DEVICE_MAX_CONNECTIONS rule and, with --moe-grouped-gemm, its compute capability,
answered with the plan's device's (Hopper: 9, Ampere: 8) on a machine without CUDA.

Run: python bench/megatron_args.py --megatron-lm PATH [--commit SHA]
     (writes results/megatron_args.md)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import header, write

ROOT = Path(__file__).resolve().parent.parent
# name: autopar estimate flags (llama3-8b unless --model or --hf-config is given; 16 GPUs)
PLANS = {
    "dp16 zero1": ("--dp", "16", "--zero", "1"),
    "dp16 ddp": ("--dp", "16", "--zero", "0"),
    "tp2 pp2 interleaved v2 SP zero1": (
        *("--dp", "4", "--tp", "2", "--pp", "2", "--microbatches", "8"),
        *("--schedule", "interleaved_1f1b", "--virtual-stages", "2", "--sequence-parallel"),
        *("--zero", "1"),
    ),
    "tp4 pp4 1f1b full recompute": (
        *("--dp", "1", "--tp", "4", "--pp", "4", "--microbatches", "16", "--checkpointing"),
    ),
    "tp8 SP fp8": ("--dp", "2", "--tp", "8", "--sequence-parallel", "--fp8", "tensorwise"),
    "tp2 cp2 all-gather zero1": (
        *("--dp", "4", "--tp", "2", "--cp", "2", "--sequence-parallel", "--zero", "1"),
    ),
    "cp4 ring zero1": ("--dp", "4", "--cp", "4", "--cp-comm", "ring", "--zero", "1"),
    "cp2 ulysses zero1": ("--dp", "8", "--cp", "2", "--cp-comm", "ulysses", "--zero", "1"),
    "dp16 fsdp2 (zero3)": ("--dp", "16", "--zero", "3"),
    "pp2 dp8 1f1b zero1 fp16": (
        *("--dp", "8", "--pp", "2", "--microbatches", "4", "--zero", "1", "--dtype", "fp16"),
    ),
    "gpt-1.3b tp2 pp2": (
        *("--model", "gpt-1.3b", "--dp", "4", "--tp", "2", "--pp", "2", "--microbatches", "4"),
        *("--seq", "2048"),
    ),
    "moe-1.3b dp16 ep4": ("--model", "moe-1.3b", "--dp", "16", "--ep", "4", "--seq", "1024"),
    "Mixtral-8x7B (2 layers) dp16 ep8 zero1": (
        *("--hf-config", "MIXTRAL_8X7B", "--config", "layers=2", "--dp", "16", "--ep", "8"),
        *("--zero", "1", "--runtime", "megatron", "--seq", "4096"),
    ),
}

CHECK = """
import json, os, shlex, sys, typing
typing.override = getattr(typing, "override", lambda f: f)  # Python 3.12's, 3.11 lacks it
flags, arch = json.loads(sys.argv[1]), int(sys.argv[2])
sys.argv = ["pretrain_gpt.py", *flags]
import megatron.training.utils.common_utils as common
common.get_device_arch_version = lambda: arch
import megatron.training.arguments as arguments
arguments.get_device_arch_version = lambda: arch
import torch
torch.cuda.get_device_capability = lambda *_: (arch, 0)
args = arguments.parse_args()
arguments.validate_args(args)
print(json.dumps({"dp": args.data_parallel_size, "vp": args.virtual_pipeline_model_parallel_size}))
"""


def _plan_flags(name: str, flags: tuple[str, ...], tmp: Path) -> tuple[list[str], int, dict]:
    sys.path.insert(0, str(ROOT))
    from api.cli import main as cli_main
    from planner.plan import Plan

    if "MIXTRAL_8X7B" in flags:
        from tests.hf_configs import MIXTRAL_8X7B

        (tmp / "mixtral.json").write_text(json.dumps(MIXTRAL_8X7B))
        flags = tuple(str(tmp / "mixtral.json") if f == "MIXTRAL_8X7B" else f for f in flags)
    given = "--model" in flags or "--hf-config" in flags
    model = () if given else ("--model", "llama3-8b")
    seq = () if "--seq" in flags else ("--seq", "8192")
    plan_path, out = tmp / "plan.json", tmp / "plan.args"
    args = ["estimate", *model, "--cluster", "dgx-h100", "--nodes", "2", "--global-batch", "64"]
    args += [*seq, "--pp", "1", "--tp", "1", "--microbatches", "1", *flags, "-o", str(plan_path)]
    if cli_main(args) != 0:
        raise SystemExit(f"{name}: autopar estimate failed")
    code = cli_main(["export", str(plan_path), "--to", "megatron", "-o", str(out)])
    plan = Plan.from_json(plan_path.read_text())
    if code != 0:
        return [], 0, {"refused": True}
    from api.export.megatron import environment

    d = plan.mesh.dims
    want = {"dp": d.dp, "vp": plan.schedule.virtual_stages, "env": environment(plan)}
    return out.read_text().split(), d.world, want


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout")
    ap.add_argument("--commit", help="its commit, where the tree is not a git checkout")
    args = ap.parse_args()
    source = Path(args.megatron_lm).resolve()
    git = ["git", "-C", str(source), "rev-parse", "--short", "HEAD"]
    found = subprocess.run(git, capture_output=True, text=True, check=False).stdout.strip()
    commit = args.commit or found or "(not a git checkout)"
    rows = []
    for name, flags in PLANS.items():
        with tempfile.TemporaryDirectory() as tmp:
            exported, world, want = _plan_flags(name, flags, Path(tmp))
        if want.get("refused"):
            rows.append(f"| {name} | refused by `autopar export` | - |")
            continue
        run = subprocess.run(
            [sys.executable, "-c", CHECK, json.dumps(exported), "9"],
            capture_output=True,
            text=True,
            cwd=source,
            env={
                "PYTHONPATH": str(source),
                "WORLD_SIZE": str(world),
                "RANK": "0",
                "PATH": "",
                **want["env"],  # what `autopar export` says to set
            },
            timeout=600,
        )
        if run.returncode == 0:
            got = json.loads(run.stdout.strip().splitlines()[-1])
            vp = got["vp"] or 1
            same = got["dp"] == want["dp"] and vp == want["vp"]
            verdict = "accepted" + ("" if same else f" (dp {got['dp']}, vp {vp}: not the plan's)")
        else:
            last = [x for x in run.stderr.strip().splitlines() if x.strip()][-1:]
            verdict = "**rejected**: " + (last[0][:300] if last else "?")
        rows.append(f"| {name} | {verdict} | `{' '.join(exported)[:120]}...` |")
        print(rows[-1], flush=True)
    command = " ".join(["python bench/megatron_args.py", *sys.argv[1:]])
    text = header("Megatron-LM's own argument checks", command)
    text += "\n".join(
        [
            f"Megatron-LM checkout: commit {commit} (its parse_args and validate_args, with "
            "the checkout's own megatron-core). Plans: `autopar estimate` on 2 DGX H100 "
            "(16 GPUs), Llama-3-8B shape at 8K tokens unless named; each exported with "
            "`autopar export --to megatron`.",
            "",
            "| plan | Megatron-LM | flags |",
            "| --- | --- | --- |",
            *rows,
            "",
        ]
    )
    write("megatron_args.md", text)


if __name__ == "__main__":
    main()
