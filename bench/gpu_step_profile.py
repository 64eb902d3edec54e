"""Where an executed plan's step time goes on a GPU: one rank of `executor.worker` under
torch.profiler, the operators ranked by GPU time and by CPU time (issue 16: the plans run on
the H100 took 20-28% longer than predicted while their layers alone were within 7%).

    python bench/gpu_step_profile.py PLAN --out DIR   (on the GPU machine; one process)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("plan")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    import torch
    from torch.profiler import ProfilerActivity, profile

    from executor.training import RunOptions
    from executor.worker import run
    from planner.plan import Plan

    plan = Plan.from_json(Path(args.plan).read_text())
    opts = RunOptions(steps=args.steps, timeout_s=300)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        result = run(plan, opts)
    wall = time.perf_counter() - started
    steps = [s["time_s"] for s in result["steps"]]
    events = prof.key_averages()
    by_gpu = events.table(sort_by="self_cuda_time_total", row_limit=40)
    by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=30)
    (out / "profile.txt").write_text(
        f"steps (s): {steps}\nwall {wall:.2f} s, torch {torch.__version__}\n\n"
        f"== by GPU time ==\n{by_gpu}\n\n== by CPU time ==\n{by_cpu}\n"
    )
    print(f"steps (s): {[round(s, 3) for s in steps]}")
    print(by_gpu[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
