"""The FastAPI application: routes under /v1, offline docs, health and metrics, job runners."""

from __future__ import annotations

import os
import socket
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.middleware.trustedhost import TrustedHostMiddleware

from api.quiet import quiet_third_party_logs
from api.service import (
    routes_catalog,
    routes_executions,
    routes_plans,
    routes_service,
    routes_sizings,
)
from api.service.errors import install_handlers
from api.service.jobs import ExecutionRunner, PlanRunner, Supervisor
from api.service.metrics import Metrics, RequestMetrics
from api.service.security import BodySizeLimit, SecurityHeaders
from api.service.settings import Settings
from api.service.store import Store
from api.service.validation import GraphValidator
from planner import __version__

STATIC = Path(__file__).resolve().parent.parent / "static"
DESCRIPTION = """Plan how to train a PyTorch model on a GPU cluster, inspect the plan, launch it.

Round trip: `POST /v1/plans` (202 + id) → poll `GET /v1/plans/{id}` until `done` →
open `/v1/plans/{id}/view` → `POST /v1/executions`. Mutating endpoints need
`Authorization: Bearer <token>` when the service has tokens (AUTOPAR_API_TOKENS).
"""


def create_app(settings: Settings | None = None, start_workers: bool = True) -> FastAPI:
    settings = settings or Settings.from_env()
    quiet_third_party_logs()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        import anyio.to_thread

        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.request_threads
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        store = Store(settings.database_url)
        owner = f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        app.state.store = store
        app.state.graph_validator = GraphValidator(settings.worker_memory_bytes)
        app.state.plan_runner = PlanRunner(store, settings, app.state.metrics, owner)
        app.state.execution_runner = ExecutionRunner(store, settings, owner)
        supervisor = Supervisor(store, app.state.plan_runner, app.state.execution_runner)
        requeued, failed = store.expire()  # jobs of replicas that died (leases run out)
        app.state.recovered = {"requeued": requeued, "failed": failed}
        if start_workers:
            supervisor.start()
        try:
            yield
        finally:
            supervisor.stop()
            app.state.graph_validator.close()
            store.close()

    app = FastAPI(
        title="autopar",
        version=__version__,
        description=DESCRIPTION,
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.finished_plans = routes_plans.FinishedCache()
    install_handlers(app)
    # Outermost last: metrics see every answer, the Host check comes before any body is read.
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_body_bytes,
        memory_bytes=settings.body_memory_bytes,
        timeout_s=settings.body_read_timeout_s,
    )
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=settings.trusted_hosts)
    app.add_middleware(SecurityHeaders)
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    for module in (routes_catalog, routes_plans, routes_sizings, routes_executions, routes_service):
        app.include_router(module.router)

    return app
