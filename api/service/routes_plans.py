"""/v1/plans: submit a planning job, poll it, list, delete, and view the plan in a browser."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, HTTPException, Query, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse
from sqlalchemy import func, select

from api.service.deps import FinishedPlansDep, JobQueueDep, PlanRunnerDep, StoreDep
from api.service.errors import AUTH_ERRORS, ERRORS, QUEUE_ERRORS
from api.service.recent import Recent
from api.service.schemas import PLAN_EXAMPLE, PlanCreate, PlanJob, PlanList, PlanStatus
from api.service.security import require_token
from api.service.store import PlanRow, Store
from api.service.submit import IdempotencyKey, submit
from api.service.validation import check_values
from planner.plan import Plan
from planner.request import search_options
from planner.search.sizing import read_run

router = APIRouter(prefix="/v1/plans", tags=["plans"])
FINISHED = ("done", "infeasible", "failed", "cancelled")


def job_view(row: PlanRow, cached: bool = False) -> dict[str, Any]:
    """A job as PlanJob's JSON document. The stored plan was written from a checked Plan
    (Plan.to_json) and goes out as it is: validating ~100 KB of plan again was most of a
    request's time (bench/results/service.md)."""
    plan = json.loads(row.plan_json) if row.plan_json else None
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
        "step_time_s": plan["predicted"]["step_time_s"] if plan else None,
        "predicted": plan["predicted"] if plan else None,
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
        201: {
            "model": PlanJob,
            "description": "planned at once: the search's answer was cached (the run to price "
            "may differ from the earlier request's)",
        },
        **AUTH_ERRORS,
        **QUEUE_ERRORS,
    },
    dependencies=[Depends(require_token)],
    summary="Plan a model on a cluster (runs in a worker process; poll GET /v1/plans/{id})",
)
def create_plan(
    response: Response,
    queue: JobQueueDep,
    body: Annotated[
        PlanCreate,
        Body(
            openapi_examples={"gpt-1.3b": {"summary": "gpt-1.3b on 8 A100", "value": PLAN_EXAMPLE}}
        ),
    ],
    idempotency_key: IdempotencyKey = None,
) -> Response:
    check_values(body.model_dump(mode="python"))
    search_options(body.search.model_dump(exclude_none=True))  # pins that contradict: 422
    if body.run is not None:  # a bad token count or price: 422 before anything is queued
        read_run(body.run.train_tokens, body.run.gpu_hour_price, "run", goodput=body.run.goodput)
    view = submit(body, "plan", response, queue, job_view, idempotency_key=idempotency_key)
    # PlanJob's document as it is (job_view), with the status and Location submit chose
    return Response(
        job_body(view),
        status_code=response.status_code or 202,
        headers=dict(response.headers),
        media_type="application/json",
    )


def job_body(view: dict[str, Any]) -> bytes:
    return json.dumps(view, separators=(",", ":")).encode()


@router.get("", response_model=PlanList, summary="List plans (newest first), with filters")
def list_plans(
    store: StoreDep,
    status: Annotated[PlanStatus | None, Query()] = None,
    model: Annotated[str | None, Query(max_length=200)] = None,
    cluster: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
) -> dict[str, Any]:
    query = select(PlanRow).where(PlanRow.kind == "plan")
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
    if row is None or row.kind != "plan":
        raise HTTPException(404, f"no plan {plan_id!r}")
    return row


PLAN_ID = Query(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="a plan's id")


@router.get(
    "/compare",
    response_class=HTMLResponse,
    responses={
        200: {"content": {"text/html": {}}, "description": "the two plans side by side"},
        404: {"content": {"text/html": {}}, "description": "a plan is missing or not done"},
    },
    summary="Two plans side by side: figures with their ratios, schedules, memory",
)
def compare_plans(
    store: StoreDep, a: Annotated[str, PLAN_ID], b: Annotated[str, PLAN_ID]
) -> HTMLResponse:
    from api.viewer import render_compare_page, render_missing_page

    plans = []
    for plan_id in (a, b):
        row = store.get_plan(plan_id)
        if row is None or row.kind != "plan" or not row.plan_json:
            why = (
                f"Its job is {row.status}: nothing to compare yet."
                if row and row.kind == "plan"
                else ""
            )
            page = render_missing_page(plan_id, "/static/viewer.css", why=why)
            return HTMLResponse(page, status_code=404)
        plans.append(Plan.model_validate_json(row.plan_json))
    page = render_compare_page(plans[0], plans[1], (a, b), css_href="/static/viewer.css")
    return HTMLResponse(page)


@router.get("/{plan_id}", response_model=PlanJob, responses=ERRORS, summary="Status and plan")
async def get_plan(plan_id: str, store: StoreDep, cache: FinishedPlansDep) -> Response:
    # A finished job never changes: its serialized body is kept, so polling clients and
    # viewers skip serializing the plan (bench/results/service.md). The store stays the
    # truth: each read checks the row is still there, as it was when cached, so a plan
    # deleted through any replica, or while this one was reading it, is not served again.
    stamp = await run_in_threadpool(store.plan_stamp, plan_id)
    if stamp is None or stamp[0] != "plan":
        cache.drop(plan_id)
        raise HTTPException(404, f"no plan {plan_id!r}")
    body = cache.get(plan_id, stamp)
    if body is None:
        row = await run_in_threadpool(_row, store, plan_id)
        body = job_body(job_view(row))
        if row.status in FINISHED:
            cache.put(plan_id, (row.kind, row.status, row.finished_at), body)
    return Response(body, media_type="application/json")


class FinishedCache:
    """Serialized bodies and pages of finished plan jobs (128 entries of ~100-300 KB, least
    recently used out first), each valid only while the store's row has the stamp it was
    cached with."""

    def __init__(self, size: int = 128):
        self._items: Recent[tuple[tuple, bytes]] = Recent(size)

    def get(self, key: str, stamp: tuple) -> bytes | None:
        item = self._items.get(key)
        return None if item is None or item[0] != stamp else item[1]

    def put(self, key: str, stamp: tuple, body: bytes) -> None:
        self._items.put(key, (stamp, body))

    def drop(self, key: str) -> None:
        self._items.drop(key)


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
    cache.drop(f"view:{plan_id}")
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
def view_plan(plan_id: str, store: StoreDep, cache: FinishedPlansDep) -> HTMLResponse:
    from api.viewer import render_missing_page, render_page, render_status_page

    # A finished plan's page is rendered once per replica (checked against the store, as
    # get_plan's body is): rendering is ~10x the work of the JSON answer.
    stamp = store.plan_stamp(plan_id)
    if stamp is None or stamp[0] != "plan":
        cache.drop(f"view:{plan_id}")
        return HTMLResponse(render_missing_page(plan_id, "/static/viewer.css"), status_code=404)
    cached = cache.get(f"view:{plan_id}", stamp)
    if cached is not None:
        return HTMLResponse(cached)
    row = _row(store, plan_id)
    if not row.plan_json:
        return HTMLResponse(render_status_page(job_view(row), css_href="/static/viewer.css"))
    plan = Plan.model_validate_json(row.plan_json)
    baselines = json.loads(row.baselines_json) if row.baselines_json else []
    page = render_page(plan, baselines, css_href="/static/viewer.css").encode()
    if row.status in FINISHED:
        cache.put(f"view:{plan_id}", (row.kind, row.status, row.finished_at), page)
    return HTMLResponse(page)
