"""What a route needs from the running service, as FastAPI dependencies with Annotated
aliases (`store: StoreDep`): the store (and job queue), the settings, the job runners, the
metrics, the graph validator and the cache of finished plans, all created once per app (in
create_app and its lifespan) and kept on `app.state`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

from api.service.settings import Settings
from api.service.store import Store

if TYPE_CHECKING:  # the runners import this package's store and settings, not the routes
    from api.service.jobs import ExecutionRunner, PlanRunner
    from api.service.metrics import Metrics
    from api.service.validation import GraphValidator


def _from_state(name: str) -> Callable[[Request], Any]:
    def get(request: Request) -> Any:
        return getattr(request.app.state, name)

    get.__name__ = f"get_{name}"
    return get


StoreDep = Annotated[Store, Depends(_from_state("store"))]
SettingsDep = Annotated[Settings, Depends(_from_state("settings"))]
PlanRunnerDep = Annotated["PlanRunner", Depends(_from_state("plan_runner"))]
ExecutionRunnerDep = Annotated["ExecutionRunner", Depends(_from_state("execution_runner"))]
MetricsDep = Annotated["Metrics", Depends(_from_state("metrics"))]
GraphValidatorDep = Annotated["GraphValidator", Depends(_from_state("graph_validator"))]
FinishedPlansDep = Annotated[Any, Depends(_from_state("finished_plans"))]


class JobQueue:
    """What queueing a planning job takes (api.service.submit): the model checker, the store,
    the limits and the cache-hit counter."""

    def __init__(
        self,
        validator: GraphValidatorDep,
        store: StoreDep,
        settings: SettingsDep,
        metrics: MetricsDep,
    ):
        self.validator, self.store, self.settings, self.metrics = (
            validator,
            store,
            settings,
            metrics,
        )


JobQueueDep = Annotated[JobQueue, Depends(JobQueue)]
