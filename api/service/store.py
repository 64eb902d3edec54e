"""Persistent store (SQLAlchemy): plans and their jobs, executions, custom cluster profiles.

SQLite by default (one file; WAL so planning processes can write progress while the service
reads), any SQLAlchemy URL through AUTOPAR_DATABASE_URL (e.g. postgresql+psycopg://...).
Planning runs in other processes, which open their own engine on the same URL.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Float, Integer, String, Text, create_engine, event, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

ACTIVE = ("queued", "running")


class Base(DeclarativeBase):
    pass


class PlanRow(Base):
    __tablename__ = "plans"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
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


class Store:
    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        Base.metadata.create_all(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions() as s, s.begin():
            yield s

    def close(self) -> None:
        self.engine.dispose()

    # --- start-up recovery ------------------------------------------------------------------
    def recover(self) -> tuple[list[str], int]:
        """Jobs left behind by a stopped service: queued plans are re-queued (returned, oldest
        first), running plans and running or queued executions are marked failed (a planning
        or training process does not survive the service)."""
        now = time.time()
        stopped = "the service stopped while this job was running; submit it again"
        with self.session() as s:
            failed = s.execute(
                update(PlanRow)
                .where(PlanRow.status == "running")
                .values(status="failed", error=stopped, finished_at=now)
            ).rowcount
            failed += s.execute(
                update(ExecutionRow)
                .where(ExecutionRow.status.in_(ACTIVE))
                .values(status="failed", error=stopped, finished_at=now)
            ).rowcount
            queued = s.scalars(
                select(PlanRow.id).where(PlanRow.status == "queued").order_by(PlanRow.created_at)
            ).all()
        return list(queued), failed

    # --- plans --------------------------------------------------------------------------------
    def set_plan(self, plan_id: str, **values: Any) -> None:
        with self.session() as s:
            s.execute(update(PlanRow).where(PlanRow.id == plan_id).values(**values))

    def get_plan(self, plan_id: str) -> PlanRow | None:
        with self.session() as s:
            return s.get(PlanRow, plan_id)

    def plan_status(self, plan_id: str) -> str | None:
        with self.session() as s:
            return s.scalar(select(PlanRow.status).where(PlanRow.id == plan_id))


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
