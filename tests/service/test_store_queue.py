"""The store as the job queue, on SQLite and on a real PostgreSQL: claims are exclusive,
leases are renewed and expire, a job's writes need its lease (compare-and-set)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from sqlalchemy import create_engine, text

from api.service.store import MAX_ATTEMPTS, ExecutionRow, Lost, PlanRow, Store


def _queue(store: Store, n: int) -> list[str]:
    ids = [f"job-{i:03d}" for i in range(n)]
    with store.session() as s:
        for i, plan_id in enumerate(ids):
            s.add(
                PlanRow(
                    id=plan_id,
                    request_hash=plan_id,
                    status="queued",
                    model_name="m",
                    cluster_name="c",
                    request_json="{}",
                    created_at=1000.0 + i,
                    progress_done=0,
                    progress_total=0,
                )
            )
    return ids


def test_concurrent_claims_take_each_job_exactly_once(store_url):
    store = Store(store_url)
    ids = _queue(store, 40)
    claimed: dict[str, list[str]] = {}
    lock = threading.Lock()

    def replica(name: str) -> None:
        mine = Store(store_url)  # its own engine, as another process would have
        while True:
            for _ in range(50):  # SQLite may answer "locked" under contention: try again
                try:
                    got = mine.claim_plan(name, lease_s=30)
                    break
                except Exception:
                    time.sleep(0.01)
            if got is None:
                break
            with lock:
                claimed.setdefault(got[0], []).append(name)
        mine.close()

    threads = [threading.Thread(target=replica, args=(f"r{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(claimed) == ids
    assert all(len(owners) == 1 for owners in claimed.values()), claimed
    rows = {r.id: r for r in _rows(store)}
    assert all(rows[i].status == "running" and rows[i].attempts == 1 for i in ids)
    assert {rows[i].owner for i in ids} == {o for owners in claimed.values() for o in owners}
    store.close()


def _rows(store: Store) -> list[PlanRow]:
    from sqlalchemy import select

    with store.session() as s:
        return list(s.scalars(select(PlanRow).order_by(PlanRow.id)))


def test_writes_need_the_lease_and_expired_jobs_are_requeued_then_failed(store_url):
    store = Store(store_url)
    (plan_id,) = _queue(store, 1)
    first = store.claim_plan("a", lease_s=30)
    assert first is not None and first[0] == plan_id
    store.write_plan(plan_id, first[1], progress_step="tracing")
    with pytest.raises(Lost):
        store.write_plan(plan_id, "not-the-token", status="done")
    assert store.expire() == (0, 0)  # the lease still holds
    # Replica "a" stops renewing: once the lease runs out the job is queued again ...
    with store.session() as s:
        s.get(PlanRow, plan_id).lease_expires_at = time.time() - 1
    assert store.expire() == (1, 0)
    assert store.get_plan(plan_id).status == "queued"
    second = store.claim_plan("b", lease_s=30)
    assert second is not None and second[1] != first[1]
    # ... and the first holder's late outcome is refused: it cannot overwrite b's job.
    with pytest.raises(Lost):
        store.write_plan(plan_id, first[1], status="failed", error="late")
    store.write_plan(plan_id, second[1], status="done", plan_json="{}")
    assert store.get_plan(plan_id).status == "done"
    with pytest.raises(Lost):  # finished: no more writes, even with the right token
        store.write_plan(plan_id, second[1], status="failed")
    store.close()


def test_a_job_that_keeps_losing_its_replica_is_failed(store_url):
    store = Store(store_url)
    (plan_id,) = _queue(store, 1)
    for attempt in range(1, MAX_ATTEMPTS + 1):
        assert store.claim_plan(f"r{attempt}", lease_s=30) is not None
        with store.session() as s:
            s.get(PlanRow, plan_id).lease_expires_at = time.time() - 1
        store.expire()
    row = store.get_plan(plan_id)
    assert row.status == "failed" and row.attempts == MAX_ATTEMPTS
    assert "stopped while running this job" in row.error
    store.close()


def test_renew_extends_only_the_owners_leases(store_url):
    store = Store(store_url)
    _queue(store, 2)
    a = store.claim_plan("a", lease_s=5)
    b = store.claim_plan("b", lease_s=5)
    before = {r.id: r.lease_expires_at for r in _rows(store)}
    time.sleep(0.05)
    tokens, _ = store.renew("a", lease_s=60)
    after = {r.id: r.lease_expires_at for r in _rows(store)}
    assert tokens == {a[1]}
    assert after[a[0]] > before[a[0]] + 50 and after[b[0]] == before[b[0]]
    store.close()


def test_an_execution_whose_replica_died_is_failed_and_a_cancel_is_seen(store_url):
    store = Store(store_url)
    with store.session() as s:
        for eid, expires in (("dead", time.time() - 1), ("alive", time.time() + 60)):
            s.add(
                ExecutionRow(
                    id=eid,
                    plan_id="p",
                    target="local",
                    status="running",
                    options_json="{}",
                    created_at=1.0,
                    owner="x" if eid == "dead" else "y",
                    lease_token=eid,
                    lease_expires_at=expires,
                    cancel_requested=False,
                )
            )
    assert store.expire() == (0, 1)
    with store.session() as s:
        assert s.get(ExecutionRow, "dead").status == "failed"
        assert s.get(ExecutionRow, "alive").status == "running"
        s.get(ExecutionRow, "alive").cancel_requested = True
    _, executions = store.renew("y", lease_s=60)
    assert executions == set()  # the owner is told to stop it
    assert store.write_execution("alive", "alive", status="cancelled")
    assert not store.write_execution("dead", "dead", status="succeeded")  # already closed
    store.close()


def test_a_store_from_before_leases_is_upgraded_in_place(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_engine(url)
    with engine.begin() as conn:  # the first release's tables, without the lease columns
        conn.execute(
            text(
                "CREATE TABLE plans (id VARCHAR(32) PRIMARY KEY, request_hash VARCHAR(64), "
                "status VARCHAR(16), model_name VARCHAR(200), cluster_name VARCHAR(200), "
                "request_json TEXT, plan_json TEXT, baselines_json TEXT, explanation_json TEXT,"
                " error TEXT, progress_step VARCHAR(200), progress_done INTEGER, "
                "progress_total INTEGER, created_at FLOAT, started_at FLOAT, finished_at FLOAT)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO plans VALUES ('old', 'h', 'running', 'm', 'c', :r, NULL, NULL, "
                "NULL, NULL, NULL, 0, 0, 1.0, 1.0, NULL)"
            ),
            {"r": json.dumps({})},
        )
    engine.dispose()
    store = Store(url)
    assert store.expire() == (1, 0)  # a running job of the old release has no lease
    assert store.get_plan("old").status == "queued"
    store.close()


def test_a_dead_replicas_jobs_are_released_at_once_and_its_writes_refused(store_url):
    """The heartbeat process releases the jobs of the replica it watched the moment that
    replica dies (api.service.heartbeat): an orphaned planning process of it that finishes
    afterwards is refused, whatever its lease's expiry said."""
    store = Store(store_url)
    _queue(store, 2)
    plan_id, token = store.claim_plan("dead", lease_s=600)
    other = store.claim_plan("alive", lease_s=600)
    assert store.release("dead") == (1, 0)
    with pytest.raises(Lost):
        store.write_plan(plan_id, token, status="done", plan_json="{}")
    with store.session() as s:
        row = s.get(PlanRow, plan_id)
        assert (row.status, row.owner, row.lease_token) == ("queued", None, None)
        assert s.get(PlanRow, other[0]).status == "running"  # another replica's job stays
    store.close()


