"""Executor overhead: one dp x tp configuration trained by `autopar execute` (a plan with
Megatron's tp layout, FSDP2 on dp) and by the same training written by hand with the torch
APIs (bench/handwritten_tp_dp.py), on 4 local gloo processes, run alternately.

Statistic: per run, the median over steps 2..N of the slowest rank's step time (as
`autopar execute` reports it); per side, the median over the runs.

Run: python bench/executor_overhead.py [--runs 3] [--steps 8]
(writes bench/results/executor_overhead.md)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import header, write

from executor.launch import execute
from planner.cluster import load_cluster
from planner.estimate import ParallelConfig, evaluate, model_ref
from planner.models import ModelSpec, resolve
from planner.plan import TrainingSettings
from planner.tracing import trace_model

CONFIG = {"layers": 4, "hidden": 256, "heads": 4}
VOCAB, SEQ, BATCH, DP, TP = 1024, 128, 16, 2, 2
HERE = Path(__file__).parent


def _plan(path: Path) -> None:
    resolved = resolve(ModelSpec(name="gpt-350m", config={**CONFIG, "vocab": VOCAB}))
    config = ParallelConfig(pp=1, dp=DP, tp=TP, microbatches=1, zero=1)
    training = TrainingSettings(global_batch_size=BATCH, seq_len=SEQ, dtype="fp32")
    graph = trace_model(resolved, config.microbatch_size(BATCH), SEQ, "fp32")
    plan = evaluate(graph, load_cluster("cpu-local"), training, config, model_ref(resolved, SEQ))
    assert plan.tp_layout == "megatron" and plan.executable
    path.write_text(plan.to_json())


def _warm_median(per_rank: list[list[float]]) -> float:
    slowest = [max(times) for times in zip(*per_rank, strict=True)]
    return statistics.median(slowest[1:])


def _handwritten(tmp: Path, steps: int, run: int) -> float:
    out = tmp / f"hand{run}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(DP * TP), str(HERE / "handwritten_tp_dp.py")]
    cmd += ["--dp", str(DP), "--tp", str(TP), "--config", json.dumps(CONFIG)]
    cmd += ["--vocab", str(VOCAB), "--seq", str(SEQ), "--batch", str(BATCH)]
    cmd += ["--steps", str(steps), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    return _warm_median(json.loads(out.read_text()))


def _autopar(plan: Path, tmp: Path, steps: int, run: int) -> float:
    result = execute(plan, tmp / f"autopar{run}", steps=steps, timeout_s=600)
    if result.status != "succeeded":
        raise RuntimeError(f"autopar execute failed: {result.errors}")
    return result.measured_step_s  # the same statistic as _warm_median


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    hand, auto = [], []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        plan = tmp / "plan.json"
        _plan(plan)
        for run in range(args.runs):
            auto.append(_autopar(plan, tmp, args.steps, run))
            hand.append(_handwritten(tmp, args.steps, run))
            print(f"run {run}: autopar {auto[-1]:.4f} s, by hand {hand[-1]:.4f} s", flush=True)
    a, h = statistics.median(auto), statistics.median(hand)
    lines = [
        header(
            "Executor overhead: autopar execute vs the same dp x tp written by hand",
            f"python bench/executor_overhead.py --runs {args.runs} --steps {args.steps}",
        ),
        "",
        f"Model: gpt-350m with {CONFIG}, vocab {VOCAB}, seq {SEQ}, global batch {BATCH}, fp32, "
        f"SGD; dp {DP} x tp {TP} on 4 gloo processes (Megatron tp layout, FSDP2 on dp without "
        "resharding after forward, one micro-batch). Step time: median over steps 2-"
        f"{args.steps} of the slowest rank; {args.runs} runs per side, alternating.",
        "",
        "| run | autopar execute s | by hand s |",
        "|---|---|---|",
        *[f"| {i} | {x:.4f} | {y:.4f} |" for i, (x, y) in enumerate(zip(auto, hand, strict=True))],
        f"| median | {a:.4f} | {h:.4f} |",
        "",
        f"autopar / by hand: {a / h:.3f} ({(a / h - 1) * 100:+.1f}%; target within 5%).",
    ]
    write("executor_overhead.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
