"""Job runners: planning in separate processes, executions in threads that wait on torchrun.

Planning never runs on the event loop nor in the service process: each job gets a fresh
process (spawned, so no state is inherited from the server's threads), at most
`plan_workers` at a time, killed when it exceeds the per-job time limit or is cancelled.
A monitor thread starts queued jobs and reaps finished ones.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from collections import deque
from pathlib import Path

from api.service.metrics import Metrics
from api.service.planning import plan_job
from api.service.store import ExecutionRow, Store


class QueueFull(Exception):
    pass


class PlanRunner:
    def __init__(
        self, store: Store, workers: int, time_limit_s: float, max_queued: int, metrics: Metrics
    ):
        self.store, self.workers, self.time_limit_s = store, workers, time_limit_s
        self.max_queued, self.metrics = max_queued, metrics
        self._ctx = multiprocessing.get_context("spawn")
        self._queue: deque[str] = deque()
        self._running: dict[str, tuple[multiprocessing.process.BaseProcess, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._monitor, name="plan-runner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        with self._lock:
            for plan_id, (proc, _) in list(self._running.items()):
                proc.kill()
                proc.join(timeout=5)
                self._fail(plan_id, "the service stopped while this job was running")
            self._running.clear()

    # --- queue -------------------------------------------------------------------------------
    def submit(self, plan_id: str) -> None:
        with self._lock:
            if len(self._queue) + len(self._running) >= self.max_queued:
                raise QueueFull
            self._queue.append(plan_id)
            self.metrics.jobs_queued.set(len(self._queue))

    def requeue(self, plan_ids: list[str]) -> None:
        with self._lock:
            self._queue.extend(plan_ids)

    def cancel(self, plan_id: str) -> bool:
        """Stop a queued or running job; True if it was active."""
        with self._lock:
            if plan_id in self._queue:
                self._queue.remove(plan_id)
                return True
            entry = self._running.pop(plan_id, None)
        if entry is None:
            return False
        entry[0].kill()
        entry[0].join(timeout=5)
        return True

    def busy(self) -> int:
        with self._lock:
            return len(self._queue) + len(self._running)

    # --- monitor -----------------------------------------------------------------------------
    def _monitor(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self._tick()
            except Exception as err:  # keep the runner alive; the store may be briefly locked
                print(f"plan runner: {type(err).__name__}: {err}", flush=True)

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            finished = [(i, p, t) for i, (p, t) in self._running.items() if not p.is_alive()]
            late = [
                (i, p, t)
                for i, (p, t) in self._running.items()
                if p.is_alive() and now - t > self.time_limit_s
            ]
            for plan_id, _, _ in finished + late:
                del self._running[plan_id]
        for plan_id, proc, started in late:
            proc.kill()
            proc.join(timeout=5)
            self._fail(
                plan_id, f"planning exceeded the per-job time limit of {self.time_limit_s:g} s"
            )
            self._record(plan_id, now - started)
        for plan_id, proc, started in finished:
            proc.join(timeout=1)
            status = self.store.plan_status(plan_id)
            if status in ("queued", "running"):
                self._fail(plan_id, f"the planning process died (exit code {proc.exitcode})")
            self._record(plan_id, now - started)
        with self._lock:
            while self._queue and len(self._running) < self.workers:
                plan_id = self._queue.popleft()
                proc = self._ctx.Process(
                    target=plan_job, args=(self.store.url, plan_id), name=f"plan-{plan_id}"
                )
                proc.start()
                self._running[plan_id] = (proc, time.monotonic())
            self.metrics.jobs_queued.set(len(self._queue))
            self.metrics.jobs_running.set(len(self._running))

    def _fail(self, plan_id: str, reason: str) -> None:
        self.store.set_plan(plan_id, status="failed", error=reason, finished_at=time.time())

    def _record(self, plan_id: str, seconds: float) -> None:
        status = self.store.plan_status(plan_id) or "deleted"
        self.metrics.jobs.labels(status=status).inc()
        self.metrics.job_seconds.observe(seconds)


class ExecutionRunner:
    """Local executions: one thread each (torchrun does the work in its own processes)."""

    def __init__(self, store: Store, data_dir: Path, max_active: int):
        self.store, self.data_dir, self.max_active = store, data_dir, max_active
        self._cancel: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def submit(self, execution_id: str, plan_json: str, steps: int) -> None:
        with self._lock:
            if len(self._cancel) >= self.max_active:
                raise QueueFull
            event = threading.Event()
            self._cancel[execution_id] = event
        thread = threading.Thread(
            target=self._run,
            args=(execution_id, plan_json, steps, event),
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

    def busy(self) -> int:
        with self._lock:
            return len(self._cancel)

    def stop(self) -> None:
        with self._lock:
            events = list(self._cancel.values())
        for event in events:
            event.set()

    def _run(self, execution_id: str, plan_json: str, steps: int, cancel: threading.Event):
        from executor.launch import execute

        out = self.data_dir / "executions" / execution_id
        out.mkdir(parents=True, exist_ok=True)
        plan_path = out / "plan.json"
        plan_path.write_text(plan_json)
        self._set(execution_id, status="running", started_at=time.time())
        try:
            result = execute(plan_path, out, steps=steps, cancel=cancel)
            summary = result.summary()
            error = None
            if result.status != "succeeded":
                rank = result.failed_rank
                first = next(iter(result.errors.values()), "")
                error = f"rank {rank}: {first}" if rank is not None else first
            self._set(
                execution_id,
                status=result.status,
                result_json=json.dumps(summary),
                error=error,
                finished_at=time.time(),
            )
        except Exception as err:
            self._set(
                execution_id,
                status="failed",
                error=f"{type(err).__name__}: {err}"[:2000],
                finished_at=time.time(),
            )
        finally:
            with self._lock:
                self._cancel.pop(execution_id, None)

    def _set(self, execution_id: str, **values) -> None:
        from sqlalchemy import update

        with self.store.session() as s:
            s.execute(update(ExecutionRow).where(ExecutionRow.id == execution_id).values(**values))