def test_enqueue_holds_the_bound_and_reuses_equal_jobs_under_concurrency(store_url):
    from api.service.store import KeyReused, QueueFull

    store = Store(store_url)

    def row(i: int, digest: str, key: str | None = None) -> PlanRow:
        return PlanRow(
            id=f"q-{i:03d}",
            request_hash=digest,
            status="queued",
            model_name="m",
            cluster_name="c",
            request_json="{}",
            created_at=time.time(),
            idempotency_key=key,
        )

    outcomes: list[str] = []

    def submit(i: int) -> None:
        try:
            _job, new = store.enqueue(row(i, f"req-{i % 20}"), 8, ("queued", "running"))
            outcomes.append("new" if new else "reused")
        except QueueFull:
            outcomes.append("full")

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.active_plans() == 8 and outcomes.count("new") == 8
    # A key names one job: the same request again is that job, another request is refused.
    _job, new = store.enqueue(row(100, "req-0"), 100, ())
    keyed, new = store.enqueue(row(101, "req-x", key="k1"), 100, ())
    again, new_again = store.enqueue(row(102, "req-x", key="k1"), 100, ())
    assert new and not new_again and again.id == keyed.id
    with pytest.raises(KeyReused):
        store.enqueue(row(103, "req-y", key="k1"), 100, ())
    store.close()
