"""Job runners of one service replica: planning processes and local executions.

The store is the queue (store.py): several replicas can share one database. Each replica
runs a supervisor thread that, every tick, renews the leases of the jobs it runs (a job that
is no longer its own, because it was cancelled, deleted or taken over, is stopped), hands
jobs whose lease expired (a dead replica's) back to the queue, reaps finished planning
processes, stops those past the time limit, and claims queued jobs while it has room.

Planning never runs on the event loop nor in the service process: each job gets its own
process with a memory limit, forked from a fork server (multiprocessing's "forkserver": a
fresh single-threaded interpreter, so nothing is inherited from the server's threads) that
imported the planner and torch once at start-up, so a job does not pay their ~2 s import. Jobs
die with the server (executor/lifetime.py; the fork server exits with it), as does a local
execution's torchrun.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from api.service.heartbeat import Heartbeat
from api.service.metrics import Metrics
from api.service.planning import plan_job
from api.service.settings import Settings
from api.service.store import Lost, QueueFull, Store
from executor.lifetime import safe_path

# Imported once by the fork server; each planning job starts with them loaded (torch._dynamo,
# which torch.export loads at a job's first trace, alone takes ~2 s to import).
PRELOAD = [
    "api.service.orphan_guard",
    "api.service.planning",
    "api.compare",
    "planner.search.search",
    "planner.models",
    "planner.graph.tracing",
    "torch._dynamo",
]


def _start_fork_server() -> None:
    """Start the fork server (and its imports) now rather than at the first job; then import
    what this process prices cached answers with (api.service.submit) rather than at the
    first such request."""
    from multiprocessing import forkserver

    with contextlib.suppress(Exception), _fork_server_environment():  # else the first job
        forkserver.ensure_running()
    import planner.planning  # noqa: F401


def _fork_server_environment():
    """The fork server's start: no working directory on its import path, and the replica's
    pid for api.service.orphan_guard."""
    return safe_path(AUTOPAR_REPLICA_PID=str(os.getpid()))


@dataclass
class _Job:
    proc: multiprocessing.process.BaseProcess
    token: str
    started: float  # monotonic


class PlanRunner:
    def __init__(self, store: Store, settings: Settings, metrics: Metrics, owner: str):
        self.store, self.settings, self.metrics, self.owner = store, settings, metrics, owner
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)
        threading.Thread(target=_start_fork_server, daemon=True).start()
        self._running: dict[str, _Job] = {}
        self._lock = threading.Lock()

    def running(self) -> int:
        with self._lock:
            return len(self._running)

    def cancel(self, plan_id: str) -> bool:
        """Stop the job's process if this replica runs it; True if it did."""
        with self._lock:
            job = self._running.pop(plan_id, None)
        if job is None:
            return False
        _kill(job.proc)
        return True

    def stop(self) -> None:
        """Service shutdown: stop the processes and give their jobs back to the queue."""
        with self._lock:
            jobs, self._running = dict(self._running), {}
        for plan_id, job in jobs.items():
            _kill(job.proc)
            self._write(
                plan_id,
                job.token,
                status="queued",
                owner=None,
                lease_token=None,
                lease_expires_at=None,
                progress_step="re-queued: the service stopped",
            )

    def keep(self, tokens: set[str]) -> None:
        """Stop jobs whose lease this replica no longer holds (a job that just wrote its own
        outcome is among them: it is reaped and counted here, as tick would)."""
        with self._lock:
            lost = {i: j for i, j in self._running.items() if j.token not in tokens}
            for plan_id in lost:
                del self._running[plan_id]
        for plan_id, job in lost.items():
            _kill(job.proc)
            self._record(plan_id, time.monotonic() - job.started)

    def tick(self) -> None:
        now = time.monotonic()
        limit = self.settings.job_time_limit_s
        with self._lock:
            finished = {i: j for i, j in self._running.items() if not j.proc.is_alive()}
            late = {i: j for i, j in self._running.items() if i not in finished}
            late = {i: j for i, j in late.items() if now - j.started > limit}
            for plan_id in (*finished, *late):
                del self._running[plan_id]
        for plan_id, job in late.items():
            _kill(job.proc)
            self._close(plan_id, job, f"planning exceeded the per-job time limit of {limit:g} s")
        for plan_id, job in finished.items():
            job.proc.join(timeout=1)
            # Refused (harmlessly) when the job wrote its own outcome, as it does.
            self._close(plan_id, job, f"the planning process died (exit code {job.proc.exitcode})")
        while self.running() < self.settings.plan_workers:
            claim = self.store.claim_plan(self.owner, self.settings.lease_s)
            if claim is None:
                break
            self._start(*claim)
        self.metrics.jobs_running.set(self.running())

    def _start(self, plan_id: str, token: str) -> None:
        proc = self._ctx.Process(
            target=plan_job,
            args=(
                self.store.url,
                plan_id,
                token,
                os.getpid(),
                self.settings.worker_memory_bytes,
                self.settings.cache_dir,
            ),
            name=f"plan-{plan_id}",
        )
        with _fork_server_environment():  # in case the fork server starts here
            proc.start()
        with self._lock:
            self._running[plan_id] = _Job(proc, token, time.monotonic())

    def _close(self, plan_id: str, job: _Job, error: str) -> None:
        """Fail a job whose process is gone, unless it already ended; count it."""
        self._write(plan_id, job.token, status="failed", error=error, finished_at=time.time())
        self._record(plan_id, time.monotonic() - job.started)

    def _write(self, plan_id: str, token: str, **values) -> None:
        with contextlib.suppress(Lost):
            self.store.write_plan(plan_id, token, **values)

    def _record(self, plan_id: str, seconds: float) -> None:
        status = self.store.plan_status(plan_id) or "deleted"
        self.metrics.jobs.labels(status=status).inc()
        self.metrics.job_seconds.observe(seconds)


