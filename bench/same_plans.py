"""Same requests, same plans: record or check the plans of Alpa's suite (bench/suite.py) and of
`make demo` against stored fixtures (tests/fixtures/same_plans/), ignoring timings, the
version string, the search's counters, float rounding past 9 digits and fields derived from
the plan after the fixtures were recorded (the ledger). A restructure that changes no
behaviour leaves every plan equal.

Run: python bench/same_plans.py [--record] [--only NAME ...]   (the suite's 21 cases take ~6 min
on 2 cores; tests/planner/test_same_plans.py checks the quick ones in `make test`)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import header, write
from suite import SUITES, suite_inputs

from planner.search.baselines import baseline
from planner.search.search import NoFeasiblePlan, search

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "same_plans"
AUTOPAR = [sys.executable, "-m", "api.cli"]
# `make demo`'s planning commands, each writing one plan (-o is appended).
DEMO = {
    "demo-estimate-gpt-39b": "estimate --model gpt-39b --cluster aws-p3.16xlarge --nodes 8 "
    "--dp 1 --tp 8 --pp 8 --microbatches 256 --global-batch 1024 --checkpointing --dtype fp16",
    "demo-plan-gpt-1.3b": "plan --model gpt-1.3b --cluster dgx-a100-80g --global-batch 512 "
    "--seq 1024",
    "demo-plan-cpu": "plan --model gpt-350m --config layers=4 hidden=128 heads=4 vocab=512 "
    "--cluster cpu-local --global-batch 8 --seq 64 --dtype fp32 --no-baselines "
    "--executable-only",
}


def normalise(plan: dict | None) -> dict | None:
    """The plan without what may differ between two identical runs."""
    if plan is None:
        return None
    plan = json.loads(json.dumps(plan))
    plan.pop("autopar_version", None)
    plan.get("search", {}).pop("time_s", None)
    return plan


def suite_case(name: str, gpus: int, dtype: str, batch: int) -> tuple[dict, float]:
    inputs = suite_inputs(name, gpus, dtype, batch)
    t0 = time.perf_counter()
    try:
        plan = search(inputs).plan.model_dump(mode="json")
    except NoFeasiblePlan as err:
        plan = {"infeasible": str(err)}
    search_s = time.perf_counter() - t0
    out = {"plan": normalise(plan)}
    for kind in ("megatron", "dp", "fsdp"):
        found = baseline(kind, inputs).plan
        out[kind] = normalise(found.model_dump(mode="json") if found else None)
    return out, search_s


def demo_case(args: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        subprocess.run(
            [*AUTOPAR, *args.split(), "-o", str(path)],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )
        return {"plan": normalise(json.loads(path.read_text()))}


COUNTERS = ("candidates_evaluated", "candidates_pruned", "complete", "ilp_calls", "time_s")
# Derived from the plan and recorded after the fixtures (issue 36); what it says is checked
# against runs by the executor's tests (tests/executor/ledger_check.py).
DERIVED = ("ledger",)


def comparable(value, key: str = ""):
    """What must stay equal: floats to 9 significant digits, the search's counters,
    candidate counts and derived fields left out."""
    if isinstance(value, dict):
        return {
            k: comparable(v, k)
            for k, v in value.items()
            if not (key == "search" and k in COUNTERS) and k not in DERIVED
        }
    if isinstance(value, list):
        return [comparable(v) for v in value]
    if isinstance(value, float):
        return float(f"{value:.9g}")
    if isinstance(value, str):
        return re.sub(r"out of \d+ fitting candidates", "out of N fitting candidates", value)
    return value


def cases() -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for dtype, batch, models in SUITES.values():
        for name, gpus in models:
            out[f"{name}-{gpus}gpu"] = ("suite", name, gpus, dtype, batch)
    for key, args in DEMO.items():
        out[key] = ("demo", args)
    return out


def produce(case: tuple) -> tuple[dict, float | None]:
    if case[0] == "demo":
        return demo_case(case[1]), None
    return suite_case(*case[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", action="store_true", help="overwrite the fixtures")
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    args = parser.parse_args()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    differ, rows = [], []
    for key, case in cases().items():
        if args.only and key not in args.only:
            continue
        got, search_s = produce(case)
        path = FIXTURES / f"{key}.json"
        text = json.dumps(got, sort_keys=True, separators=(",", ":")) + "\n"
        if args.record:
            path.write_text(text)
            same = "recorded"
        else:
            want = comparable(json.loads(path.read_text()))
            same = "same" if comparable(json.loads(text)) == want else "DIFFERENT"
            if same == "DIFFERENT":
                differ.append(key)
        print(f"{key}: {same}" + (f" search {search_s:.1f} s" if search_s else ""), flush=True)
        rows.append(f"| {key} | {same} | " + (f"{search_s:.1f}" if search_s else "-") + " |")
    if not args.record and not args.only:
        text = header("Same requests, same plans", "python bench/same_plans.py")
        text += "\n| case | plan vs fixture | search s |\n|---|---|---|\n" + "\n".join(rows)
        write("same_plans.md", text + "\n")
    if differ:
        sys.exit(f"plans differ from the fixtures: {', '.join(differ)}")


if __name__ == "__main__":
    main()
