"""Real `autopar serve` processes killed with SIGKILL: nothing they started outlives them, and
their jobs are re-queued (plans) or failed (executions) once the lease expires; two replicas
on one PostgreSQL run every job exactly once while one of them is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from sqlalchemy import select

from api.service.store import ExecutionRow, PlanRow, Store
from tests.service.conftest import free_port, plan_body

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
LEASE_S = 3


@contextlib.contextmanager
def replica(
    data_dir: Path, database_url: str, workers: int = 1, cwd: Path | None = None
) -> Iterator[tuple[int, str]]:
    """`autopar serve` in its own process (run from `cwd`): (pid, base URL)."""
    port = free_port()
    env = {
        **os.environ,
        "AUTOPAR_DATA_DIR": str(data_dir),
        "AUTOPAR_DATABASE_URL": database_url,
        "AUTOPAR_LEASE_S": str(LEASE_S),
        "AUTOPAR_PLAN_WORKERS": str(workers),
        # the replica's own planner cache (as on its own machine): a request is a job unless
        # this replica planned it
        "AUTOPAR_CACHE_DIR": str(data_dir / "planner-cache"),
    }
    env.pop("AUTOPAR_API_TOKENS", None)
    cli = Path(sys.executable).with_name("autopar")
    log = open(data_dir / f"serve-{port}.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [str(cli), "serve", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=cwd,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                break
        assert proc.poll() is None, (data_dir / f"serve-{port}.log").read_text()
        assert time.monotonic() < deadline, "the service did not start"
        time.sleep(0.2)
    try:
        yield proc.pid, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        log.close()


@contextlib.contextmanager
def two_replicas(postgres_url: str, tmp_path: Path) -> Iterator[tuple[tuple[int, str], ...]]:
    """Two `autopar serve` replicas on an emptied PostgreSQL store: ((pid, URL), (pid, URL))."""
    from sqlalchemy import create_engine

    from api.service.store import Base

    engine = create_engine(postgres_url)
    Base.metadata.drop_all(engine)
    engine.dispose()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with (
        replica(tmp_path / "a", postgres_url) as a,
        replica(tmp_path / "b", postgres_url) as b,
    ):
        yield a, b


def _body(batch: int) -> dict:
    return plan_body(
        training={"global_batch_size": batch, "seq_len": 64, "dtype": "fp32"},
        search={"executable_only": True, "baselines": False},
    )


def _slow_body(batch: int) -> dict:
    """A plan that takes seconds, so a replica can be killed while it runs one (a planning
    process forks from the fork server in milliseconds: a tiny plan can be done first)."""
    return _body(batch) | {
        "model": {"name": "gpt-1.3b"},
        "cluster": {"name": "dgx-a100-80g", "nodes": 2},
    }


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _rows(url: str) -> dict[str, PlanRow]:
    store = Store(url)
    try:
        with store.session() as s:
            return {r.id: r for r in s.scalars(select(PlanRow))}
    finally:
        store.close()


def _kill_and_check_tree(pid: int) -> list[int]:
    """SIGKILL `pid`; every process it had started must be gone within 10 s. Processes
    suspended by _freeze_while_running are resumed after the kill a generation at a time,
    each once its parents have had up to 2 s to go, so each notices its parent's death as it
    would have (a planning process resumed before its fork server had exited could finish
    the job it was frozen in)."""
    tree = psutil.Process(pid).children(recursive=True)
    depths = {p.pid: _depth(p) for p in tree}
    os.kill(pid, signal.SIGKILL)
    psutil.Process(pid).wait(timeout=10)  # reaped, as its own supervisor would
    for depth in sorted(set(depths.values())):
        generation = [p for p in tree if depths[p.pid] == depth]
        for proc in generation:
            with contextlib.suppress(psutil.Error):
                proc.resume()
        settle = time.monotonic() + 2
        while any(_running(p) for p in generation) and time.monotonic() < settle:
            time.sleep(0.05)
    deadline = time.monotonic() + 10
    while alive := [p for p in tree if _running(p)]:
        assert time.monotonic() < deadline, [(p.pid, p.cmdline()[:4]) for p in alive]
        time.sleep(0.2)
    return [p.pid for p in tree]


def _depth(proc: psutil.Process) -> int:
    try:
        return len(proc.parents())
    except psutil.Error:
        return 0


def _freeze_while_running(
    pid: int, url: str, timeout: float = 120, spare_executions: bool = False
) -> str:
    """Suspend replica `pid` and every process it started at a moment when it runs a job;
    the job's id. `spare_executions`: leave a running execution's torchrun and ranks be."""
    deadline = time.monotonic() + timeout
    while True:
        procs = _suspend_tree(pid, spare_executions)
        mine = [
            r.id
            for r in _rows(url).values()
            if r.status == "running" and f"-{pid}-" in (r.owner or "")
        ]
        if mine:
            # A write the frozen process had already sent may still land: the job counts
            # only if it is still running a moment later.
            time.sleep(0.5)
            if _rows(url)[mine[0]].status == "running":
                return mine[0]
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.resume()
        assert time.monotonic() < deadline, "replica A never ran a job"
        time.sleep(0.05)


def _suspend_tree(pid: int, spare_executions: bool) -> list[psutil.Process]:
    """Suspend `pid` and its descendants, again until no new one appears (a process forked
    while the tree was being suspended would run on and could finish a job)."""
    done: dict[int, psutil.Process] = {}
    while True:
        found: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            found = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        new = [p for p in found if p.pid not in done]
        if spare_executions:
            new = [p for p in new if not _is_execution(p)]
        if not new:
            return list(done.values())
        for proc in new:
            with contextlib.suppress(psutil.Error):
                proc.suspend()
            done[proc.pid] = proc


def _is_execution(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        line = " ".join(proc.cmdline())
        return "torch.distributed.run" in line or "executor.worker" in line
    return False


def _ranks(pid: int) -> int:
    """How many ranks the replica's torchrun has started (0 before torchrun is up)."""
    for proc in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "torch.distributed.run" in proc.cmdline():
                return len(proc.children())
    return 0


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (a zombie has exited; only its exit status is left)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_two_replicas_on_postgresql_run_each_job_once_while_one_is_killed(postgres_url, tmp_path):
    with two_replicas(postgres_url, tmp_path) as ((pid_a, url_a), (_pid_b, url_b)):
        ids = []
        for i, batch in enumerate((8, 16, 24, 32)):
            r = httpx.post(f"{url_a if i % 2 else url_b}/v1/plans", json=_slow_body(batch))
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
        # Kill A while it runs a job: A and its processes are frozen until one of its jobs
        # is seen running (a frozen replica can neither finish it nor claim another).
        a_job = _freeze_while_running(pid_a, postgres_url)
        killed = _kill_and_check_tree(pid_a)
        assert killed, "replica A had no planning process to kill"

        def all_finished() -> dict[str, PlanRow] | None:
            rows = _rows(postgres_url)
            return rows if all(r.status in ("done", "failed") for r in rows.values()) else None

        rows = _wait(all_finished, 300, "every job to finish on replica B")
        assert sorted(rows) == sorted(ids)  # nothing lost
        for plan_id, row in rows.items():
            assert row.status == "done", (plan_id, row.status, row.error)
            assert row.plan_json and row.lease_token is not None
            # Run exactly once: one claim each, except the job A died running, claimed again
            # by B: A's heartbeat released it when A died, so nothing A's processes still
            # wrote under the old lease counted.
            if plan_id != a_job:
                assert row.attempts == 1, (plan_id, row.attempts)
            else:
                assert row.attempts == 2 and f"-{pid_a}-" not in row.owner, (
                    row.attempts,
                    row.owner,
                )
        # B serves them all, and a finished plan reads the same from either database reader.
        got = httpx.get(f"{url_b}/v1/plans/{a_job}").json()
        assert got["status"] == "done" and got["plan"]["executable"]


