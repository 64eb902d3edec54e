"""Issue 42's batch search: `autopar plan --global-batch auto` for Llama-3-8B on 64 H100 (8K
tokens), against planning each batch of the range alone; the whole command's time beside one
fixed-batch plan's.

Run: python bench/batch_search.py   (writes bench/results/batch_search.md)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import header, write

ARGS = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "8", "--seq", "8192"]
BATCHES = [64, 128, 256, 512, 1024]  # auto on 64 GPUs: 1 to 16 samples per device


def plan(batch: str, cache: str) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory() as out:
        path = Path(out) / "plan.json"
        started = time.perf_counter()
        command = [*ARGS, "--global-batch", batch, "--no-baselines", "-o", str(path)]
        subprocess.run(
            [sys.executable, "-m", "api.cli", "plan", *command],
            check=True,
            capture_output=True,
            env={**os.environ, "AUTOPAR_CACHE_DIR": cache},
        )
        return json.loads(path.read_text()), time.perf_counter() - started


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        plan("64", cache)  # the trace cached: the commands below time planning, not tracing
        auto, auto_s = plan("auto", cache)
        alone = {b: plan(str(b), cache) for b in BATCHES}
    rows = []
    for b, (p, seconds) in alone.items():
        pred = p["predicted"]
        rows.append(
            f"| {b} | {p['mesh']['shape']} | {p['schedule']['name']}, "
            f"{p['schedule']['microbatches']} micro-batches | {pred['step_time_s']:.3f} | "
            f"{pred['tokens_per_s'] / 64:,.0f} | {pred['mfu']:.1%} | {seconds:.1f} |"
        )
    best = max(BATCHES, key=lambda b: alone[b][0]["predicted"]["tokens_per_s"])
    chosen = auto["request"]["training"]["global_batch_size"]
    same = auto["predicted"]["step_time_s"] == alone[best][0]["predicted"]["step_time_s"]
    lines = [
        header(
            "The global batch searched: Llama-3-8B on 64 H100 (issue 42)",
            "python bench/batch_search.py",
        ),
        "`autopar plan " + " ".join(ARGS) + " --global-batch auto --no-baselines` against the "
        "same command at each batch of auto's range (1 to 16 samples per GPU), each a fresh "
        "process on a shared disk cache (the trace made once beforehand).",
        "",
        "| global batch | mesh (pp, dp, tp) | schedule | step s | tokens/s per GPU | MFU | "
        "command s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"`auto` chose **{chosen}** ({'the same plan as' if same else 'NOT the plan of'} "
        f"planning {best} alone, the best of the five) in **{auto_s:.1f} s**, against "
        f"{alone[64][1]:.1f}-{max(s for _, s in alone.values()):.1f} s for one batch.",
        "",
        "Its explanation:",
        "",
        *[f"- {x}" for x in auto["explanation"] if "batch" in x],
        "",
    ]
    write("batch_search.md", "\n".join(lines))


if __name__ == "__main__":
    main()
