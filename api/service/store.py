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

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    Boolean,
    Float,
    Integer,
    String,
    Text,
    create_engine,
    event,
    func,
    inspect,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

ACTIVE = ("queued", "running")
MAX_ATTEMPTS = 3  # claims of one plan job before it is failed (a job that kills replicas)


class Base(DeclarativeBase):
    pass


class PlanRow(Base):
    __tablename__ = "plans"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    # "plan" (POST /v1/plans) or "sizing" (POST /v1/sizings: plan_json holds the Sizing)
    kind: Mapped[str] = mapped_column(String(16), default="plan", server_default="plan")
    request_hash: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    model_name: Mapped[str] = mapped_column(String(200), index=True)
    cluster_name: Mapped[str] = mapped_column(String(200), index=True)
    request_json: Mapped[str] = mapped_column(Text)
    plan_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    baselines_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    explanation_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    progress_step: Mapped[str | None] = mapped_column(String(200), nullable=True)
    progress_done: Mapped[int] = mapped_column(Integer, default=0)
    progress_total: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    lease_token: Mapped[str | None] = mapped_column(String(32), nullable=True)
    lease_expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)


class ExecutionRow(Base):
    __tablename__ = "executions"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    plan_id: Mapped[str] = mapped_column(String(32), index=True)
    target: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), index=True)
    options_json: Mapped[str] = mapped_column(Text)
    result_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    lease_token: Mapped[str | None] = mapped_column(String(32), nullable=True)
    lease_expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)


class ClusterRow(Base):
    __tablename__ = "clusters"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    profile_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(conn, _record) -> None:
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


# Columns added after the first release: (table, column, SQL type, default) for stores that
# were created before them (create_all adds tables, not columns).
_ADDED_COLUMNS = [
    (table, column, sql, default)
    for table in ("plans", "executions")
    for column, sql, default in (
        ("owner", "VARCHAR(64)", None),
        ("lease_token", "VARCHAR(32)", None),
        ("lease_expires_at", "FLOAT", None),
    )
] + [
    ("plans", "attempts", "INTEGER", "0"),
    ("executions", "cancel_requested", "BOOLEAN", "FALSE"),
    ("plans", "kind", "VARCHAR(16)", "'plan'"),
]


def _add_missing_columns(engine: Engine) -> None:
    have = {t: {c["name"] for c in inspect(engine).get_columns(t)} for t in ("plans", "executions")}
    with engine.begin() as conn:
        for table, column, sql, default in _ADDED_COLUMNS:
            if column not in have[table]:
                tail = f" DEFAULT {default}" if default else ""
                conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {sql}{tail}"))


class Lost(Exception):
    """A job's lease is gone (expired and taken over, cancelled, deleted): stop writing."""


class Store:
    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        Base.metadata.create_all(self.engine)
        _add_missing_columns(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions() as s, s.begin():
            yield s

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

    def renew(self, owner: str, lease_s: float) -> tuple[set[str], set[str]]:
        """Extend this owner's leases; the plan ids and execution ids it still holds."""
        until = time.time() + lease_s
        with self.session() as s:
            for row in (PlanRow, ExecutionRow):
                s.execute(
                    update(row)
                    .where(row.owner == owner, row.status.in_(ACTIVE))
                    .values(lease_expires_at=until)
                )
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

    def expire(self) -> tuple[int, int]:
        """Jobs whose lease ran out (their replica died): plans back to the queue (failed after
        MAX_ATTEMPTS claims), executions failed. Returns (re-queued, failed)."""
        now = time.time()
        lapsed = or_(PlanRow.lease_expires_at.is_(None), PlanRow.lease_expires_at < now)
        free = {"owner": None, "lease_token": None, "lease_expires_at": None}
        with self.session() as s:
            requeued = s.execute(
                update(PlanRow)
                .where(PlanRow.status == "running", lapsed, PlanRow.attempts < MAX_ATTEMPTS)
                .values(status="queued", progress_step="re-queued: its replica stopped", **free)
            ).rowcount
            failed = s.execute(
                update(PlanRow)
                .where(PlanRow.status == "running", lapsed)
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
                .where(
                    ExecutionRow.status.in_(ACTIVE),
                    or_(
                        ExecutionRow.lease_expires_at.is_(None),
                        ExecutionRow.lease_expires_at < now,
                    ),
                )
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


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
