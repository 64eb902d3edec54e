"""/v1/plans: submit a planning job, poll it, list, delete, and view the plan in a browser."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, HTTPException, Query, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse
from sqlalchemy import func, select

from api.service.deps import (
    FinishedPlansDep,
    GraphValidatorDep,
    MetricsDep,
    PlanRunnerDep,
    SettingsDep,
    StoreDep,
)
from api.service.errors import AUTH_ERRORS, ERRORS, QUEUE_ERRORS
from api.service.routes_catalog import find_cluster
from api.service.schemas import PLAN_EXAMPLE, PlanCreate, PlanJob, PlanList, PlanStatus
from api.service.security import require_token
from api.service.store import PlanRow, Store, dumps
from api.service.validation import check_values
from planner.cluster.profile import ClusterProfile
from planner.errors import InputError
from planner.plan import Plan
from planner.request import search_options

router = APIRouter(prefix="/v1/plans", tags=["plans"])
CACHEABLE = ("queued", "running", "done", "infeasible")
FINISHED = ("done", "infeasible", "failed", "cancelled")


def _check_model(body: PlanCreate, settings, validator) -> tuple[int, bool, str]:
    """Reject a bad model before it is queued (the job would fail the same way later);
    (layers the search will see, whether the job traces the model, its family, the sequence
    length it trains at)."""
    from planner.models import ModelSpec, resolve

    graph = body.model.graph
    if graph is not None:
        nodes = graph.get("nodes")
        limit = settings.max_graph_nodes
        if isinstance(nodes, list) and len(nodes) > limit:
            raise InputError(
                "model.graph.nodes",
                f"{len(nodes)} nodes exceed this service's limit",
                f"at most {limit} nodes",
            )
        seq = body.training.seq_len or 0  # a graph's family never takes cp
        return validator.summary(json.dumps(graph))["layers"], False, "graph", seq
    model = resolve(
        ModelSpec(name=body.model.name, config=body.model.config, hf_config=body.model.hf_config)
    )
    seq = body.training.seq_len or getattr(model.config, "seq_len", 0) or 0
    return getattr(model.config, "layers", 1), True, model.family.name, seq


def _check_work(body: PlanCreate, profile: ClusterProfile, model: tuple, limit):
    """Refuse what the per-job time limit would cut, naming what is too big. `model`:
    _check_model's (layers, traced, family, sequence length)."""
    from planner.search.work import planning_work

    layers, traced, family, seq = model
    pinned = body.search.mesh is not None
    batch = body.training.global_batch_size
    work = planning_work(profile, layers, batch, traced, family, seq)
    # A pinned mesh leaves only its micro-batch sizes (at most 32) to search.
    share = min(1.0, 32 / max(work.combinations, 1)) if pinned else 1.0
    seconds = work.trace_s + work.search_s * share
    if seconds <= limit:
        return
    field = "model.config.layers" if work.trace_s >= work.search_s * share else "cluster"
    raise InputError(
        field,
        f"planning this request would take {work.describe()}, past this service's "
        f"per-job limit of {limit:g} s",
        "fewer layers or devices, or a pinned search.mesh",
    )


def _resolve_cluster(body: PlanCreate, store: Store) -> ClusterProfile:
    if body.cluster.profile is not None:
        profile = body.cluster.profile
    else:
        found = find_cluster(store, body.cluster.name or "")
        if found is None:
            raise InputError(
                "cluster.name",
                f"unknown cluster {body.cluster.name!r}",
                "a bundled or stored profile (GET /v1/clusters)",
            )
        profile = found
    return profile.with_nodes(body.cluster.nodes)


def job_view(row: PlanRow, cached: bool = False) -> dict[str, Any]:
    plan = Plan.model_validate_json(row.plan_json) if row.plan_json else None
    return {
        "id": row.id,
        "status": row.status,
        "model": row.model_name,
        "cluster": row.cluster_name,
        "created_at": row.created_at,
        "started_at": row.started_at,
        "finished_at": row.finished_at,
        "cached": cached,
        "progress": {
            "step": row.progress_step,
            "done": row.progress_done,
            "total": row.progress_total,
        },
        "error": row.error,
        "explanation": json.loads(row.explanation_json) if row.explanation_json else [],
        "step_time_s": plan.predicted.step_time_s if plan else None,
        "predicted": plan.predicted if plan else None,
        "plan": plan,
        "baselines": json.loads(row.baselines_json) if row.baselines_json else [],
        "links": {"self": f"/v1/plans/{row.id}", "view": f"/v1/plans/{row.id}/view"},
    }


