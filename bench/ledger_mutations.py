"""Issue 36's mutations: each makes the executor skip or change one technique the way it used
to (or could), in a copy of this checkout, and runs the equivalence cases that should notice;
a mutation passes the bar when at least one of them fails. The table says which failed and
how (the ledger check, the reference's numbers, or a hang).

    python bench/ledger_mutations.py [--out bench/results/ledger_mutations.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASE = "tests/executor/test_execute.py::test_plan_matches_single_process_reference[{}]"

# name: (file, [(text, replacement), ...], cases)
MUTATIONS = {
    "gradients reduced every micro-batch": (
        "executor/training.py",
        [("    every = zero == 3\n", "    every = True\n")],
        ["dp4-zero0-accumulate", "dp4-zero2-accumulate"],
    ),
    "tensor parallelism not applied": (
        "executor/tensor_parallel.py",
        [
            (
                "    if tp_mesh.size() == 1:\n        return\n    plan = tensor_parallel_plan(",
                "    if True:\n        return\n    plan = tensor_parallel_plan(",
            )
        ],
        ["dp2xtp2-activation-offload", "tp4-fp8-tensorwise"],
    ),
    "sequence parallelism not applied": (
        "executor/parallelize.py",
        [
            (
                "            plan.sequence_parallel,\n            share_inputs=",
                "            False,\n            share_inputs=",
            )
        ],
        ["llama-pp2xtp2-sequence-parallel", "dp2xtp2-sequence-parallel-zero3-ckpt"],
    ),
    "ZeRO-1 run as ZeRO-2": (  # as the executor ran it: FSDP2 sharding gradients too
        "executor/parallelize.py",
        [
            (
                "sharding_mesh(mesh), st.zero,",
                "sharding_mesh(mesh), 2 if st.zero == 1 else st.zero,",
            ),
            ("        if st.zero == 1 and plan.mesh.shape[1] > 1:", "        if False:"),
        ],
        ["dp4-zero1", "pp2xdp2-activation-offload"],
    ),
    "pipeline sends dropped (the gradients back across a cut)": (
        "executor/graph_pipeline.py",
        [("            grad = node.name in grads\n", "            grad = False\n")],
        ["pp2xtp2-per-node-zbv"],
    ),
    "activation checkpointing not applied (module path)": (  # the activation peak notices
        "executor/checkpointing.py",
        [
            (
                "    for key, block in list(stage.owned_blocks().items())[:count]:",
                "    for key, block in []:",
            )
        ],
        ["dp4-zero1-ckpt", "dp2xtp2-zero3-ckpt"],
    ),
    "logits gathered under a vocab-parallel plan": (
        "executor/parallelize.py",
        [("    vocab_loss = plan.mesh.shape[2] > 1 and", "    vocab_loss = False and")],
        ["dp2xtp2-activation-offload"],
    ),
}


def _copy() -> Path:
    """This checkout's tracked files, as committed plus the working tree's changes."""
    dest = Path(tempfile.mkdtemp(prefix="autopar-mutation-"))
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in files:
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
    return dest


def run(name: str, spec: tuple) -> dict:
    path, edits, cases = spec
    copy = _copy()
    target = copy / path
    source = target.read_text()
    for text, replacement in edits:
        if text not in source:
            return {"name": name, "error": f"{path}: the text to mutate is not there"}
        source = source.replace(text, replacement, 1)
    target.write_text(source)
    ids = [CASE.format(c) for c in cases]
    env = {**os.environ, "PYTHONPATH": str(copy)}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=line", *ids],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    # --tb=line: one "path:line: Error: message" per failed case, in the order they ran
    failed = [
        line
        for line in proc.stdout.splitlines()
        if line.startswith("/") and ("Error" in line or "Empty" in line)  # not warnings
    ]
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return {
        "name": name,
        "cases": cases,
        "failed": failed or [f"-: {summary}"],
        "seconds": time.perf_counter() - started,
    }


def _failure(line: str) -> str:
    """`path:line: Error: message` as `Error: message`, cut short."""
    why = line.split(": ", 1)[-1]
    return why[:140].replace("|", "/")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "bench/results/ledger_mutations.md"))
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    lines = [
        f"# Ledger mutations ({datetime.date.today()})",
        "",
        f"Command: `python bench/ledger_mutations.py`; machine: {platform.machine()}, "
        f"{os.cpu_count()} cores; commit {commit}.",
        "",
        "| mutation | cases run | failed | seconds |",
        "| --- | --- | --- | --- |",
    ]
    for name, spec in MUTATIONS.items():
        result = run(name, spec)
        if "error" in result:
            lines.append(f"| {name} | - | {result['error']} | - |")
            continue
        failed = "<br>".join(_failure(f) for f in result["failed"]) or "none"
        lines.append(
            f"| {name} | {', '.join(result['cases'])} | {failed} | {result['seconds']:.0f} |"
        )
        print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