def _kill(proc: multiprocessing.process.BaseProcess) -> None:
    proc.kill()
    proc.join(timeout=5)


class ExecutionRunner:
    """Local executions: one thread each (torchrun does the work in its own processes)."""

    def __init__(self, store: Store, settings: Settings, owner: str):
        self.store, self.settings, self.owner = store, settings, owner
        self._cancel: dict[str, threading.Event] = {}
        self._submitted: dict[str, float] = {}  # monotonic
        self._lock = threading.Lock()

    def lease(self) -> dict:
        """Columns that make a new execution row this replica's, with a fresh lease."""
        return {
            "owner": self.owner,
            "lease_token": uuid.uuid4().hex,
            "lease_expires_at": time.time() + self.settings.lease_s,
        }

    def submit(self, execution_id: str, token: str, plan_json: str, steps: int) -> None:
        with self._lock:
            if len(self._cancel) >= self.settings.max_executions:
                raise QueueFull
            event = threading.Event()
            self._cancel[execution_id] = event
            self._submitted[execution_id] = time.monotonic()
        thread = threading.Thread(
            target=self._run,
            args=(execution_id, token, plan_json, steps, event),
            name=f"execution-{execution_id}",
            daemon=True,
        )
        thread.start()

    def cancel(self, execution_id: str) -> bool:
        with self._lock:
            event = self._cancel.get(execution_id)
        if event is None:
            return False
        event.set()
        return True

    def keep(self, execution_ids: set[str], read_at: float) -> None:
        """Cancel local executions that were cancelled elsewhere or are no longer ours
        (`execution_ids`, read from the store at monotonic `read_at`: later ones are kept)."""
        with self._lock:
            gone = [
                e
                for i, e in self._cancel.items()
                if i not in execution_ids and self._submitted[i] < read_at
            ]
        for event in gone:
            event.set()

    def busy(self) -> int:
        with self._lock:
            return len(self._cancel)

    def stop(self) -> None:
        with self._lock:
            events = list(self._cancel.values())
        for event in events:
            event.set()

    def _run(self, execution_id: str, token: str, plan_json: str, steps: int, cancel):
        from executor.launch import execute

        out = self.settings.data_dir / "executions" / execution_id
        out.mkdir(parents=True, exist_ok=True)
        plan_path = Path(out / "plan.json")
        plan_path.write_text(plan_json)
        self.store.write_execution(execution_id, token, status="running", started_at=time.time())
        try:
            result = execute(plan_path, out, steps=steps, cancel=cancel)
            self.store.write_execution(
                execution_id,
                token,
                status=result.status,
                result_json=json.dumps(result.summary()),
                error=result.headline(),
                finished_at=time.time(),
            )
        except Exception as err:
            self.store.write_execution(
                execution_id,
                token,
                status="failed",
                error=f"{type(err).__name__}: {err}"[:2000],
                finished_at=time.time(),
            )
        finally:
            with self._lock:
                self._cancel.pop(execution_id, None)
                self._submitted.pop(execution_id, None)


class Supervisor:
    """The replica's supervisor: leases, expiry, reaping and claiming, every `tick_s`; the
    heartbeat process (api.service.heartbeat) renews the leases too, from outside this
    interpreter, and is restarted here if it died."""

    def __init__(self, store: Store, plans: PlanRunner, executions: ExecutionRunner):
        self.store, self.plans, self.executions = store, plans, executions
        self.tick_s = min(0.2, plans.settings.lease_s / 10)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_renew = 0.0
        self.heartbeat = Heartbeat(store.url, plans.owner, plans.settings.lease_s, os.getpid())

    def start(self) -> None:
        self.heartbeat.ensure()
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
        self.heartbeat.stop()
        self.plans.stop()
        self.executions.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.beat()
            except Exception as err:  # keep the replica alive; the store may be briefly locked
                print(f"supervisor: {type(err).__name__}: {err}", flush=True)

    def beat(self) -> None:
        now = time.monotonic()
        if now - self._last_renew >= self.plans.settings.lease_s / 3:
            tokens, executions = self.store.renew(self.plans.owner, self.plans.settings.lease_s)
            self.plans.keep(tokens)
            self.executions.keep(executions, now)
            self.store.expire()
            self.heartbeat.ensure()
            self._last_renew = now
            self.plans.metrics.jobs_queued.set(self.store.active_plans() - self.plans.running())
        self.plans.tick()