def test_kill_9_leaves_no_process_and_jobs_resume_after_restart(tmp_path):
    url = f"sqlite:///{tmp_path / 'autopar.db'}"
    with replica(tmp_path, url, workers=2) as (pid, base):
        first = httpx.post(f"{base}/v1/plans", json=_body(8)).json()["id"]
        done = _wait(
            lambda: (
                (j := httpx.get(f"{base}/v1/plans/{first}").json())["status"] != "queued"
                and j["status"] != "running"
                and j
            ),
            180,
            "the first plan",
        )
        assert done["status"] == "done", done
        run = httpx.post(f"{base}/v1/executions", json={"plan_id": first, "steps": 1000})
        assert run.status_code == 202, run.text
        execution = run.json()["id"]
        # Once torchrun's ranks are up, a plan that takes seconds; kill -9 while it runs.
        _wait(lambda: _ranks(pid) >= 4, 180, "torchrun's 4 ranks")
        second = httpx.post(f"{base}/v1/plans", json=_slow_body(64)).json()["id"]
        # Frozen at a moment it plans the second job, then killed: polling for "running" and
        # then killing raced with a plan that finished in between (it then ran only once).
        assert _freeze_while_running(pid, url, 60, spare_executions=True) == second
        _kill_and_check_tree(pid)
    time.sleep(LEASE_S + 1)  # the dead replica's leases run out
    with replica(tmp_path, url) as (_pid, base):
        again = _wait(
            lambda: (j := httpx.get(f"{base}/v1/plans/{second}").json())["status"] == "done" and j,
            180,
            "the interrupted plan to run again",
        )
        assert again["plan"] is not None
        failed = httpx.get(f"{base}/v1/executions/{execution}").json()
        assert failed["status"] == "failed" and "replica" in failed["error"]
    rows = _rows(url)
    assert rows[second].attempts == 2 and rows[first].attempts == 1
    store = Store(url)
    with store.session() as s:
        assert s.get(ExecutionRow, execution).status == "failed"
    store.close()
