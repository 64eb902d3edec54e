"""The planning pipeline: a checked request (planner.request) to a PlanResult or a Sizing.

`autopar plan`/`autopar size`, the service's planning job and `autopar.plan` all call these
two functions; they differ only in where the request comes from (flags, a JSON body,
keywords) and how progress is shown, so the same request gets the same plan everywhere
(tests/test_pins.py)."""

from __future__ import annotations

from dataclasses import dataclass

from planner.plan import Plan
from planner.request import PlanningInputs, PlanningRequest, Say
from planner.search.baselines import BaselineResult
from planner.search.layout_cache import Progress
from planner.search.search import NoFeasiblePlan, search
from planner.search.sizing import RunAsked, Sizing
from planner.search.space import SearchOptions

__all__ = ["NoFeasiblePlan", "PlanResult", "RunAsked", "plan_request", "size_request"]


@dataclass(frozen=True)
class PlanResult:
    plan: Plan  # the best plan, its alternatives and, when asked, the run's cost
    baselines: tuple[BaselineResult, ...]  # the best of each baseline family, when asked
    inputs: PlanningInputs  # the traced model the plan was searched on


def _quiet(_step: str, _done: int, _total: int) -> None:
    pass


def plan_request(
    request: PlanningRequest,
    options: SearchOptions,
    *,
    run: RunAsked | None = None,
    baselines: bool = False,
    say: Say | None = None,
    progress: Progress | None = None,
) -> PlanResult:
    """Trace, search, price the run, evaluate the baseline families. Raises NoFeasiblePlan."""
    from planner.search.baselines import baseline
    from planner.search.sizing import training_run
    from planner.vocab import BASELINE_KINDS

    progress = progress or _quiet
    inputs = request.trace(say=say, workers=options.workers)
    plan = search(inputs, options, progress=progress).plan
    if run is not None:
        cost = training_run(plan, run.train_tokens, run.gpu_hour_price, run.goodput)
        plan = plan.model_copy(update={"run": cost})
    found: tuple[BaselineResult, ...] = ()
    if baselines:
        if say:
            say("baselines")
        progress("baselines", 0, 1)
        found = tuple(baseline(kind, inputs) for kind in BASELINE_KINDS)
    progress("done", 1, 1)
    return PlanResult(plan, found, inputs)


def size_request(
    request: PlanningRequest,
    options: SearchOptions,
    node_counts: list[int],
    run: RunAsked,
    *,
    deadline_s: float | None = None,
    budget: float | None = None,
    say: Say | None = None,
    progress: Progress | None = None,
) -> Sizing:
    """The best plan at each node count and the run's time and cost there."""
    from planner.search.sizing import size

    inputs = request.trace(say=say, workers=options.workers)
    return size(
        inputs,
        node_counts,
        run.train_tokens,
        lambda sized: search(sized, options).plan,
        price=run.gpu_hour_price,
        deadline_s=deadline_s,
        budget=budget,
        say=progress or _quiet,
        goodput=run.goodput,
    )
