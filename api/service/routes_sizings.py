"""/v1/sizings: how many GPUs: plan a model on a sweep of cluster sizes (a planning job like
a plan's, in a worker process), the run's time and cost per size, the chart in a browser."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, HTTPException, Response
from fastapi.responses import HTMLResponse

from api.service.deps import JobQueueDep, PlanRunnerDep, StoreDep
from api.service.errors import AUTH_ERRORS, ERRORS, QUEUE_ERRORS
from api.service.schemas import SizingCreate, SizingJob
from api.service.security import require_token
from api.service.store import PlanRow, Store
from api.service.submit import IdempotencyKey, submit
from api.service.validation import check_values
from planner.errors import InputError
from planner.request import search_options
from planner.search.sizing import Sizing, node_counts, parse_duration, read_run

router = APIRouter(prefix="/v1/sizings", tags=["sizings"])
SIZING_EXAMPLE = {
    "model": {"name": "llama3-70b"},
    "cluster": {"name": "dgx-h100"},
    "training": {"global_batch_size": 2048, "seq_len": 8192},
    "sizing": {
        "min_nodes": 8,
        "max_nodes": 128,
        "train_tokens": "15T",
        "gpu_hour_price": 2.5,
        "deadline": "90d",
    },
}


def sizing_view(row: PlanRow, cached: bool = False) -> dict[str, Any]:
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
        "sizing": Sizing.model_validate_json(row.plan_json) if row.plan_json else None,
        "links": {"self": f"/v1/sizings/{row.id}", "view": f"/v1/sizings/{row.id}/view"},
    }


def sweep_of(body: SizingCreate) -> list[int]:
    """The node counts, after checking the sweep's fields (errors name them)."""
    s = body.sizing
    run = read_run(s.train_tokens, s.gpu_hour_price, "sizing", goodput=s.goodput)
    if s.deadline is not None:
        parse_duration(s.deadline, "sizing.deadline")
    if s.budget is not None and run is not None and run.gpu_hour_price is None:
        raise InputError("sizing.budget", "given without gpu_hour_price", "a price to compare")
    return node_counts(s.min_nodes, s.max_nodes, "sizing.max_nodes")


@router.post(
    "",
    response_model=SizingJob,
    status_code=202,
    responses={
        200: {"model": SizingJob, "description": "an identical request was sized before"},
        **AUTH_ERRORS,
        **QUEUE_ERRORS,
    },
    dependencies=[Depends(require_token)],
    summary="Plan a model on a sweep of cluster sizes: time, throughput and cost of the run",
)
def create_sizing(
    response: Response,
    queue: JobQueueDep,
    body: Annotated[
        SizingCreate,
        Body(
            openapi_examples={"llama3-70b": {"summary": "8-128 DGX H100", "value": SIZING_EXAMPLE}}
        ),
    ],
    idempotency_key: IdempotencyKey = None,
) -> dict[str, Any]:
    check_values(body.model_dump(mode="python"))
    search_options(body.search.model_dump(exclude_none=True))
    sizes = sweep_of(body)
    return submit(
        body, "sizing", response, queue, sizing_view, sizes=sizes, idempotency_key=idempotency_key
    )


def _row(store: Store, sizing_id: str) -> PlanRow:
    row = store.get_plan(sizing_id)
    if row is None or row.kind != "sizing":
        raise HTTPException(404, f"no sizing {sizing_id!r}")
    return row


@router.get("/{sizing_id}", response_model=SizingJob, responses=ERRORS, summary="Status, sizes")
def get_sizing(sizing_id: str, store: StoreDep) -> dict[str, Any]:
    return sizing_view(_row(store, sizing_id))


@router.delete(
    "/{sizing_id}",
    status_code=204,
    responses={**ERRORS, **AUTH_ERRORS},
    dependencies=[Depends(require_token)],
    summary="Delete a sizing (cancelling its job if it is queued or running)",
)
def delete_sizing(sizing_id: str, store: StoreDep, runner: PlanRunnerDep) -> Response:
    row = _row(store, sizing_id)
    runner.cancel(row.id)
    with store.session() as s:
        found = s.get(PlanRow, sizing_id)
        if found is not None:
            s.delete(found)
    return Response(status_code=204)


@router.get(
    "/{sizing_id}/view",
    response_class=HTMLResponse,
    responses={
        200: {"content": {"text/html": {}}, "description": "the sizing page"},
        404: {"content": {"text/html": {}}, "description": "no such sizing (an HTML page)"},
    },
    summary="The sizing in the browser: throughput and cost against GPUs, the table",
)
def view_sizing(sizing_id: str, store: StoreDep) -> HTMLResponse:
    from api.viewer import render_missing_page, render_sizing_page, render_status_page

    row = store.get_plan(sizing_id)
    css = "/static/viewer.css"
    if row is None or row.kind != "sizing":
        return HTMLResponse(render_missing_page(sizing_id, css), status_code=404)
    if not row.plan_json:
        view = sizing_view(row)
        view["explanation"] = json.loads(row.explanation_json) if row.explanation_json else []
        return HTMLResponse(render_status_page(view, css_href=css))
    return HTMLResponse(render_sizing_page(Sizing.model_validate_json(row.plan_json), css))
