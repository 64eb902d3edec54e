"""The planning pipeline: a checked request (planner.request) to a PlanResult or a Sizing.

`autopar plan`/`autopar size`, the service's planning job and `autopar.plan` all call these
two functions; they differ only in where the request comes from (flags, a JSON body,
keywords) and how progress is shown, so the same request gets the same plan everywhere
(tests/test_pins.py)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context
from typing import Any, Protocol

from planner import disk_cache
from planner.errors import InputError
from planner.plan import Plan
from planner.request import PlanningInputs, PlanningRequest, Say
from planner.search.baselines import BaselineResult, GridTables
from planner.search.layout_cache import LayoutCache, Progress
from planner.search.search import NoFeasiblePlan, search
from planner.search.sizing import RunAsked, Sizing, training_run
from planner.search.space import SearchOptions

__all__ = [
    "NoFeasiblePlan",
    "PlanResult",
    "RunAsked",
    "answer_from_cache",
    "plan_request",
    "size_request",
]


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
    # the traced model the plan was searched on; None when the answer came from the cache
    inputs: PlanningInputs | None


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
    progress = progress or _quiet
    key = _answer_key(request, options, baselines) if target is None else None
    cached = _cached_answer(key)
    if cached is not None:
        if say:
            say("the same request was answered before with this code: its plan, from the cache")
        progress("done", 1, 1)
        return _with_run(cached, run)
    inputs = request.trace(say=say, workers=options.workers)
    shared = GridTables(inputs)  # the baselines' graphs and tables, the search's adopted
    sides: list = []  # the baselines' process beside the search, once started

    def baselines_beside(cache: LayoutCache | None = None) -> None:
        if cache is not None:
            shared.adopt(cache)
        beside = baselines and request.batches is None  # a range's: at the batch it chooses
        if beside and not sides:
            sides.append(_baselines_beside(shared, options.workers))

    try:
        if request.batches is not None:
            if target is not None:
                raise InputError(
                    "training.global_batch_size",
                    f"a range ({request.batches.text()}) with an export target",
                    "one global batch with search.export_to",
                )
            plan, inputs = _plan_batches(request.batches, inputs, options, progress, say)
        elif target is None:  # the baselines start once the search's tables are built
            found_plans = search(inputs, options, progress=progress, tables_ready=baselines_beside)
            plan = found_plans.plan
            shared.adopt(found_plans.layouts)  # for baselines evaluated here
        else:
            baselines_beside()
            plan = _plan_for(target, inputs, options, progress)
        found: tuple[BaselineResult, ...] = ()
        if baselines:
            if say:
                say("baselines")
            progress("baselines", 0, 1)
            found = _baselines(inputs, sides[0] if sides else None, shared)
    finally:
        for side in sides:
            if side is not None:
                side[0].shutdown(cancel_futures=True)
    progress("done", 1, 1)
    result = PlanResult(plan, found, inputs)
    if key is not None and plan.search.complete:
        _store_answer(key, result)
    return _with_run(result, run)


def answer_from_cache(
    request: PlanningRequest,
    options: SearchOptions,
    *,
    run: RunAsked | None = None,
    baselines: bool = False,
    cache_dir: str | None = None,
    parsed: AnswerMemo | None = None,
) -> PlanResult | None:
    """plan_request's answer when the disk cache (`cache_dir`, else the environment's) holds
    it: no tracing, no search (what the service answers in its own process); else None.
    `parsed`: answers already read, by key (a long-lived caller's; it never changes the
    answers it is given, which the run is priced on as copies)."""
    key = _answer_key(request, options, baselines)
    cached = parsed.get(key) if parsed is not None else None
    if cached is None:
        cached = _cached_answer(key, cache_dir)
        if cached is not None and parsed is not None:
            parsed.put(key, cached)
    return None if cached is None else _with_run(cached, run)


class AnswerMemo(Protocol):
    def get(self, key: str) -> PlanResult | None: ...

    def put(self, key: str, result: PlanResult) -> None: ...


def _with_run(result: PlanResult, run: RunAsked | None) -> PlanResult:
    """The answer with the whole run priced at its plan's throughput: the search does not
    depend on the run's tokens, price or goodput, so answers that differ only there share
    one cache entry."""
    if run is None:
        return result
    cost = training_run(result.plan, run.train_tokens, run.gpu_hour_price, run.goodput)
    return replace(result, plan=result.plan.model_copy(update={"run": cost}))


# --- the baselines beside the search ------------------------------------------------------
_BESIDE: GridTables | None = None  # what a forked baseline process evaluates, and its tables


def _baseline_in_worker(kind: str) -> BaselineResult:
    assert _BESIDE is not None, "set before the pool forks"
    return cached_baseline(kind, _BESIDE.inputs, _BESIDE)


def cached_baseline(
    kind: str, inputs: PlanningInputs, shared: GridTables | None = None
) -> BaselineResult:
    """A baseline family's best plan, from the disk cache when these inputs (model, training
    settings, cluster) were evaluated before with this code: it depends on nothing else, so
    requests that differ in what they pin or price share it. `shared`: tables the families
    evaluated on these inputs share (planner.search.baselines.GridTables)."""
    from planner.search.baselines import baseline

    material = {
        "kind": kind,
        "model": inputs.model.content_hash,
        "training": inputs.training.model_dump(mode="json"),
        "cluster": inputs.cluster.model_dump(mode="json"),
    }
    key = disk_cache.key_of("baseline", material)
    payload = disk_cache.load("baseline", key)
    if payload is not None:
        try:
            return _baseline_of(payload)
        except (KeyError, TypeError, ValueError):
            pass  # an entry this code does not read: evaluated again
    result = baseline(kind, inputs, shared)
    disk_cache.store("baseline", key, _baseline_payload(result))
    return result


def _baseline_payload(b: BaselineResult) -> dict:
    plan = None if b.plan is None else b.plan.to_json(indent=None)
    return {"kind": b.kind, "plan": plan, "evaluated": b.evaluated}


def _baseline_of(payload: dict) -> BaselineResult:
    plan = payload["plan"]
    return BaselineResult(
        payload["kind"], None if plan is None else Plan.from_json(plan), payload["evaluated"]
    )


def _baselines_beside(shared: GridTables, workers: int):
    """With workers > 1, the baseline families evaluated in a forked process while this one
    searches (on the same traced inputs, with the tables in `shared`)."""
    global _BESIDE
    if workers <= 1:
        return None
    from planner.vocab import BASELINE_KINDS

    _BESIDE = shared
    try:
        pool = ProcessPoolExecutor(1, get_context("fork"))
        return pool, [pool.submit(_baseline_in_worker, kind) for kind in BASELINE_KINDS]
    finally:
        _BESIDE = None  # the child has its copy once forked; forking happens on submit


def _baselines(inputs: PlanningInputs, side, shared: GridTables) -> tuple[BaselineResult, ...]:
    from planner.vocab import BASELINE_KINDS

    if side is not None:
        return tuple(future.result() for future in side[1])
    return tuple(cached_baseline(kind, inputs, shared) for kind in BASELINE_KINDS)


# --- answers kept in the disk cache ---------------------------------------------------------
def _answer_key(request: PlanningRequest, options: SearchOptions, baselines: bool) -> str:
    """Everything the answer depends on (the disk cache adds the planner's code and versions;
    a graph request's model names its graph by content_hash); the workers only change how
    fast it comes, and the run asked for is priced on the answer (_with_run)."""
    material: dict[str, Any] = {
        "cluster": request.cluster.model_dump(mode="json"),
        "training": request.training.model_dump(mode="json"),
        "model": request.model.model_dump(mode="json"),
        "tokens_per_sample": request.tokens_per_sample,
        "batches": None if request.batches is None else request.batches.text(),
        "options": {**dataclasses.asdict(options), "workers": None},
        "baselines": baselines,
    }
    return disk_cache.key_of("answer", material)


def _cached_answer(key: str | None, cache_dir: str | None = None) -> PlanResult | None:
    payload = disk_cache.load("answer", key, cache_dir) if key is not None else None
    if payload is None:
        return None
    try:
        plan = Plan.from_json(payload["plan"])
        found = tuple(_baseline_of(b) for b in payload["baselines"])
    except (KeyError, TypeError, ValueError):
        return None  # an entry this code does not read: planned again
    return PlanResult(plan, found, None)


def _store_answer(key: str, result: PlanResult) -> None:
    baselines = [_baseline_payload(b) for b in result.baselines]
    payload = {"plan": result.plan.to_json(indent=None), "baselines": baselines}
    disk_cache.store("answer", key, payload)


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
    best = unrestricted.mesh.summary()
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
