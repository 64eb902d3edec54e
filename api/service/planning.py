"""One planning job, run in its own process: trace (or read the graph), search, baselines.

The request was validated and its cluster resolved to a full profile by the API before it was
queued; the job writes its progress and result to the store itself, so the service only
starts, watches and (on cancel or time limit) stops the process.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from api.compare import baseline_entries
from api.service.recent import Recent
from api.service.store import Lost, Store, dumps
from executor.lifetime import die_with_parent, exit_when_gone, limit_memory
from planner.errors import AutoparError

PLANNING_NICENESS = 10


def plan_job(
    database_url: str,
    plan_id: str,
    token: str,
    parent_pid: int,
    memory_bytes: int,
    cache_dir: str | None = None,
) -> None:
    """Process entry point: plan `plan_id` (claimed with lease `token`) and store the outcome.

    The process dies with the replica that started it, stays within `memory_bytes` of
    address space, and writes only while its lease holds (Store.write_plan). Its parent is
    the replica's fork server (jobs.py), which exits when the replica does."""
    die_with_parent()
    # The death signal comes with the fork server's end; the replica's own is watched too.
    exit_when_gone(parent_pid)
    # Background work: below the server's requests for the CPU (on 2 cores two planning
    # processes otherwise took /healthz past half a second, bench/results/hostile_load.md).
    os.nice(PLANNING_NICENESS)
    limit_memory(memory_bytes)
    if cache_dir is not None:  # the replica's setting; this process's own environment
        os.environ["AUTOPAR_CACHE_DIR"] = cache_dir
    store = Store(database_url)
    try:
        _plan(store, plan_id, token)
    except Lost:
        pass  # cancelled, deleted or taken over: someone else owns the outcome now
    finally:
        store.close()


def _plan(store: Store, plan_id: str, token: str) -> None:
    from planner.search.search import NoFeasiblePlan

    def finish(**values: Any) -> None:
        store.write_plan(plan_id, token, finished_at=time.time(), **values)

    try:
        row = store.get_plan(plan_id)
        if row is None:
            return
        stored = json.loads(row.request_json)
        store.write_plan(plan_id, token, progress_step="tracing")
        last = [0.0]
        began: dict[str, float] = {}

        def progress(step: str, done: int, total: int) -> None:
            now = time.monotonic()
            start = began.setdefault(step, now)
            if now - last[0] > 0.5 or done >= total:
                last[0] = now
                text = step
                if 0 < done < total and now - start > 1.0:  # an ETA once the rate is known
                    text += f" (about {(now - start) / done * (total - done):.0f} s left)"
                store.write_plan(
                    plan_id,
                    token,
                    progress_step=text[:200],
                    progress_done=done,
                    progress_total=total,
                )

        try:
            plan_json, baselines = plan_stored(stored["request"], stored["profile"], progress)
        except NoFeasiblePlan as err:
            finish(status="infeasible", explanation_json=dumps(err.explanation))
            return
        finish(status="done", plan_json=plan_json, baselines_json=dumps(baselines))
    except (Lost, KeyboardInterrupt):
        raise
    except AutoparError as err:
        finish(status="failed", error=str(err))
    except MemoryError:
        finish(
            status="failed",
            error="planning needed more memory than this service allows a job "
            "(AUTOPAR_WORKER_MEMORY_BYTES); plan a smaller model or cluster",
        )
    except Exception as err:  # a bug, not the user's input: log it, keep the message short
        traceback.print_exc(file=sys.stderr)
        finish(
            status="failed",
            error=f"internal error while planning: {type(err).__name__}: {err}"[:2000],
        )


# The disk cache's answers this process read last, kept parsed: reading and checking a plan
# again was most of pricing one for another run. An entry never changes (its key names the
# code that made it).
PARSED_ANSWERS: Recent = Recent(32)


def answer_stored(
    request: dict[str, Any], profile: dict[str, Any], cache_dir: str | None = None
) -> tuple[str, list] | None:
    """plan_stored's (plan JSON, baseline entries) when the planner's disk cache holds this
    request's answer (only the run to price may differ), without tracing or searching: the
    service answers such a request in its own process instead of queueing a job. None
    otherwise, also for a sizing or an export target (both search anew)."""
    from planner.planning import answer_from_cache

    if request.get("sizing") or request.get("search", {}).get("export_to"):
        return None
    planning, options, run = _resolved(request, profile)
    found = answer_from_cache(
        planning,
        options,
        run=run,
        baselines=request.get("search", {}).get("baselines", True),
        cache_dir=cache_dir,
        parsed=PARSED_ANSWERS,
    )
    if found is None:
        return None
    return found.plan.to_json(indent=None), baseline_entries(found.baselines)


def _resolved(request: dict[str, Any], profile: dict[str, Any]):
    """A validated plan request's (PlanningRequest, SearchOptions, RunAsked or None)."""
    from api.export.targets import target_training
    from planner.cluster.profile import parse_profile
    from planner.request import resolve_request, search_options
    from planner.search.sizing import read_run

    cluster = parse_profile(profile, field="cluster.profile")
    export_to = request.get("search", {}).get("export_to")
    training = target_training(export_to, request["training"], "search.export_to")
    planning = resolve_request(request["model"], cluster, training)
    options = search_options(request.get("search", {}))
    run = request.get("run") or {}
    asked = read_run(
        run.get("train_tokens"), run.get("gpu_hour_price"), "run", goodput=run.get("goodput")
    )
    return planning, options, asked


def plan_stored(request: dict[str, Any], profile: dict[str, Any], progress) -> tuple[str, list]:
    """(plan JSON, baseline entries) for a validated request, or (sizing JSON, []) for a
    sizing's, through the planning pipeline the CLI and autopar.plan use (planner.planning);
    raises NoFeasiblePlan."""
    from api.export.targets import TARGETS
    from planner.errors import InputError
    from planner.planning import plan_request, size_request
    from planner.search.sizing import node_counts, parse_duration, read_run

    export_to = request.get("search", {}).get("export_to")
    if export_to and request.get("sizing"):
        raise InputError("search.export_to", "a sizing plans for one runtime", "unset, or a plan")
    planning, options, run = _resolved(request, profile)
    if fields := request.get("sizing"):
        deadline = fields.get("deadline")
        sizing = size_request(
            planning,
            options,
            node_counts(fields["min_nodes"], fields["max_nodes"], "sizing.max_nodes"),
            read_run(
                fields["train_tokens"],
                fields.get("gpu_hour_price"),
                "sizing",
                goodput=fields.get("goodput"),
            ),
            deadline_s=None if deadline is None else parse_duration(deadline, "sizing.deadline"),
            budget=fields.get("budget"),
            progress=progress,
        )
        return sizing.model_dump_json(), []
    result = plan_request(
        planning,
        options,
        run=run,
        baselines=request.get("search", {}).get("baselines", True),
        progress=progress,
        target=TARGETS[export_to] if export_to else None,
    )
    return result.plan.to_json(indent=None), baseline_entries(result.baselines)
