"""Launch a plan locally with torchrun and collect what every rank measured.

torchrun runs in a new process session with a deadline: a rank that raises or dies ends the
job (torchrun stops the others), and whatever is still running at the deadline is killed as a
group, so no process outlives the call. Each rank writes rank{R}.json (its steps) or
rank{R}.error.json (its error); a rank that wrote neither is named from torchrun's report.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from executor.lifetime import SAFE_PATH, die_with_parent
from planner.plan import Plan


@dataclass
class ExecutionResult:
    status: str  # "succeeded" | "failed" | "timed_out"
    returncode: int
    wall_s: float
    ranks: dict[int, dict] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    failed_rank: int | None = None  # the rank that caused the failure
    measured_step_s: float | None = None
    predicted_step_s: float | None = None
    measured_peak_rss_bytes: int | None = None
    # per process, the resident memory the run added above what it held before building the
    # model (CPU), or the caching allocator's peak (CUDA): what compares with the prediction
    measured_run_memory_bytes: int | None = None
    measured_memory_kind: str | None = None  # "rss growth" | "allocator peak"
    predicted_peak_bytes: int | None = None
    log: str = ""

    def headline(self) -> str | None:
        """The error to show first: the failed rank's own message (None on success)."""
        if self.status == "succeeded":
            return None
        rank = self.failed_rank
        message = self.errors.get(rank) if rank is not None else None
        message = message or next(iter(self.errors.values()), "")
        return f"rank {rank}: {message}" if rank is not None else message

    def summary(self) -> dict:
        return {
            "status": self.status,
            "returncode": self.returncode,
            "wall_s": self.wall_s,
            "measured_step_s": self.measured_step_s,
            "predicted_step_s": self.predicted_step_s,
            "measured_peak_rss_bytes": self.measured_peak_rss_bytes,
            "measured_run_memory_bytes": self.measured_run_memory_bytes,
            "measured_memory_kind": self.measured_memory_kind,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "failed_rank": self.failed_rank,
            "errors": {str(k): v for k, v in self.errors.items()},
            "ranks": {
                str(k): {"steps": v["steps"], "start_rss_bytes": v.get("start_rss_bytes")}
                for k, v in self.ranks.items()
            },
        }


def execute(
    plan_path: str | Path,
    out_dir: str | Path,
    *,
    steps: int = 3,
    nproc_per_node: int | None = None,
    lr: float | None = None,
    seed: int = 0,
    timeout_s: float = 300.0,
    rank_timeout_s: float = 30.0,
    env: dict[str, str] | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    momentum: float = 0.0,
    max_grad_norm: float = 1.0,
    data: str | None = None,
    model: str | None = None,
    cancel: threading.Event | None = None,
) -> ExecutionResult:
    """Run `plan_path` under torchrun; `cancel`, when set, stops the job (status "cancelled")."""
    plan = Plan.from_json(Path(plan_path).read_text())
    world = plan.mesh.processes
    nproc = nproc_per_node or world
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    flags = {
        "--steps": steps,
        "--lr": lr,
        "--seed": seed,
        "--timeout": rank_timeout_s,
        "--out": out,
        "--momentum": momentum or None,
        "--max-grad-norm": max_grad_norm,
        "--data": data,
        "--model": model,
        "--checkpoint-dir": checkpoint_dir,
        "--checkpoint-every": checkpoint_every if checkpoint_dir else None,
    }
    cmd = _worker_command(plan_path, nproc, flags, resume)
    log_path = out / "torchrun.log"
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={
                **os.environ,
                **(env or {}),
                **SAFE_PATH,
                "AUTOPAR_LAUNCHER_PID": str(os.getpid()),
            },
            # torchrun dies with this process (and its ranks with torchrun), even on kill -9.
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
        code, status = _wait(proc, timeout_s, cancel)
    wall = time.perf_counter() - started
    text = log_path.read_text()
    result = ExecutionResult(status, code, wall, log=text[-4000:])
    _collect(result, out, world, text, log_path)
    _fill_measurements(result, plan)
    return result


