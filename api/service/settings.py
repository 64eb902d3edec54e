"""Service settings, read from the environment (AUTOPAR_*), with the limits that protect it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from planner.errors import InputError


def _int(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InputError(name, f"{raw!r} is not an integer", "a positive integer") from None
    if value <= 0:
        raise InputError(name, f"{value} is not positive", "a positive integer")
    return value


@dataclass(frozen=True)
class Settings:
    database_url: str
    data_dir: Path
    tokens: frozenset[str] = field(default_factory=frozenset)
    max_body_bytes: int = 8 * 1024 * 1024
    max_graph_nodes: int = 200_000
    max_queued_jobs: int = 16  # queued + running plan jobs; more get 429
    plan_workers: int = 2  # planning processes at once
    job_time_limit_s: int = 900
    max_executions: int = 2  # local executions queued + running
    max_local_ranks: int = 8
    max_local_params: int = 200_000_000  # a bigger model is not trained on this host's CPUs
    retry_after_s: int = 10
    # A replica renews its jobs' leases every lease_s / 3; a job whose lease is not renewed
    # for lease_s (its replica died) goes back to the queue.
    lease_s: int = 30
    # Address space of one planning process (RLIMIT_AS): a request that would grow past it
    # fails with MemoryError inside that process, never the server. Tracing and searching a
    # 70B-parameter model on 1,024 GPUs peaks well under 2 GiB (bench/results/).
    worker_memory_bytes: int = 4 * 2**30

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        data_dir = Path(env.get("AUTOPAR_DATA_DIR") or Path.cwd() / "autopar-data")
        url = env.get("AUTOPAR_DATABASE_URL") or f"sqlite:///{data_dir / 'autopar.db'}"
        tokens = frozenset(t.strip() for t in env.get("AUTOPAR_API_TOKENS", "").split(",") if t)
        return cls(
            database_url=url,
            data_dir=data_dir,
            tokens=frozenset(t for t in tokens if t),
            max_body_bytes=_int(env, "AUTOPAR_MAX_BODY_BYTES", cls.max_body_bytes),
            max_graph_nodes=_int(env, "AUTOPAR_MAX_GRAPH_NODES", cls.max_graph_nodes),
            max_queued_jobs=_int(env, "AUTOPAR_MAX_QUEUED_JOBS", cls.max_queued_jobs),
            plan_workers=_int(env, "AUTOPAR_PLAN_WORKERS", cls.plan_workers),
            job_time_limit_s=_int(env, "AUTOPAR_JOB_TIME_LIMIT_S", cls.job_time_limit_s),
            max_executions=_int(env, "AUTOPAR_MAX_EXECUTIONS", cls.max_executions),
            max_local_ranks=_int(env, "AUTOPAR_MAX_LOCAL_RANKS", cls.max_local_ranks),
            max_local_params=_int(env, "AUTOPAR_MAX_LOCAL_PARAMS", cls.max_local_params),
            lease_s=_int(env, "AUTOPAR_LEASE_S", cls.lease_s),
            worker_memory_bytes=_int(env, "AUTOPAR_WORKER_MEMORY_BYTES", cls.worker_memory_bytes),
        )
