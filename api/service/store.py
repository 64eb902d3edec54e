"""Persistent store (SQLAlchemy): plans and their jobs, executions, custom cluster profiles.

SQLite by default (one file; WAL so planning processes can write progress while the service
reads), any SQLAlchemy URL through AUTOPAR_DATABASE_URL; PostgreSQL
(`postgresql+psycopg://...`) is the database for several replicas.

The store is the job queue. A replica claims the oldest queued plan with a compare-and-set
(`UPDATE ... WHERE status = 'queued'`, after `SELECT ... FOR UPDATE SKIP LOCKED` on
PostgreSQL so replicas do not queue up on one row), which gives the job a lease: an owner, a
token and an expiry that the owner's heartbeat renews. Every later write of the job's state
names the token, so a job whose lease was lost (it expired, the job was cancelled or deleted)
cannot overwrite what another replica or the user decided. A job whose lease expires (its
replica died) is re-queued, up to MAX_ATTEMPTS claims, then failed; an execution is failed
(training is not restarted behind the user's back).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from api.service.tables import (  # noqa: F401 (the rows are the store's vocabulary)
    Base,
    ClusterRow,
    ExecutionRow,
    PlanRow,
    QueueLockRow,
    add_missing_columns,
    make_engine,
)

ACTIVE = ("queued", "running")
MAX_ATTEMPTS = 3  # claims of one plan job before it is failed (a job that kills replicas)


class Lost(Exception):
    """A job's lease is gone (expired and taken over, cancelled, deleted): stop writing."""


class QueueFull(Exception):
    """The bound on active jobs is reached."""


class KeyReused(Exception):
    """An Idempotency-Key sent again with a different request."""