def _worker_command(plan_path, nproc: int, flags: dict, resume: bool) -> list[str]:
    """torchrun on this host, one executor.worker per rank; `flags` with value None are left
    out (the worker's defaults apply)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        # --standalone: the rendezvous store binds port 0 itself and the ranks share it. A
        # port picked here and passed as --master-port could be taken by another process
        # before torchrun binds it (EADDRINUSE was seen in CI with gloo jobs beside it).
        "--standalone",
        "--local-addr",
        "127.0.0.1",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "executor.worker",
        str(plan_path),
    ]
    for flag, value in flags.items():
        if value is not None:
            cmd += [flag, str(value)]
    if resume:
        cmd.append("--resume")
    return cmd


def _collect(result: ExecutionResult, out: Path, world: int, text: str, log_path: Path) -> None:
    """Per-rank results and errors; when the job failed, the rank that failed first."""
    status, code = result.status, result.returncode
    for r in range(world):
        ok, err = out / f"rank{r}.json", out / f"rank{r}.error.json"
        if ok.exists():
            result.ranks[r] = json.loads(ok.read_text())
        elif err.exists():
            result.errors[r] = json.loads(err.read_text())["error"]
    if status in ("failed", "timed_out"):
        for r in _dead_ranks(text):
            result.errors.setdefault(r, "the process died (no error report; see torchrun.log)")
        dead = _dead_ranks(text)
        causes = [r for r, e in result.errors.items() if not _PEER_GONE.search(e)]
        result.failed_rank = (dead or causes or sorted(result.errors) or [None])[0]
        if not result.errors:
            result.errors[-1] = f"job {status} with exit code {code}; see {log_path}"


# Errors that only say another rank went away: consequences, not causes.
_PEER_GONE = re.compile(r"closed by peer|reset by peer|failed to run forward|Connection", re.I)


def _wait(
    proc: subprocess.Popen, timeout_s: float, cancel: threading.Event | None
) -> tuple[int, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            code = proc.wait(timeout=0.2)
            return code, "succeeded" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            pass
        if cancel is not None and cancel.is_set():
            _kill_group(proc)
            return -15, "cancelled"
        if time.monotonic() > deadline:
            _kill_group(proc)
            return -9, "timed_out"


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _dead_ranks(log: str) -> list[int]:
    """Ranks torchrun reports as failed with a signal (killed, crashed)."""
    ranks = []
    for m in re.finditer(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", log):
        ranks.append(int(m.group(2)))
    for m in re.finditer(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-\d+)", log):
        if int(m.group(2)) not in (-15,):  # SIGTERM: stopped by torchrun, not the cause
            ranks.append(int(m.group(1)))
    return sorted(set(ranks))


def _fill_measurements(result: ExecutionResult, plan: Plan) -> None:
    result.predicted_step_s = plan.predicted.step_time_s
    result.predicted_peak_bytes = plan.predicted.peak_memory_bytes
    if not result.ranks:
        return
    per_step = []
    steps = min(len(r["steps"]) for r in result.ranks.values())
    if steps == 0:
        return
    for s in range(steps):
        per_step.append(max(r["steps"][s]["time_s"] for r in result.ranks.values()))
    # the first step includes one-off setup; the recorded one (executor.ledger) the
    # recorder's own per-op cost
    recorded = {s for r in result.ranks.values() for s in range(steps) if "ledger" in r["steps"][s]}
    warm = [t for s, t in enumerate(per_step) if s and s not in recorded]
    warm = warm or per_step[1:] or per_step
    result.measured_step_s = statistics.median(warm)
    result.measured_peak_rss_bytes = max(
        max(st["peak_rss_bytes"] for st in r["steps"]) for r in result.ranks.values()
    )
    device_peaks = [st.get("peak_device_bytes") for r in result.ranks.values() for st in r["steps"]]
    if all(p is not None for p in device_peaks):
        result.measured_run_memory_bytes = max(device_peaks)
        result.measured_memory_kind = "allocator peak"
    elif all("start_rss_bytes" in r for r in result.ranks.values()):
        result.measured_run_memory_bytes = max(
            max(st["peak_rss_bytes"] for st in r["steps"]) - r["start_rss_bytes"]
            for r in result.ranks.values()
        )
        result.measured_memory_kind = "rss growth"
