"""Queueing a planning job (a plan or a sizing sweep): the checks made before it is stored
(model, cluster, the work it would take), the request cache, and the row that is the queue."""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Header, HTTPException, Response

from api.service.deps import JobQueue
from api.service.routes_catalog import find_cluster
from api.service.schemas import PlanCreate, SizingCreate
from api.service.store import KeyReused, PlanRow, QueueFull, Store, dumps
from planner.cluster.headroom import with_headroom
from planner.cluster.profile import ClusterProfile
from planner.errors import InputError

LOG = logging.getLogger("autopar.service")
CACHEABLE = ("queued", "running", "done", "infeasible")
IDEMPOTENCY_CONFLICT = (
    "Idempotency-Key: this key was sent before with a different request; use a new key for a "
    "new request"
)
# The Idempotency-Key request header (the IETF httpapi draft's convention): a client that
# retries a POST with the same key gets the job its first try made, never a second one.
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=200,
        pattern=r"^[\x21-\x7e]+$",
        description="a retry with the same key returns the job the first request made",
    ),
]


def check_model(body: PlanCreate | SizingCreate, settings, validator) -> tuple[int, bool, str]:
    """Reject a bad model before it is queued (the job would fail the same way later);
    (layers the search will see, whether the job traces the model, its family, the sequence
    length it trains at)."""
    from planner.models import ModelSpec, resolve
    from planner.models.config import check_json_types
    from planner.models.registry import FAMILIES, ZOO

    graph = body.model.graph
    if graph is not None:
        nodes = graph.get("nodes")
        limit = settings.max_graph_nodes
        if isinstance(nodes, list) and len(nodes) > limit:
            raise InputError(
                "model.graph.nodes",
                f"{len(nodes)} nodes exceed this service's limit",
                f"at most {limit} nodes",
            )
        seq = body.training.seq_len or 0  # a graph's family never takes cp
        return validator.summary(json.dumps(graph))["layers"], False, "graph", seq
    if body.model.hf_config is None and body.model.name in ZOO:
        # JSON overrides are typed (the CLI's key=value strings are parsed instead).
        zoo_config = FAMILIES[ZOO[body.model.name]].zoo[body.model.name]
        check_json_types(zoo_config, body.model.config, "model.config")
    model = resolve(
        ModelSpec(name=body.model.name, config=body.model.config, hf_config=body.model.hf_config)
    )
    seq = body.training.seq_len or getattr(model.config, "seq_len", 0) or 0
    return getattr(model.config, "layers", 1), True, model.family.name, seq


def check_work(
    body: PlanCreate | SizingCreate,
    profiles: list[ClusterProfile],
    model: tuple,
    limit: float,
) -> None:
    """Refuse what the per-job time limit would cut, naming what is too big: the model
    traced once, then searched on each of `profiles` (one, or a sizing's sweep). `model`:
    check_model's (layers, traced, family, sequence length)."""
    from planner.search.batch import BatchRange, parse_global_batch
    from planner.search.work import planning_work

    layers, traced, family, seq = model
    pinned = body.search.mesh is not None
    devices = profiles[0].num_devices
    batch = parse_global_batch(body.training.global_batch_size, devices)
    # a range: one search per batch tried, each at most the largest's work
    tries = len(batch.candidates()) if isinstance(batch, BatchRange) else 1
    batch = batch.high if isinstance(batch, BatchRange) else batch
    works = [planning_work(p, layers, batch, traced, family, seq) for p in profiles]
    # A pinned mesh leaves only its micro-batch sizes (at most 32) to search.
    searches = [
        tries * w.search_s * (min(1.0, 32 / max(w.combinations, 1)) if pinned else 1.0)
        for w in works
    ]
    trace_s = works[0].trace_s
    if trace_s + sum(searches) <= limit:
        return
    field = "model.config.layers" if trace_s >= sum(searches) else "cluster"
    what = (
        works[-1].describe()
        if len(works) == 1
        else (
            f"about {trace_s + sum(searches):,.0f} s: {layers:,} layers traced twice and "
            f"searched on {len(works)} cluster sizes"
        )
    )
    raise InputError(
        field,
        f"planning this request would take {what}, past this service's per-job limit of "
        f"{limit:g} s",
        "fewer layers or devices, or a pinned search.mesh",
    )


