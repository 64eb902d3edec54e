"""schemathesis with all its checks against a real `autopar serve` (planning workers on, SQLite
store), for a time budget; the failures and the set-aside answers (bench/schemathesis_hooks.py:
rules JSON Schema cannot state) go to bench/results/schemathesis.md.

    .venv/bin/python bench/schemathesis_run.py [--seconds 300] [--seed 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, write
from service_bench import free_port, start_service


def _failure_lines(out: str) -> list[str]:
    """Each failing operation with the answer it gave (schemathesis' report, shortened)."""
    lines, operation = [], ""
    for line in out.splitlines():
        if m := re.match(r"_+ (\w+ /\S*|Stateful tests) _+$", line):
            operation = m.group(1)
        elif line.startswith("    `{") or line.startswith("- ST"):
            lines.append(f"{operation}: {line.strip()}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="autopar-st-") as tmp:
        port = free_port()
        service = start_service(tmp, port)
        aside = Path(tmp) / "set-aside.ndjson"
        cli = Path(sys.executable).with_name("schemathesis")
        env = {
            **os.environ,
            "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
            "PYTHONPATH": str(Path(__file__).resolve().parent),
            "AUTOPAR_ST_SET_ASIDE": str(aside),
        }
        command = [
            str(cli),
            "run",
            f"http://127.0.0.1:{port}/openapi.json",
            "--checks",
            "all",
            "--max-time",
            str(args.seconds),
            "--seed",
            str(args.seed),
            "--request-timeout",
            "30",
            "--no-color",
        ]
        started = time.monotonic()
        run = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp)
        wall = time.monotonic() - started
        alive = service.poll() is None
        service.terminate()
        service.wait(timeout=30)
        out = run.stdout + run.stderr
        (Path(tmp) / "schemathesis.txt").write_text(out)
        lines = [json.loads(x) for x in aside.read_text().splitlines()] if aside.exists() else []
    summary = re.search(r"=+ (.*?) in [0-9.]+s =+", out)
    cases = re.search(r"(\d+) generated", out)
    failures = re.findall(r"❌ (ST\d+ [^:]+): (\d+)", out)
    rules = collections.Counter(x["rule"] for x in lines)
    examples = {}
    for x in lines:
        examples.setdefault(x["rule"], f"{x['operation']}: {x['error']}")
    text = header(
        "schemathesis, all checks",
        f"python bench/schemathesis_run.py --seconds {args.seconds} --seed {args.seed}",
    )
    text += "\n".join(
        [
            f"- run: {wall:.0f} s, {cases.group(1) if cases else '?'} test cases, exit code "
            f"{run.returncode}; the server {'stayed up' if alive else 'DIED'}",
            f"- schemathesis' summary: {summary.group(1) if summary else '(none found)'}",
            "",
            "## Failures",
            "",
            *([f"- {name}: {count}" for name, count in failures] or ["- none"]),
            *[f"  - `{line[:300]}`" for line in _failure_lines(out)],
            "",
            "## Set aside: schema-valid requests refused by a rule JSON Schema cannot state",
            "",
            "bench/schemathesis_hooks.py sets a failure aside only when every error of the 422",
            "names one of these rules; anything else stays a failure above.",
            "",
            "| rule | answers | first example |",
            "|---|---:|---|",
            *[
                f"| {rule} | {n} | `{examples[rule][:160].replace('|', '/')}` |"
                for rule, n in rules.most_common()
            ],
            "",
        ]
    )
    write("schemathesis.md", text)
    sys.exit(0 if run.returncode == 0 else 1)


if __name__ == "__main__":
    main()