class Store:
    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        Base.metadata.create_all(self.engine)
        add_missing_columns(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        with contextlib.suppress(IntegrityError), self.session() as s:  # another replica's
            if s.get(QueueLockRow, 1) is None:
                s.add(QueueLockRow(id=1, writes=0))

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions() as s, s.begin():
            yield s

    @contextmanager
    def serialized(self) -> Iterator[Session]:
        """A transaction that first takes the queue lock row (a row lock on PostgreSQL, the
        database's write lock on SQLite): one at a time across every replica."""
        with self.session() as s:
            s.execute(update(QueueLockRow).where(QueueLockRow.id == 1).values(writes=0))
            yield s

    def enqueue(
        self, row: PlanRow, max_active: int, reusable: tuple[str, ...]
    ) -> tuple[PlanRow, bool]:
        """Store `row`, a queued job (or one answered already), unless an equal job exists:
        the job with its idempotency key (KeyReused if that job's request differs), else
        the newest job of its request hash in a `reusable` status. (the job, whether it is
        new); QueueFull when `max_active` jobs are queued or running."""
        with self.serialized() as s:
            if row.idempotency_key is not None:
                same = s.scalars(
                    select(PlanRow).where(
                        PlanRow.idempotency_key == row.idempotency_key,
                        PlanRow.kind == (row.kind or "plan"),
                    )
                ).first()
                if same is not None:
                    if same.request_hash != row.request_hash:
                        raise KeyReused(row.idempotency_key)
                    return same, False
            hit = _newest(s, row.request_hash, reusable)
            if hit is not None:
                return hit, False
            if row.status in ACTIVE:  # a job finished before it is stored takes no place
                active = s.scalar(
                    select(func.count()).select_from(PlanRow).where(PlanRow.status.in_(ACTIVE))
                )
                if active >= max_active:
                    raise QueueFull
            s.add(row)
        return row, True

    def find_plan(self, request_hash: str, statuses: tuple[str, ...]) -> PlanRow | None:
        """The newest job of `request_hash` in one of `statuses`, if any."""
        with self.session() as s:
            return _newest(s, request_hash, statuses)

    def add_execution(self, row: ExecutionRow) -> tuple[ExecutionRow, bool]:
        """Store `row` unless an execution with its idempotency key exists (KeyReused if
        that one's options differ): (the execution, whether it is new)."""
        with self.serialized() as s:
            if row.idempotency_key is not None:
                same = s.scalars(
                    select(ExecutionRow).where(ExecutionRow.idempotency_key == row.idempotency_key)
                ).first()
                if same is not None:
                    if (same.plan_id, same.options_json) != (row.plan_id, row.options_json):
                        raise KeyReused(row.idempotency_key)
                    return same, False
            s.add(row)
        return row, True

    def close(self) -> None:
        self.engine.dispose()

    # --- the plan queue ------------------------------------------------------------------
    def claim_plan(self, owner: str, lease_s: float) -> tuple[str, str] | None:
        """Take the oldest queued plan job: (plan id, lease token), or None."""
        now = time.time()
        with self.session() as s:
            query = select(PlanRow.id).where(PlanRow.status == "queued")
            query = query.order_by(PlanRow.created_at).limit(1)
            if self.engine.dialect.name == "postgresql":
                query = query.with_for_update(skip_locked=True)
            plan_id = s.scalar(query)
            if plan_id is None:
                return None
            token = uuid.uuid4().hex
            claimed = s.execute(
                update(PlanRow)
                .where(PlanRow.id == plan_id, PlanRow.status == "queued")
                .values(
                    status="running",
                    owner=owner,
                    lease_token=token,
                    lease_expires_at=now + lease_s,
                    attempts=PlanRow.attempts + 1,
                    started_at=now,
                    progress_step="starting",
                )
            ).rowcount
        return (plan_id, token) if claimed == 1 else None

    def write_plan(self, plan_id: str, token: str, **values: Any) -> None:
        """Write a running job's state, only while `token` still holds its lease."""
        with self.session() as s:
            done = s.execute(
                update(PlanRow)
                .where(
                    PlanRow.id == plan_id,
                    PlanRow.status == "running",
                    PlanRow.lease_token == token,
                )
                .values(**values)
            ).rowcount
        if done != 1:
            raise Lost(plan_id)

    def extend(self, owner: str, lease_s: float) -> None:
        """Extend the leases of every active job `owner` holds to `lease_s` from now (the
        replica's heartbeat process, api.service.heartbeat)."""
        until = time.time() + lease_s
        with self.session() as s:
            for row in (PlanRow, ExecutionRow):
                s.execute(
                    update(row)
                    .where(row.owner == owner, row.status.in_(ACTIVE))
                    .values(lease_expires_at=until)
                )

    def held(self, owner: str) -> tuple[set[str], set[str]]:
        """The lease tokens of the plan jobs `owner` runs and the ids of its executions that
        are active and not asked to cancel."""
        with self.session() as s:
            plans = s.scalars(
                select(PlanRow.lease_token).where(
                    PlanRow.owner == owner, PlanRow.status == "running"
                )
            ).all()
            executions = s.scalars(
                select(ExecutionRow.id).where(
                    ExecutionRow.owner == owner,
                    ExecutionRow.status.in_(ACTIVE),
                    ExecutionRow.cancel_requested.is_(False),
                )
            ).all()
        return {t for t in plans if t}, set(executions)

    def renew(self, owner: str, lease_s: float) -> tuple[set[str], set[str]]:
        """Extend this owner's leases; the plan tokens and execution ids it still holds."""
        self.extend(owner, lease_s)
        return self.held(owner)

    def expire(self) -> tuple[int, int]:
        """Jobs whose lease ran out (their replica died): plans back to the queue (failed after
        MAX_ATTEMPTS claims), executions failed. Returns (re-queued, failed)."""
        now = time.time()
        plans = or_(PlanRow.lease_expires_at.is_(None), PlanRow.lease_expires_at < now)
        executions = or_(
            ExecutionRow.lease_expires_at.is_(None), ExecutionRow.lease_expires_at < now
        )
        return self._give_up(plans, executions)

    def release(self, owner: str) -> tuple[int, int]:
        """Give up every job `owner` holds now, as expire does once their leases run out: its
        replica is gone (its heartbeat process saw it die). Whatever a process of that
        replica writes afterwards under its old lease is refused (Lost)."""
        return self._give_up(PlanRow.owner == owner, ExecutionRow.owner == owner)

    def _give_up(self, plans, executions) -> tuple[int, int]:
        now = time.time()
        free = {"owner": None, "lease_token": None, "lease_expires_at": None}
        with self.session() as s:
            requeued = s.execute(
                update(PlanRow)
                .where(PlanRow.status == "running", plans, PlanRow.attempts < MAX_ATTEMPTS)
                .values(status="queued", progress_step="re-queued: its replica stopped", **free)
            ).rowcount
            failed = s.execute(
                update(PlanRow)
                .where(PlanRow.status == "running", plans)
                .values(
                    status="failed",
                    error=f"the service stopped while running this job {MAX_ATTEMPTS} times; "
                    "submit it again",
                    finished_at=now,
                    **free,
                )
            ).rowcount
            failed += s.execute(
                update(ExecutionRow)
                .where(ExecutionRow.status.in_(ACTIVE), executions)
                .values(
                    status="failed",
                    error="the service replica running this execution stopped",
                    finished_at=now,
                    **free,
                )
            ).rowcount
        return requeued, failed

    def active_plans(self) -> int:
        with self.session() as s:
            return s.scalar(
                select(func.count()).select_from(PlanRow).where(PlanRow.status.in_(ACTIVE))
            )

    # --- plans --------------------------------------------------------------------------------
    def get_plan(self, plan_id: str) -> PlanRow | None:
        with self.session() as s:
            return s.get(PlanRow, plan_id)

    def plan_stamp(self, plan_id: str) -> tuple[str, str, float | None] | None:
        """(kind, status, finished_at) of a plan row, None when there is none: what a cached
        answer about it is checked against."""
        with self.session() as s:
            row = s.execute(
                select(PlanRow.kind, PlanRow.status, PlanRow.finished_at).where(
                    PlanRow.id == plan_id
                )
            ).first()
        return None if row is None else tuple(row)

    def plan_status(self, plan_id: str) -> str | None:
        with self.session() as s:
            return s.scalar(select(PlanRow.status).where(PlanRow.id == plan_id))

    # --- executions -----------------------------------------------------------------------
    def write_execution(self, execution_id: str, token: str, **values: Any) -> bool:
        """Write an execution's state while `token` holds its lease; False if it does not."""
        with self.session() as s:
            return (
                s.execute(
                    update(ExecutionRow)
                    .where(
                        ExecutionRow.id == execution_id,
                        ExecutionRow.status.in_(ACTIVE),
                        ExecutionRow.lease_token == token,
                    )
                    .values(**values)
                ).rowcount
                == 1
            )


def _newest(s: Session, request_hash: str, statuses: tuple[str, ...]) -> PlanRow | None:
    return s.scalars(
        select(PlanRow)
        .where(PlanRow.request_hash == request_hash, PlanRow.status.in_(statuses))
        .order_by(PlanRow.created_at.desc())
        .limit(1)
    ).first()


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