def resolve_cluster(body: PlanCreate | SizingCreate, store: Store) -> ClusterProfile:
    if body.cluster.profile is not None:
        profile = body.cluster.profile
    else:
        found = find_cluster(store, body.cluster.name or "")
        if found is None:
            raise InputError(
                "cluster.name",
                f"unknown cluster {body.cluster.name!r}",
                "a bundled or stored profile (GET /v1/clusters)",
            )
        profile = found
    return with_headroom(profile.with_nodes(body.cluster.nodes), body.cluster.memory_headroom)


def submit(
    body: PlanCreate | SizingCreate,
    kind: str,
    response: Response,
    queue: JobQueue,
    view: Callable[[PlanRow, bool], dict[str, Any]],
    sizes: list[int] | None = None,
    idempotency_key: str | None = None,
) -> dict[str, Any]:
    """Queue `body` as a job of `kind` ("plan" or "sizing"; a sizing plans on each of
    `sizes` node counts), or answer from the store: the job an earlier request with the
    same `idempotency_key` made, else an identical earlier request's job."""
    validator, store, settings, metrics = (
        queue.validator,
        queue.store,
        queue.settings,
        queue.metrics,
    )
    model = check_model(body, settings, validator)
    profile = resolve_cluster(body, store)
    sized = [profile.with_nodes(n, field="sizing.max_nodes") for n in sizes or []]
    check_work(body, sized or [profile], model, settings.job_time_limit_s)
    request_doc = body.model_dump(mode="json")
    profile_doc = profile.model_dump(mode="json")
    key = {"k": kind, "r": request_doc, "p": profile_doc}
    digest = hashlib.sha256(dumps(key).encode()).hexdigest()
    job_id = uuid.uuid4().hex[:16]
    model_name = body.model.name or (body.model.graph or {}).get("model") or "graph"
    row = PlanRow(
        id=job_id,
        kind=kind,
        request_hash=digest,
        status="queued",
        model_name=str(model_name)[:200],
        cluster_name=profile.name[:200],
        request_json=json.dumps({"request": request_doc, "profile": profile_doc}),  # order kept
        created_at=time.time(),
        progress_done=0,
        progress_total=0,
        idempotency_key=idempotency_key,
    )
    if kind == "plan" and model[1]:  # a graph is parsed only in a job, within its limits
        _answer_now(row, request_doc, profile_doc, store, metrics, settings.cache_dir)
    try:
        # The store is the queue: a replica's supervisor claims the row.
        job, new = store.enqueue(row, settings.max_queued_jobs, CACHEABLE)
    except QueueFull:
        raise HTTPException(
            429,
            "the planning queue is full; retry later",
            headers={"Retry-After": str(settings.retry_after_s)},
        ) from None
    except KeyReused:
        raise HTTPException(409, IDEMPOTENCY_CONFLICT) from None
    if not new:
        metrics.cache_hits.inc()
        response.status_code = 200
        return view(job, True)
    response.headers["Location"] = f"/v1/{kind}s/{job_id}"
    if job.status == "done":  # answered here (_answer_now): created, nothing queued
        response.status_code = 201
    return view(job, False)


def _answer_now(
    row: PlanRow, request: dict, profile: dict, store: Store, metrics, cache_dir: str | None
) -> None:
    """Finish `row` in this process when no stored job answers its request (checked first:
    the newest identical job wins) but the planner's disk cache holds the search's answer:
    a request that differs from an earlier one only in the run to price, or one planned by
    another replica or the CLI on this machine. Pricing a cached answer takes milliseconds;
    a job's process start, imports and queueing were most of such a request's wait
    (bench/results/service.md)."""
    from api.service.planning import answer_stored

    if store.find_plan(row.request_hash, CACHEABLE) is not None:
        return
    try:
        answer = answer_stored(request, profile, cache_dir)
    except Exception:  # a job plans it and reports what went wrong, as for any request
        LOG.warning("answering from the cache failed; queued as a job", exc_info=True)
        return
    if answer is None:
        return
    row.plan_json, baselines = answer
    row.baselines_json = dumps(baselines)
    row.status = "done"
    row.progress_step = "done (the search's answer was cached)"
    row.started_at = row.finished_at = time.time()
    metrics.answers_cached.inc()
