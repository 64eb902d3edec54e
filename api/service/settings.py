"""Service settings, read from the environment (AUTOPAR_*) with pydantic-settings, with the
limits that protect the service. A bad value fails at start-up naming the variable."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import (
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from planner.errors import InputError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AUTOPAR_", frozen=True, extra="ignore")

    data_dir: Path = Field(default_factory=lambda: Path.cwd() / "autopar-data")
    database_url: str = ""  # default: SQLite in data_dir
    # Comma-separated bearer tokens; when set, every POST/DELETE needs one.
    api_tokens: Annotated[frozenset[str], NoDecode] = frozenset()
    max_body_bytes: PositiveInt = 8 * 1024 * 1024
    # Request bodies being read, as a reverse proxy bounds them: all of them together hold at
    # most body_memory_bytes (past it: 503 with Retry-After), and a body not received within
    # body_read_timeout_s is answered 408 (a client that stalls mid-upload holds nothing).
    body_memory_bytes: PositiveInt = 32 * 1024 * 1024
    body_read_timeout_s: PositiveFloat = 30.0
    # Host header names the service answers to (comma-separated; "*" for any). Default: the
    # loopback names, plus `autopar serve --host` when it names one host; with API tokens
    # set, any. A browser page on another site that rebinds its own name to 127.0.0.1 sends
    # that name as Host, so the token-less loopback default refuses it.
    allowed_hosts: Annotated[frozenset[str], NoDecode] = frozenset()
    max_graph_nodes: PositiveInt = 200_000
    max_queued_jobs: PositiveInt = 16  # queued + running plan jobs; more get 429
    plan_workers: PositiveInt = 2  # planning processes at once
    job_time_limit_s: PositiveInt = 900
    max_executions: PositiveInt = 2  # local executions queued + running
    max_local_ranks: PositiveInt = 8
    max_local_params: PositiveInt = 200_000_000  # bigger is not trained on this host's CPUs
    retry_after_s: PositiveInt = 10
    # Threads that run the synchronous handlers (AnyIO's pool: 40 by default). Handlers are
    # mostly CPU-bound under the GIL; each runnable thread adds a GIL turn to every other
    # request's wait, so a small pool keeps latency down on a few cores.
    request_threads: PositiveInt = 8
    # A replica renews its jobs' leases every lease_s / 3; a job whose lease is not renewed
    # for lease_s (its replica died) goes back to the queue.
    lease_s: PositiveInt = 30
    # Address space of one planning process (RLIMIT_AS): a request that would grow past it
    # fails with MemoryError inside that process, never the server. Tracing and searching a
    # 70B-parameter model on 1,024 GPUs peaks well under 2 GiB (bench/results/).
    worker_memory_bytes: PositiveInt = 4 * 2**30
    # The planner's disk cache (traces, layouts, cost tables, answers), the CLI's variable
    # AUTOPAR_CACHE_DIR; "off" for none. Unset: the user's cache directory, as for the CLI.
    # The replica's jobs fill it; a request whose search it already answers is priced in
    # the replica's own process without a job (api.service.submit).
    cache_dir: str | None = None

    @field_validator("api_tokens", "allowed_hosts", mode="before")
    @classmethod
    def _split_tokens(cls, value: object) -> object:
        if isinstance(value, str):
            return frozenset(t.strip() for t in value.split(",") if t.strip())
        return value

    @model_validator(mode="after")
    def _default_database(self) -> Settings:
        if not self.database_url:
            url = f"sqlite:///{self.data_dir / 'autopar.db'}"
            object.__setattr__(self, "database_url", url)
        return self

    @property
    def tokens(self) -> frozenset[str]:
        return self.api_tokens

    @property
    def trusted_hosts(self) -> list[str]:
        """Host names TrustedHostMiddleware lets through (see allowed_hosts)."""
        if self.allowed_hosts:
            return sorted(self.allowed_hosts)
        return ["*"] if self.tokens else list(LOOPBACK_HOSTS)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        """Settings from `env` (default: the process environment); errors name the variable."""
        env = dict(os.environ if env is None else env)
        values = {
            name.removeprefix("AUTOPAR_").lower(): value
            for name, value in env.items()
            if name.startswith("AUTOPAR_") and value != ""
        }
        known = {k: v for k, v in values.items() if k in cls.model_fields}
        try:
            # Only the given mapping: the process environment is not read a second time.
            return cls.model_validate(known)
        except ValidationError as err:
            item = err.errors()[0]
            name = "AUTOPAR_" + str(item["loc"][0]).upper() if item["loc"] else "AUTOPAR_*"
            raise InputError(name, f"{item['input']!r}: {item['msg']}") from None
