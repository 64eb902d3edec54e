"""The FastAPI application: routes under /v1, offline docs, health and metrics, job runners."""

from __future__ import annotations

import os
import re
import socket
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from api.service import routes_catalog, routes_executions, routes_plans
from api.service.errors import install_handlers
from api.service.jobs import ExecutionRunner, PlanRunner, Supervisor
from api.service.metrics import CONTENT_TYPE, Metrics, RequestMetrics
from api.service.security import BodySizeLimit
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


class Health(BaseModel):
    status: str
    version: str
    queued_or_running_plans: int
    active_executions: int


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """The methods the OpenAPI schema documents at `path`, and OPTIONS."""
    methods: set[str] = set()
    for template, operations in app.openapi()["paths"].items():
        pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
        if re.fullmatch(pattern, path):
            methods |= {m.upper() for m in operations}
    return sorted(methods | {"OPTIONS"}) if methods else []


def create_app(settings: Settings | None = None, start_workers: bool = True) -> FastAPI:
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
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
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    for module in (routes_catalog, routes_plans, routes_executions):
        app.include_router(module.router)

    @app.get("/healthz", response_model=Health, tags=["service"], summary="Liveness")
    def healthz(request: Request) -> dict:
        state = request.app.state
        return {
            "status": "ok",
            "version": __version__,
            "queued_or_running_plans": state.store.active_plans(),
            "active_executions": state.execution_runner.busy(),
        }

    @app.get(
        "/metrics",
        tags=["service"],
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}},
        summary="Prometheus metrics: requests, plan jobs, durations",
    )
    def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)

    @app.options("/{path:path}", include_in_schema=False)
    def options(path: str, request: Request) -> Response:
        """CORS-free OPTIONS: 204 with every method the path documents in `Allow`."""
        methods = allowed_methods(request.app, "/" + path)
        if not methods:
            return Response(status_code=404)
        return Response(status_code=204, headers={"Allow": ", ".join(methods)})

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="autopar API",
            swagger_js_url="/static/vendor/swagger-ui-bundle.js",
            swagger_css_url="/static/vendor/swagger-ui.css",
            swagger_favicon_url="/static/vendor/favicon-32x32.png",
        )

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url="/openapi.json",
            title="autopar API",
            redoc_js_url="/static/vendor/redoc.standalone.js",
            redoc_favicon_url="/static/vendor/favicon-32x32.png",
            with_google_fonts=False,
        )

    return app
