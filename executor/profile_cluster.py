"""`autopar profile-cluster`: run the profiling worker under torchrun, show its progress, fit
the timings and write a cluster profile (same schema as the bundled ones, plus `measured`).

On one machine it starts all ranks itself. On several nodes, run the same command on every
node with --nnodes, --node-rank and --master-addr (torchrun's static rendezvous); node 0
writes the profile.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from executor.errors import ExecutionError
from planner.cluster.profile import ClusterProfile
from planner.cluster.profile_fit import build_profile
from planner.cluster.profiling import inline_op_db


def profile_cluster(
    base: ClusterProfile,
    out: str | Path,
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 29511,
    repeats: int = 5,
    max_bytes: int = 0,
    dtypes: str = "fp32",
    name: str | None = None,
    op_db: str | None = None,
    timeout_s: float = 1800,
    say: Callable[[str], None] = print,
) -> ClusterProfile | None:
    """Measure and write the profile (None on nodes other than 0, which only take part)."""
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc_per_node}",
            f"--node-rank={node_rank}",
            f"--master-addr={master_addr}",
            f"--master-port={master_port}",
            "-m",
            "executor.profile_worker",
            "--out",
            str(raw_path),
            "--repeats",
            str(repeats),
            "--max-bytes",
            str(max_bytes),
            "--dtypes",
            dtypes,
        ]
        started = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            tail = [*tail[-40:], line]
            if line.startswith(("[", "compute", "overlap")):
                say(f"  [{time.perf_counter() - started:6.1f}s] {line}")
            if time.perf_counter() - started > timeout_s:
                proc.kill()
                break
        code = proc.wait()
        if code != 0:
            raise ExecutionError(
                f"profiling failed (torchrun exit code {code}):\n" + "\n".join(tail[-15:])
            )
        if node_rank != 0:
            return None
        raw = json.loads(raw_path.read_text())
    profile = build_profile(base, raw, name=name)
    if op_db:
        profile = inline_op_db(profile, op_db)
    Path(out).write_text(
        "# Measured by `autopar profile-cluster`; `measured` holds the raw points and fits.\n"
        + yaml.safe_dump(profile.model_dump(mode="json", exclude_none=True), sort_keys=False)
    )
    return profile
