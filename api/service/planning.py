"""One planning job, run in its own process: trace (or read the graph), search, baselines.

The request was validated and its cluster resolved to a full profile by the API before it was
queued; the job writes its progress and result to the store itself, so the service only
starts, watches and (on cancel or time limit) stops the process.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

from api.compare import baseline_entries
from api.service.store import Lost, Store, dumps
from executor.lifetime import die_with_parent, limit_memory
from planner.errors import AutoparError


def prepare(request: dict[str, Any], profile: dict[str, Any]):
    """(graph, second trace or None, cluster, training, model ref, tokens per sample)."""
    from pydantic import ValidationError

    from planner.cluster import parse_profile
    from planner.errors import input_error_from
    from planner.estimate import _hash, model_ref
    from planner.graph import OpGraph
    from planner.models import ModelSpec, resolve
    from planner.plan import ModelRef, TrainingSettings
    from planner.tracing import trace_model

    cluster = parse_profile(profile, field="cluster.profile")
    model, train = request["model"], request["training"]

    def settings(seq: int) -> TrainingSettings:
        try:
            return TrainingSettings(**{**train, "seq_len": seq})
        except ValidationError as err:
            raise input_error_from(err, prefix="training") from None

    if model.get("graph") is not None:
        text = json.dumps(model["graph"])
        graph = OpGraph.from_json(text, field="model.graph")
        ref = ModelRef(
            name=graph.data.model or "graph",
            family="graph",
            config={},
            params=graph.param_count,
            content_hash=_hash(text),
        )
        seq = train.get("seq_len") or graph.data.seq
        return graph, None, cluster, settings(seq), ref, seq
    spec = ModelSpec(name=model.get("name"), config=model.get("config") or {})
    if model.get("hf_config"):
        spec = ModelSpec(name=model.get("name"), config=spec.config, hf_config=model["hf_config"])
    resolved = resolve(spec)
    seq = train.get("seq_len") or resolved.default_seq
    training = settings(seq)
    graph = trace_model(resolved, 1, seq, training.dtype)
    second = trace_model(resolved, 2, seq, training.dtype)
    tokens = seq if resolved.family.tokens_per_sample else 1
    return graph, second, cluster, training, model_ref(resolved, seq), tokens


def plan_job(
    database_url: str, plan_id: str, token: str, parent_pid: int, memory_bytes: int
) -> None:
    """Process entry point: plan `plan_id` (claimed with lease `token`) and store the outcome.

    The process dies with the replica that started it, stays within `memory_bytes` of
    address space, and writes only while its lease holds (Store.write_plan)."""
    die_with_parent(parent_pid)
    limit_memory(memory_bytes)
    store = Store(database_url)
    try:
        _plan(store, plan_id, token)
    except Lost:
        pass  # cancelled, deleted or taken over: someone else owns the outcome now
    finally:
        store.close()


def _plan(store: Store, plan_id: str, token: str) -> None:
    from planner.search import NoFeasiblePlan

    def finish(**values: Any) -> None:
        store.write_plan(plan_id, token, finished_at=time.time(), **values)

    try:
        row = store.get_plan(plan_id)
        if row is None:
            return
        stored = json.loads(row.request_json)
        store.write_plan(plan_id, token, progress_step="tracing")
        last = [0.0]

        def progress(step: str, done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] > 0.5 or done >= total:
                last[0] = now
                store.write_plan(
                    plan_id,
                    token,
                    progress_step=step[:200],
                    progress_done=done,
                    progress_total=total,
                )

        try:
            plan_json, baselines = _search(stored["request"], stored["profile"], progress)
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


def _search(request: dict[str, Any], profile: dict[str, Any], progress) -> tuple[str, list]:
    """(plan JSON, baseline entries) for a validated request; raises NoFeasiblePlan."""
    from planner.search import SearchOptions, pinned_options, search

    options = request.get("search", {})
    graph, second, cluster, training, model, tokens = prepare(request, profile)
    result = search(
        graph,
        cluster,
        training,
        model,
        tokens_per_sample=tokens,
        options=SearchOptions(
            executable_only=options.get("executable_only", False),
            top_k=options.get("top_k", 5),
            **pinned_options(
                options.get("mesh"),
                options.get("schedule"),
                options.get("zero"),
                options.get("checkpointing"),
                options.get("microbatch_size"),
            ),
        ),
        progress=progress,
        second_trace=second,
    )
    baselines = []
    if options.get("baselines", True):
        progress("baselines", 0, 1)
        baselines = baseline_entries(graph, second, cluster, training, model, tokens)
    progress("done", 1, 1)
    return result.plan.to_json(indent=None), baselines
