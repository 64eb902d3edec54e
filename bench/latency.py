"""Issue 42's whole-command latency: `autopar plan` as a user runs it, timed by /usr/bin/time
(wall seconds and peak RSS), the median of N runs, cold (an empty AUTOPAR_CACHE_DIR for each
run) and warm (the cache filled by one run before). Each case's plan is checked to be the
same in every run (the plan JSON without its search time).

    python bench/latency.py [--runs 5] [--before REV]   (writes bench/results/latency.md)

--before REV: the same commands in a git worktree of REV (its own checkout, this venv), run
after this checkout's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import header, write

ROOT = Path(__file__).resolve().parent.parent
L405 = "layers=126 hidden=16384 heads=128 kv_heads=8 ffn_hidden=53248"
CASES = [  # name, flags, warm too
    (
        "GPT-39B, 64 V100",
        "--model gpt-39b --cluster aws-p3.16xlarge --nodes 8 --global-batch 1024 --seq 1024",
        True,
    ),
    (
        "Llama-3-70B, 1,024 H100",
        "--model llama3-70b --cluster dgx-h100 --nodes 128 --global-batch 1024 --seq 4096",
        False,
    ),
    (
        "405B, 16,384 H100",
        f"--model llama3-70b --config {L405} --cluster dgx-h100 --nodes 2048 "
        "--global-batch 2048 --seq 8192",
        False,
    ),
]


def run_once(flags: str, cache: str, root: Path = ROOT) -> dict:
    out = Path(cache) / "plan.json"
    cmd = ["/usr/bin/time", "-f", "%e %M", sys.executable, "-c"]
    # the console script's function (api.cli.entry; main() at revisions before it)
    script = "import sys, api.cli as c; sys.exit((getattr(c, 'entry', None) or c.main)())"
    cmd += [script, "plan", *flags.split()]
    cmd += ["-o", str(out)]
    env = {**os.environ, "AUTOPAR_CACHE_DIR": cache, "PYTHONPATH": str(root)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{flags}: exit {done.returncode}\n{done.stderr[-3000:]}")
    wall, rss = done.stderr.strip().splitlines()[-1].split()
    plan = json.loads(out.read_text())
    plan["search"].pop("time_s")
    return {"wall": float(wall), "rss_mb": int(rss) / 1024, "plan": plan}


def cold(flags: str, runs: int, root: Path = ROOT) -> list[dict]:
    out = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="autopar-latency-") as cache:
            out.append(run_once(flags, cache, root))
    return out


def warm(flags: str, runs: int, root: Path = ROOT) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="autopar-latency-") as cache:
        run_once(flags, cache, root)
        return [run_once(flags, cache, root) for _ in range(runs)]


def summary(results: list[dict]) -> str:
    walls = [r["wall"] for r in results]
    same = all(r["plan"] == results[0]["plan"] for r in results)
    rss = max(r["rss_mb"] for r in results)
    return (
        f"{statistics.median(walls):.2f} | {min(walls):.2f}-{max(walls):.2f} | {rss:.0f} | "
        f"{'yes' if same else '**no**'}"
    )


def plan_line(results: list[dict]) -> str:
    plan = results[0]["plan"]
    pp, dp, tp = plan["mesh"]["shape"]
    sched = plan["schedule"]
    return (
        f"pp{pp} dp{dp} tp{tp}, {sched['name']} x {sched['microbatches']}, "
        f"{plan['predicted']['step_time_s']:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before", help="a git revision to time the same cases at")
    args = parser.parse_args()
    rows = []
    for name, flags, with_warm in CASES:
        got = {"cold": cold(flags, args.runs)}
        if with_warm:
            got["warm"] = warm(flags, args.runs)
        for kind, results in got.items():
            rows.append(f"| {name} | {kind} | {summary(results)} | {plan_line(results)} |")
            print(rows[-1], flush=True)
    before = []
    if args.before:
        with tempfile.TemporaryDirectory(prefix="autopar-before-") as tree:
            subprocess.run(
                ["git", "worktree", "add", "--detach", tree, args.before],
                cwd=ROOT,
                check=True,
                capture_output=True,
            )
            try:
                for name, flags, with_warm in CASES:
                    for kind, how in (("cold", cold), ("warm", warm))[: 1 + with_warm]:
                        results = how(flags, args.runs, Path(tree))
                        before.append(
                            f"| {name} | {kind}, {args.before} | {summary(results)} | "
                            f"{plan_line(results)} |"
                        )
                        print(before[-1], flush=True)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT)
    command = f"python bench/latency.py --runs {args.runs}"
    command += f" --before {args.before}" if args.before else ""
    text = header("Whole-command latency of `autopar plan` (issue 42)", command)
    text += "\n".join(
        [
            "",
            "Wall seconds of the whole command (`/usr/bin/time`: interpreter start, imports, "
            "tracing or the disk cache, the search, the baselines, writing the plan), median "
            f"of {args.runs} runs with the machine otherwise idle; cold: an empty "
            "AUTOPAR_CACHE_DIR per run; warm: the cache filled by one run before. 'same plan': "
            "every run's plan JSON equal but for its search time. Flags per case: "
            + "; ".join(f"{n}: `autopar plan {f}`" for n, f, _ in CASES)
            + ".",
            "",
            "| case | cache | median s | min-max s | peak RSS MB | same plan | plan |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            *before,
            "",
        ]
    )
    write("latency.md", text)


if __name__ == "__main__":
    main()
