"""schemathesis (its CLI, property-based) against the app's own OpenAPI schema on a live
server: no 5xx, every status code documented, every response matching its schema, what the
schema refuses refused and what it allows accepted (but for the rules JSON Schema cannot
state, bench/schemathesis_hooks.py; bench/schemathesis_run.py runs all checks for longer)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "negative_data_rejection",
        "positive_data_acceptance",
    ]
)
BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_api_conforms_to_its_schema(live_server, tmp_path):
    cli = Path(sys.executable).with_name("schemathesis")
    run = subprocess.run(
        [
            str(cli),
            "run",
            f"{live_server}/openapi.json",
            "--checks",
            CHECKS,
            "--max-examples",
            "15",  # per operation: 71 s at 30 on the 2-core CI machine
            "--seed",
            "1",
            "--request-timeout",
            "30",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks", "PYTHONPATH": str(BENCH)},
    )
    report = run.stdout[-6000:] + run.stderr[-2000:]
    (tmp_path / "schemathesis.txt").write_text(run.stdout + run.stderr)
    assert run.returncode == 0, report
    assert "passed" in run.stdout.lower(), report