@router.post(
    "",
    response_model=PlanJob,
    status_code=202,
    responses={
        200: {"model": PlanJob, "description": "an identical request was planned before"},
        **AUTH_ERRORS,
        **QUEUE_ERRORS,
    },
    dependencies=[Depends(require_token)],
    summary="Plan a model on a cluster (runs in a worker process; poll GET /v1/plans/{id})",
)
def create_plan(
    response: Response,
    validator: GraphValidatorDep,
    store: StoreDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    body: Annotated[
        PlanCreate,
        Body(
            openapi_examples={"gpt-1.3b": {"summary": "gpt-1.3b on 8 A100", "value": PLAN_EXAMPLE}}
        ),
    ],
) -> dict[str, Any]:
    check_values(body.model_dump(mode="python"))
    search_options(body.search.model_dump(exclude_none=True))  # pins that contradict: 422
    model = _check_model(body, settings, validator)
    profile = _resolve_cluster(body, store)
    _check_work(body, profile, model, settings.job_time_limit_s)
    request_doc = body.model_dump(mode="json")
    profile_doc = profile.model_dump(mode="json")
    digest = hashlib.sha256(dumps({"r": request_doc, "p": profile_doc}).encode()).hexdigest()
    with store.session() as s:
        hit = s.scalars(
            select(PlanRow)
            .where(PlanRow.request_hash == digest, PlanRow.status.in_(CACHEABLE))
            .order_by(PlanRow.created_at.desc())
            .limit(1)
        ).first()
    if hit is not None:
        metrics.cache_hits.inc()
        response.status_code = 200
        return job_view(hit, cached=True)
    if store.active_plans() >= settings.max_queued_jobs:
        raise _queue_full(settings.retry_after_s)
    plan_id = uuid.uuid4().hex[:16]
    model_name = body.model.name or (body.model.graph or {}).get("model") or "graph"
    row = PlanRow(
        id=plan_id,
        request_hash=digest,
        status="queued",
        model_name=str(model_name)[:200],
        cluster_name=profile.name[:200],
        request_json=json.dumps({"request": request_doc, "profile": profile_doc}),  # order kept
        created_at=time.time(),
        progress_done=0,
        progress_total=0,
    )
    with store.session() as s:
        s.add(row)  # the store is the queue: a replica's supervisor claims it
    response.headers["Location"] = f"/v1/plans/{plan_id}"
    return job_view(row)


def _queue_full(retry_after: int) -> HTTPException:
    return HTTPException(
        429,
        "the planning queue is full; retry later",
        headers={"Retry-After": str(retry_after)},
    )


@router.get("", response_model=PlanList, summary="List plans (newest first), with filters")
def list_plans(
    store: StoreDep,
    status: Annotated[PlanStatus | None, Query()] = None,
    model: Annotated[str | None, Query(max_length=200)] = None,
    cluster: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
) -> dict[str, Any]:
    query = select(PlanRow)
    if status:
        query = query.where(PlanRow.status == status)
    if model:
        query = query.where(PlanRow.model_name == model)
    if cluster:
        query = query.where(PlanRow.cluster_name == cluster)
    with store.session() as s:
        total = s.scalar(select(func.count()).select_from(query.subquery())) or 0
        rows = s.scalars(
            query.order_by(PlanRow.created_at.desc()).limit(limit).offset(offset)
        ).all()
    items = []
    for row in rows:
        step = None
        if row.plan_json:
            step = json.loads(row.plan_json)["predicted"]["step_time_s"]
        items.append(
            {
                "id": row.id,
                "status": row.status,
                "model": row.model_name,
                "cluster": row.cluster_name,
                "created_at": row.created_at,
                "step_time_s": step,
            }
        )
    return {"items": items, "total": total, "limit": limit, "offset": offset}


def _row(store: Store, plan_id: str) -> PlanRow:
    row = store.get_plan(plan_id)
    if row is None:
        raise HTTPException(404, f"no plan {plan_id!r}")
    return row


@router.get("/{plan_id}", response_model=PlanJob, responses=ERRORS, summary="Status and plan")
async def get_plan(plan_id: str, store: StoreDep, cache: FinishedPlansDep) -> Response:
    # A finished job never changes: its serialized body is kept, so polling clients and
    # viewers cost a dictionary lookup (bench/results/service.md).
    body = cache.get(plan_id)
    if body is None:
        row = await run_in_threadpool(_row, store, plan_id)
        body = PlanJob.model_validate(job_view(row)).model_dump_json().encode()
        if row.status in FINISHED:
            cache.put(plan_id, body)
    return Response(body, media_type="application/json")


class FinishedCache:
    """Serialized bodies of finished plan jobs (bounded, least recently used out first)."""

    def __init__(self, size: int = 512):
        self.size = size
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            body = self._items.get(key)
            if body is not None:
                self._items.move_to_end(key)
            return body

    def put(self, key: str, body: bytes) -> None:
        with self._lock:
            self._items[key] = body
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def drop(self, key: str) -> None:
        with self._lock:
            self._items.pop(key, None)


@router.delete(
    "/{plan_id}",
    status_code=204,
    responses={**ERRORS, **AUTH_ERRORS},
    dependencies=[Depends(require_token)],
    summary="Delete a plan (cancelling its job if it is queued or running)",
)
def delete_plan(
    plan_id: str, store: StoreDep, runner: PlanRunnerDep, cache: FinishedPlansDep
) -> Response:
    row = _row(store, plan_id)
    runner.cancel(row.id)
    cache.drop(plan_id)
    with store.session() as s:
        found = s.get(PlanRow, plan_id)
        if found is not None:
            s.delete(found)
    return Response(status_code=204)


@router.get(
    "/{plan_id}/view",
    response_class=HTMLResponse,
    responses={
        200: {"content": {"text/html": {}}, "description": "the plan viewer"},
        404: {"content": {"text/html": {}}, "description": "no such plan (an HTML page)"},
    },
    summary="The plan in the browser: device grid, schedule, shardings, memory, baselines",
)
def view_plan(plan_id: str, store: StoreDep) -> HTMLResponse:
    from api.viewer import render_missing_page, render_page, render_status_page

    row = store.get_plan(plan_id)
    if row is None:
        return HTMLResponse(render_missing_page(plan_id, "/static/viewer.css"), status_code=404)
    if not row.plan_json:
        return HTMLResponse(render_status_page(job_view(row), css_href="/static/viewer.css"))
    plan = Plan.model_validate_json(row.plan_json)
    baselines = json.loads(row.baselines_json) if row.baselines_json else []
    return HTMLResponse(render_page(plan, baselines, css_href="/static/viewer.css"))
