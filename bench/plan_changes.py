"""The recorded plans (tests/fixtures/same_plans/) against those of an earlier commit: per case
the chosen plan's schedule, chunks per device and predicted step time, before and after. Run
after `python bench/same_plans.py --record` when a search dimension is added, to show that no
plan got slower and by how much the new dimension helps.

Run: python bench/plan_changes.py --before COMMIT   (writes bench/results/plan_changes.md)
"""

from __future__ import annotations

import argparse
import json
import subprocess

from common import RESULTS, header, write

FIXTURES = "tests/fixtures/same_plans"
ROOT = RESULTS.parents[1]


def _plans(fixture: dict) -> dict[str, dict]:
    return {k: v for k, v in fixture.items() if v and "predicted" in v}


def _describe(plan: dict) -> str:
    s = plan["schedule"]
    pp, dp, tp = plan["mesh"]["shape"]
    return f"pp{pp} dp{dp} tp{tp}, {s['name']} v{s['virtual_stages']}, m {s['microbatches']}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the commit whose fixtures to compare with")
    ap.add_argument("--out", default="plan_changes.md", help="result file under bench/results")
    ap.add_argument(
        "--allow-slower",
        action="store_true",
        help="a cost-model correction may make plans slower (or not fit): list, do not fail",
    )
    args = ap.parse_args()
    rows, slower = [], []
    for path in sorted((ROOT / FIXTURES).glob("*.json")):
        old_text = subprocess.run(
            ["git", "show", f"{args.before}:{FIXTURES}/{path.name}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        old, new = _plans(json.loads(old_text)), _plans(json.loads(path.read_text()))
        for part in sorted(old):
            a, b = old[part], new.get(part)
            if b is None:  # no longer fits (a memory term was added)
                rows.append(f"| {path.stem} ({part}) | {_describe(a)} | does not fit | - | - | - |")
                slower.append(f"{path.stem} {part} (does not fit)")
                continue
            t0, t1 = a["predicted"]["step_time_s"], b["predicted"]["step_time_s"]
            if t1 > t0 * (1 + 1e-9):
                slower.append(f"{path.stem} {part}")
            if _describe(a) != _describe(b) or abs(t1 - t0) > 1e-9 * t0:
                rows.append(
                    f"| {path.stem} ({part}) | {_describe(a)} | {_describe(b)} | {t0:.4f} "
                    f"| {t1:.4f} | {(t0 - t1) / t0:.2%} |"
                )
    text = header(
        "Plans against an earlier commit", f"python bench/plan_changes.py --before {args.before}"
    )
    text += (
        f"\nFixtures of {args.before} against this checkout's; only the plans that changed "
        "(schedule, chunks per device, micro-batches or step time). Slower: "
        f"{', '.join(slower) or 'none'}.\n\n"
        "| case | before | after | step s before | step s after | faster by |\n"
        "| --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n"
    )
    write(args.out, text)
    if slower and not args.allow_slower:
        raise SystemExit(f"slower than {args.before}: {', '.join(slower)}")


if __name__ == "__main__":
    main()
