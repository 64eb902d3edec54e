"""Issue 36's property check: 50 seeded random pinned plans (tests/executor/ledger_property.py,
seed 36; the test runs the first 8), each planned by the default search and run for two steps
on 4 gloo processes. Records, per draw: no plan fits the pins / the executor refused it / the
run failed / the ledger matched exactly / it matched but for a listed gap / it differed; and
the activation peak measured against the plan's.

    python bench/ledger_property.py [--count 50] [--out bench/results/ledger_property.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from executor.local_ranks import run_local  # noqa: E402
from tests.executor.ledger_check import (  # noqa: E402
    ACTIVATION_TOLERANCE,
    activation_errors,
    check_ledger,
)
from tests.executor.ledger_property import draw, plan_for  # noqa: E402


def one(family: str, pins: list[str]) -> tuple[str, str, str]:
    """(outcome, detail, the activation peak's worst rank: measured vs predicted)."""
    plan = plan_for(family, pins, Path(tempfile.mkdtemp()))
    if plan is None:
        return "no plan", "", ""
    if not plan.executable:
        return "refused by the plan", plan.not_executable_reason or "", ""
    try:
        ranks = run_local(plan, steps=2, timeout_s=240)
    except Exception as err:  # the executor refused or the run failed: recorded
        return "run failed", str(err).splitlines()[0][:120], ""
    worst = max(activation_errors(plan, ranks).values(), key=abs)
    activations = f"{worst:+.0%}" + ("" if abs(worst) <= ACTIVATION_TOLERANCE else " (outside)")
    try:
        check_ledger(plan, ranks)
    except AssertionError as err:
        return "ledger differs", str(err)[:160], activations
    return "exact", "", activations


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--out", default=str(ROOT / "bench/results/ledger_property.md"))
    args = parser.parse_args()
    rng = random.Random(36)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    rows, outcomes, inside = [], Counter(), 0
    started = time.perf_counter()
    for i in range(args.count):
        family, pins = draw(rng)
        outcome, detail, activations = one(family, pins)
        outcomes[outcome] += 1
        inside += activations != "" and "outside" not in activations
        rows.append(
            f"| {i} | {family} | {' '.join(pins)} | {outcome} | {detail.replace('|', '/')} "
            f"| {activations} |"
        )
        print(rows[-1], flush=True)
    lines = [
        f"# Ledger property check ({datetime.date.today()})",
        "",
        f"Command: `python bench/ledger_property.py --count {args.count}`; machine: "
        f"{platform.machine()}, {os.cpu_count()} cores, torch gloo; commit {commit}; "
        f"{time.perf_counter() - started:.0f} s.",
        "",
        "Outcomes: " + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())),
        "",
        f"Activation peak (executor.ledger.LiveBytes against the plan's activation memory, "
        f"the worst rank): within {ACTIVATION_TOLERANCE:.0%} on {inside} of the runs.",
        "",
        "| # | model | pins | outcome | detail | activation peak, measured vs predicted |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
