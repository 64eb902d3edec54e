"""/v1/executions: run a stored plan locally with torchrun, or render its cluster launch files."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, HTTPException, Response
from sqlalchemy import select, update

from api.service.deps import ExecutionRunnerDep, SettingsDep, StoreDep
from api.service.errors import AUTH_ERRORS, ERRORS, QUEUE_ERRORS
from api.service.schemas import ErrorMessage, Execution, ExecutionCreate
from api.service.security import require_token
from api.service.store import ExecutionRow, KeyReused, QueueFull, Store, dumps
from api.service.submit import IDEMPOTENCY_CONFLICT, IdempotencyKey
from planner.errors import InputError
from planner.executable import execution_refusal
from planner.plan import Plan

router = APIRouter(prefix="/v1/executions", tags=["executions"])
CONFLICT = {
    409: {"model": ErrorMessage, "description": "the plan or execution is not in a state for this"}
}


def execution_view(row: ExecutionRow) -> dict[str, Any]:
    result = json.loads(row.result_json) if row.result_json else None
    files = result.pop("files", {}) if isinstance(result, dict) else {}
    return {
        "id": row.id,
        "plan_id": row.plan_id,
        "target": row.target,
        "status": row.status,
        "created_at": row.created_at,
        "started_at": row.started_at,
        "finished_at": row.finished_at,
        "error": row.error,
        "result": result,
        "files": files,
    }


def _runnable_check(plan: Plan) -> None:
    """Every target runs autopar's executor (locally, or the script's torchrun job)."""
    if refused := execution_refusal(plan):
        raise InputError(
            "plan_id",
            f"{refused[1]} (plan.{refused[0]})",
            "a plan made with search.executable_only = true for runtime autopar",
        )


def _local_check(plan: Plan, settings) -> None:
    world = plan.mesh.processes
    if world > settings.max_local_ranks:
        raise InputError(
            "plan_id",
            f"the plan needs {world} ranks; this service runs at most {settings.max_local_ranks} "
            "locally",
            'target "slurm" or "k8s" for a cluster',
        )
    if plan.request.model.params > settings.max_local_params:
        raise InputError(
            "plan_id",
            f"{plan.request.model.params} parameters is too big to train on this host",
            f'at most {settings.max_local_params}, or target "slurm" / "k8s"',
        )


@router.post(
    "",
    response_model=Execution,
    status_code=202,
    responses={
        200: {"model": Execution, "description": "a retry: the execution its key made"},
        **ERRORS,
        **AUTH_ERRORS,
        **QUEUE_ERRORS,
        **CONFLICT,
    },
    dependencies=[Depends(require_token)],
    summary="Launch a stored plan (local torchrun) or render its Slurm / Kubernetes files",
)
def create_execution(
    store: StoreDep,
    settings: SettingsDep,
    runner: ExecutionRunnerDep,
    response: Response,
    body: Annotated[
        ExecutionCreate,
        Body(
            openapi_examples={
                "local": {
                    "summary": "train 3 steps locally",
                    "value": {"plan_id": "<id from POST /v1/plans>", "steps": 3},
                },
                "slurm": {
                    "summary": "render a Slurm script",
                    "value": {"plan_id": "<id from POST /v1/plans>", "target": "slurm"},
                },
            }
        ),
    ],
    idempotency_key: IdempotencyKey = None,
) -> dict[str, Any]:
    plan_row = store.get_plan(body.plan_id)
    if plan_row is None:
        raise HTTPException(404, f"no plan {body.plan_id!r}")
    if plan_row.kind != "plan":  # a sizing's row holds a Sizing, not a Plan
        raise InputError(
            "plan_id", f"{body.plan_id!r} is a {plan_row.kind}", "the id of a plan (POST /v1/plans)"
        )
    if plan_row.status != "done" or not plan_row.plan_json:
        raise HTTPException(409, f"plan {body.plan_id} is {plan_row.status}, not done")
    plan = Plan.model_validate_json(plan_row.plan_json)
    row = ExecutionRow(
        id=uuid.uuid4().hex[:16],
        plan_id=body.plan_id,
        target=body.target,
        status="queued",
        options_json=dumps(body.model_dump(mode="json")),
        created_at=time.time(),
        idempotency_key=idempotency_key,
    )
    _runnable_check(plan)
    if body.target != "local":
        from executor.launch_scripts import render

        text = render(plan, body.target, "plan.json", steps=body.steps)
        name = "job.sbatch" if body.target == "slurm" else "pytorchjob.yaml"
        row.status, row.started_at, row.finished_at = "succeeded", row.created_at, time.time()
        row.result_json = dumps({"files": {name: text}})
        return _stored(store, row, response)
    _local_check(plan, settings)
    for key, value in runner.lease().items():
        setattr(row, key, value)
    stored = _stored(store, row, response)
    if stored["id"] != row.id:  # a retry: the first request's execution
        return stored
    try:
        runner.submit(row.id, row.lease_token, plan_row.plan_json, body.steps)
    except QueueFull:
        with store.session() as s:
            s.delete(s.get(ExecutionRow, row.id))
        raise HTTPException(
            429,
            "too many executions running; retry later",
            headers={"Retry-After": str(settings.retry_after_s)},
        ) from None
    return execution_view(row)


def _stored(store: Store, row: ExecutionRow, response: Response) -> dict[str, Any]:
    """Store `row`, or answer with the execution an earlier request with its idempotency
    key made (200)."""
    try:
        kept, new = store.add_execution(row)
    except KeyReused:
        raise HTTPException(409, IDEMPOTENCY_CONFLICT) from None
    if not new:
        response.status_code = 200
    return execution_view(kept)


@router.get("", response_model=list[Execution], summary="Recent executions (newest first)")
def list_executions(store: StoreDep, plan_id: str | None = None) -> list[dict[str, Any]]:
    query = select(ExecutionRow).order_by(ExecutionRow.created_at.desc()).limit(100)
    if plan_id:
        query = query.where(ExecutionRow.plan_id == plan_id)
    with store.session() as s:
        return [execution_view(r) for r in s.scalars(query)]


def _row(store: Store, execution_id: str) -> ExecutionRow:
    with store.session() as s:
        row = s.get(ExecutionRow, execution_id)
    if row is None:
        raise HTTPException(404, f"no execution {execution_id!r}")
    return row


@router.get(
    "/{execution_id}",
    response_model=Execution,
    responses=ERRORS,
    summary="Status, per-rank outcome, measured vs predicted",
)
def get_execution(execution_id: str, store: StoreDep) -> dict[str, Any]:
    return execution_view(_row(store, execution_id))


@router.delete(
    "/{execution_id}",
    response_model=Execution,
    status_code=202,
    responses={**ERRORS, **AUTH_ERRORS, **CONFLICT},
    dependencies=[Depends(require_token)],
    summary="Cancel a running execution (its processes are stopped)",
)
def cancel_execution(
    execution_id: str, store: StoreDep, runner: ExecutionRunnerDep
) -> dict[str, Any]:
    row = _row(store, execution_id)
    if row.status not in ("queued", "running"):
        raise HTTPException(409, f"execution {execution_id} already {row.status}")
    # The replica running it sees the request at its next heartbeat (this one at once).
    with store.session() as s:
        s.execute(
            update(ExecutionRow)
            .where(ExecutionRow.id == execution_id)
            .values(cancel_requested=True)
        )
    runner.cancel(execution_id)
    return execution_view(row)
