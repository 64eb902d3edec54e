"""Fixtures for the REST service: an app on a temporary SQLite store, and a live uvicorn server."""

from __future__ import annotations

import contextlib
import copy
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi.testclient import TestClient

from api.service.app import create_app
from api.service.settings import Settings

TINY_GPT = {"name": "gpt-350m", "config": {"layers": 4, "hidden": 128, "heads": 4, "vocab": 512}}


def plan_body(**overrides) -> dict:
    body = {
        "model": TINY_GPT,
        "cluster": {"name": "cpu-local"},
        "training": {"global_batch_size": 8, "seq_len": 64, "dtype": "fp32"},
        "search": {"executable_only": True, "baselines": False},
    }
    body.update(overrides)
    return copy.deepcopy(body)  # callers mutate it; TINY_GPT stays as it is


def make_settings(tmp_path, **values) -> Settings:
    """Settings on a temporary store; TestClient's Host ("testserver") is trusted beside
    the loopback names."""
    base = Settings.from_env(
        {
            "AUTOPAR_DATA_DIR": str(tmp_path / "data"),
            # its own planner cache: a request is a job unless this test planned it before
            "AUTOPAR_CACHE_DIR": str(tmp_path / "cache"),
            "AUTOPAR_ALLOWED_HOSTS": "testserver,localhost,127.0.0.1,[::1]",
        }
    )
    return base.model_copy(update=values)


def wait_for(client: TestClient, path: str, done: tuple[str, ...], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(path).json()
        if body["status"] in done:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} still {body['status']} after {timeout} s: {body}")
        time.sleep(0.2)


@pytest.fixture
def settings(tmp_path) -> Settings:
    return make_settings(tmp_path)


@pytest.fixture
def client(settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture
def idle_client(settings) -> Iterator[TestClient]:
    """Jobs are accepted and stay queued (no planning process is started)."""
    with TestClient(create_app(settings, start_workers=False)) as c:
        yield c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(settings: Settings, start_workers: bool) -> Iterator[str]:
    """A real uvicorn server in a thread; yields its base URL."""
    port = free_port()
    config = uvicorn.Config(
        create_app(settings, start_workers=start_workers),
        host="127.0.0.1",
        port=port,
        log_level="warning",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def live_server(tmp_path) -> Iterator[str]:
    """A live server whose queued jobs are not planned (nothing heavy runs behind it)."""
    with serve(make_settings(tmp_path, max_queued_jobs=4), start_workers=False) as url:
        yield url


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """One throw-away PostgreSQL server for the session (tests/service/postgres.py)."""
    from tests.service.postgres import postgres_server

    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path) -> Iterator[str]:
    """An empty store database on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
        return
    from sqlalchemy import create_engine

    from api.service.store import Base

    url = request.getfixturevalue("postgres_url")
    engine = create_engine(url)
    Base.metadata.drop_all(engine)
    engine.dispose()
    yield url
