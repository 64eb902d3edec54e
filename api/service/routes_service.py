"""Service endpoints outside /v1: liveness, Prometheus metrics, OPTIONS from the OpenAPI
schema, and the offline API docs (Swagger UI and ReDoc from /static)."""

from __future__ import annotations

import base64
import hashlib
import re

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel

from api.service.deps import ExecutionRunnerDep, MetricsDep, StoreDep
from api.service.metrics import CONTENT_TYPE
from api.service.security import CONTENT_SECURITY_POLICY
from planner import __version__

router = APIRouter()


class Health(BaseModel):
    status: str
    version: str
    queued_or_running_plans: int
    active_executions: int


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """The methods the OpenAPI schema documents at `path`, and OPTIONS. A template without
    parameters that matches wins over templated ones, as the router routes it
    (/v1/plans/compare is not /v1/plans/{plan_id})."""
    paths = app.openapi()["paths"]
    if path in paths:
        return sorted({m.upper() for m in paths[path]} | {"OPTIONS"})
    methods: set[str] = set()
    for template, operations in paths.items():
        pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
        if re.fullmatch(pattern, path):
            methods |= {m.upper() for m in operations}
    return sorted(methods | {"OPTIONS"}) if methods else []


@router.get("/healthz", response_model=Health, tags=["service"], summary="Liveness")
async def healthz(store: StoreDep, runner: ExecutionRunnerDep) -> dict:
    # On the event loop, not in the thread pool: it answers whenever the loop does, however
    # many slow handlers hold pool threads (one count by primary-key index, sub-millisecond).
    return {
        "status": "ok",
        "version": __version__,
        "queued_or_running_plans": store.active_plans(),
        "active_executions": runner.busy(),
    }


@router.get(
    "/metrics",
    tags=["service"],
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}},
    summary="Prometheus metrics: requests, plan jobs, durations",
)
def metrics(registry: MetricsDep) -> Response:
    return Response(registry.render(), media_type=CONTENT_TYPE)


@router.options("/{path:path}", include_in_schema=False)
def options(path: str, request: Request) -> Response:
    """CORS-free OPTIONS: 204 with every method the path documents in `Allow`."""
    methods = allowed_methods(request.app, "/" + path)
    if not methods:
        return Response(status_code=404)
    return Response(status_code=204, headers={"Allow": ", ".join(methods)})


@router.get("/docs", include_in_schema=False)
def docs() -> HTMLResponse:
    page = get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="autopar API",
        swagger_js_url="/static/vendor/swagger-ui-bundle.js",
        swagger_css_url="/static/vendor/swagger-ui.css",
        swagger_favicon_url="/static/vendor/favicon-32x32.png",
    )
    # The page starts Swagger UI with one inline script: allowed by its hash, nothing else.
    inline = re.findall(r"<script>(.*?)</script>", page.body.decode(), flags=re.DOTALL)
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'"
        for s in inline
    )
    policy = CONTENT_SECURITY_POLICY.replace("script-src 'self'", f"script-src 'self' {hashes}")
    page.headers["content-security-policy"] = policy
    return page


@router.get("/redoc", include_in_schema=False)
def redoc() -> HTMLResponse:
    return get_redoc_html(
        openapi_url="/openapi.json",
        title="autopar API",
        redoc_js_url="/static/vendor/redoc.standalone.js",
        redoc_favicon_url="/static/vendor/favicon-32x32.png",
        with_google_fonts=False,
    )
