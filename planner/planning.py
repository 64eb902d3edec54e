"""The planning pipeline: a checked request (planner.request) to a PlanResult or a Sizing.

`autopar plan`/`autopar size`, the service's planning job and `autopar.plan` all call these
two functions; they differ only in where the request comes from (flags, a JSON body,
keywords) and how progress is shown, so the same request gets the same plan everywhere
(tests/test_pins.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from planner.errors import InputError
from planner.plan import Plan
from planner.request import PlanningInputs, PlanningRequest, Say
from planner.search.baselines import BaselineResult
from planner.search.layout_cache import Progress
from planner.search.search import NoFeasiblePlan, search
from planner.search.sizing import RunAsked, Sizing
from planner.search.space import SearchOptions

__all__ = ["NoFeasiblePlan", "PlanResult", "RunAsked", "plan_request", "size_request"]


class ExportTarget(Protocol):
    """A framework the plan must be expressible in (api.export.targets)."""

    name: str

    def restrict(self, options: SearchOptions) -> SearchOptions: ...

    def refusal(self, plan: Plan) -> str | None: ...


# Plans of the restricted search's fitting candidates tried, fastest first, for one the
# target accepts (each a to_plan: bounded work per request).
MAX_TRIED = 64


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
    target: ExportTarget | None = None,
) -> PlanResult:
    """Trace, search, price the run, evaluate the baseline families; with a `target`, the
    best plan that framework can express, and how much faster the best without that
    restriction would be. Raises NoFeasiblePlan."""
    from planner.search.baselines import baseline
    from planner.search.sizing import training_run
    from planner.vocab import BASELINE_KINDS

    progress = progress or _quiet
    inputs = request.trace(say=say, workers=options.workers)
    if request.batches is not None:
        if target is not None:
            raise InputError(
                "training.global_batch_size",
                f"a range ({request.batches.text()}) with an export target",
                "one global batch with search.export_to",
            )
        plan, inputs = _plan_batches(request.batches, inputs, options, progress, say)
    elif target is None:
        plan = search(inputs, options, progress=progress).plan
    else:
        plan = _plan_for(target, inputs, options, progress)
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


def _plan_batches(batches, inputs, options: SearchOptions, progress, say):
    """The best plan over a global batch range (planner.search.batch), explained; and the
    inputs at the chosen batch (the baselines are evaluated there)."""
    from planner.search.batch import batch_lines, largest_microbatch, search_batches

    if say:
        say(f"searching the global batch over {', '.join(map(str, batches.candidates()))}")
    plan, tried = search_batches(inputs, options, batches, progress)
    chosen = plan.request.training.global_batch_size
    inputs = replace(
        inputs, training=inputs.training.model_copy(update={"global_batch_size": chosen})
    )
    largest = largest_microbatch(inputs, options, plan)
    devices = inputs.cluster.num_devices
    lines = batch_lines(tried, chosen, devices, largest)
    return plan.model_copy(update={"explanation": [*plan.explanation, *lines]}), inputs


def _plan_for(target: ExportTarget, inputs, options: SearchOptions, progress) -> Plan:
    """The fastest plan the target accepts: the search on what its configuration can say,
    its fitting candidates tried fastest first against the target's own refusals; the
    explanation says what the unrestricted search (same runtime) would gain."""
    # (the plan runs in the target, not autopar's executor: neither search asks that it run)
    unrestricted = search(inputs, replace(options, executable_only=False), progress=progress).plan
    found = search(inputs, target.restrict(options), progress=progress)
    why, plan = None, None
    for i, candidate in enumerate(found.candidates[:MAX_TRIED]):
        tried = found.plan if i == 0 else found.plan_for(candidate)
        why = target.refusal(tried)
        if why is None:
            plan = tried
            break
    if plan is None:
        tried = min(len(found.candidates), MAX_TRIED)
        raise NoFeasiblePlan(
            [f"No plan {target.name} can express among the {tried} fastest that fit: {why}"],
            reason="export",
        )
    gain = plan.predicted.step_time_s / unrestricted.predicted.step_time_s - 1
    best = unrestricted.mesh.dims.summary()
    line = (
        f"Planned for {target.name} (what its configuration can express, predicted for its "
        f"runtime): "
        + (
            "the best plan without that restriction is this one."
            if gain < 0.0005
            else f"the best plan without that restriction ({best}, "
            f"{unrestricted.predicted.step_time_s:.3f} s) would be {gain:.1%} faster "
            "than this one."
        )
    )
    return plan.model_copy(update={"explanation": [*plan.explanation, line]})


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
    from planner.search.batch import refuse_range
    from planner.search.sizing import size

    refuse_range(request.batches, "sizing")
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
