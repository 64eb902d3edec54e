"""Prometheus metrics of one app instance (its own registry, so tests can build many apps)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Label values come from closed sets: a method HTTP defines (anything else is "other") and a
# route template (a path no route matched is "unmatched"). A label taken from the request
# itself let 10,000 made-up methods grow /metrics from 54 KB to 2.6 MB.
METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"}
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "autopar_http_requests",
            "HTTP requests by method, route template and status code",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "autopar_http_request_duration_seconds",
            "HTTP request latency",
            ["route"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
        )
        self.jobs = Counter(
            "autopar_plan_jobs",
            "finished planning jobs by outcome",
            ["status"],
            registry=self.registry,
        )
        self.job_seconds = Histogram(
            "autopar_plan_job_duration_seconds",
            "wall time of planning jobs",
            registry=self.registry,
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
        )
        self.jobs_queued = Gauge("autopar_plan_jobs_queued", "waiting jobs", registry=self.registry)
        self.jobs_running = Gauge(
            "autopar_plan_jobs_running", "running jobs", registry=self.registry
        )
        self.answers_cached = Counter(
            "autopar_plan_answers_cached",
            "plan requests answered without a job: the search's answer was in the disk cache",
            registry=self.registry,
        )
        self.cache_hits = Counter(
            "autopar_plan_cache_hits",
            "plan requests answered from the store",
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestMetrics:
    """Pure ASGI middleware counting requests by route template (no per-request task)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.requests.labels(method, route, str(status[0])).inc()
            self.metrics.request_seconds.labels(route).observe(time.perf_counter() - started)
