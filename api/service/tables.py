"""The store's tables (SQLAlchemy): plans and their jobs, executions, custom cluster profiles,
and the lock row that serializes enqueueing; the engine, with the columns added since the
first release created in stores that predate them."""

from __future__ import annotations

from sqlalchemy import Boolean, Float, Integer, String, Text, create_engine, event, inspect, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


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
    # The client's Idempotency-Key header (a retry with it gets this job back).
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True, index=True)


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
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True, index=True)


class QueueLockRow(Base):
    """One row whose update serializes enqueueing across threads and replicas: the count of
    active jobs and the look-up of an equal job are read after it, in the same transaction
    as the insert (checked apart, 50 concurrent POSTs once queued 31 jobs under a bound of
    16, and ten identical ones made ten jobs)."""

    __tablename__ = "queue_lock"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    writes: Mapped[int] = mapped_column(Integer, default=0)


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
    ("plans", "idempotency_key", "VARCHAR(200)", None),
    ("executions", "idempotency_key", "VARCHAR(200)", None),
]


def add_missing_columns(engine: Engine) -> None:
    have = {t: {c["name"] for c in inspect(engine).get_columns(t)} for t in ("plans", "executions")}
    with engine.begin() as conn:
        for table, column, sql, default in _ADDED_COLUMNS:
            if column not in have[table]:
                tail = f" DEFAULT {default}" if default else ""
                conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {sql}{tail}"))
