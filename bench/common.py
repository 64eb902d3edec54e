"""Shared helpers for bench scripts: machine description and result tables."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
        cpu = model
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Python {platform.python_version()}"


def header(title: str, command: str) -> str:
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return "\n".join(
        [
            f"# {title}",
            "",
            f"- date: {datetime.date.today().isoformat()}",
            f"- command: `{command}`",
            f"- machine: {machine()}",
            f"- torch {torch.__version__}, autopar commit {commit or 'uncommitted'}",
            "",
        ]
    )


def write(name: str, text: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(text)
    print(text)
    print(f"wrote {path}", file=sys.stderr)
    return path
