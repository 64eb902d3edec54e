"""Search time of this checkout against an earlier commit, measured alternately in the same
minutes (this machine's speed drifts by up to ~1.6x over an hour, so figures taken at
different times do not compare). Each run is a fresh process with an empty disk cache (cold),
then again with the cache it left (warm), exactly as bench/search_scale.py measures; the
earlier commit runs from a git worktree with this checkout's virtual environment.

Used for issue 16's "search time no worse than 1.5x before these dimensions were added".

Run: python bench/search_ab.py --before 4002f81 [--reps 2] [--long-context] [--out NAME]
(writes results/search_ab.md or NAME)
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
from search_scale import ACCEPTANCE, CHILD

ROOT = Path(__file__).resolve().parent.parent
CASES = [c for c in ACCEPTANCE if c[1] in ("gpt-39b", "llama3-70b") and not c[2]]
# where context parallelism and its sequence exchanges are searched
LONG_CONTEXT = [("llama3-8b 128K, 64 H100", "llama3-8b", {}, "dgx-h100", 8, 32, 131072, "bf16")]


def _run(case: tuple, source: Path, cache: str) -> dict:
    _, model, config, cluster, nodes, batch, seq, dtype = case
    args = json.dumps([model, config, cluster, nodes, batch, seq, dtype])
    out = subprocess.run(
        [sys.executable, "-c", CHILD, args],
        capture_output=True,
        text=True,
        check=True,
        cwd=source,
        env={**os.environ, "AUTOPAR_CACHE_DIR": cache, "PYTHONPATH": str(source)},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the earlier commit")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="search_ab.md", help="the result file under results/")
    ap.add_argument("--long-context", action="store_true", help="the long-sequence case only")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tree:
        subprocess.run(["git", "worktree", "add", "-f", tree, args.before], check=True, cwd=ROOT)
        try:
            cases = LONG_CONTEXT if args.long_context else CASES
            rows = [_case(case, Path(tree), args.reps) for case in cases]
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, check=False)
    lines = [
        header(
            "Search time against an earlier commit",
            f"python bench/search_ab.py --before {args.before}"
            + (" --long-context" if args.long_context else ""),
        ),
        "",
        f"Before = commit {args.before}, after = this checkout; in-process plan seconds (as in "
        "search_scale.md), median of the alternating runs; ratio = after / before.",
        "",
        "| case | cold before | cold after | ratio | warm before | warm after | ratio "
        "| evaluated before / after | step s before / after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]
    write(args.out, "\n".join(lines) + "\n")


def _case(case: tuple, before: Path, reps: int) -> str:
    got: dict[str, dict[str, list]] = {"before": {}, "after": {}}
    for _ in range(reps):
        for side, source in (("before", before), ("after", ROOT)):
            with tempfile.TemporaryDirectory() as cache:
                cold = _run(case, source, cache)
                warm = _run(case, source, cache)
            for key, value in (("cold", cold["plan_s"]), ("warm", warm["plan_s"])):
                got[side].setdefault(key, []).append(value)
            got[side]["evaluated"] = [cold["evaluated"]]
            got[side]["step"] = [cold["step_s"]]
    med = {s: {k: statistics.median(v) for k, v in d.items()} for s, d in got.items()}
    b, a = med["before"], med["after"]
    row = (
        f"| {case[0]} | {b['cold']:.2f} | {a['cold']:.2f} | {a['cold'] / b['cold']:.2f} | "
        f"{b['warm']:.2f} | {a['warm']:.2f} | {a['warm'] / b['warm']:.2f} | "
        f"{b['evaluated']:.0f} / {a['evaluated']:.0f} | {b['step']:.2f} / {a['step']:.2f} |"
    )
    print(row, flush=True)
    return row


if __name__ == "__main__":
    main()
