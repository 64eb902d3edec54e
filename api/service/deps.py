"""What a route needs from the running service, as FastAPI dependencies with Annotated
aliases (`store: StoreDep`): the store (and job queue), the settings, the job runners, the
metrics and the cache of finished plans, all created once per app in its lifespan."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

from api.service.settings import Settings
from api.service.store import Store

if TYPE_CHECKING:  # the runners import this package's store and settings, not the routes
    from api.service.jobs import ExecutionRunner, PlanRunner
    from api.service.metrics import Metrics
    from api.service.validation import GraphValidator


def get_store(request: Request) -> Store:
    return request.app.state.store


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_plan_runner(request: Request) -> PlanRunner:
    return request.app.state.plan_runner


def get_execution_runner(request: Request) -> ExecutionRunner:
    return request.app.state.execution_runner


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def get_graph_validator(request: Request) -> GraphValidator:
    return request.app.state.graph_validator


def get_finished_plans(request: Request) -> Any:
    return request.app.state.finished_plans


StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
PlanRunnerDep = Annotated["PlanRunner", Depends(get_plan_runner)]
ExecutionRunnerDep = Annotated["ExecutionRunner", Depends(get_execution_runner)]
MetricsDep = Annotated["Metrics", Depends(get_metrics)]
FinishedPlansDep = Annotated[Any, Depends(get_finished_plans)]
GraphValidatorDep = Annotated["GraphValidator", Depends(get_graph_validator)]
