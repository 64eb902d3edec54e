"""Queueing a planning job (a plan or a sizing sweep): the checks made before it is stored
(model, cluster, the work it would take), the request cache, and the row that is the queue."""

from __future__ import annotations

import hashlib
import json
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

CACHEABLE = ("queued", "running", "done", "infeasible")
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
    model = resolve(
        ModelSpec(name=body.model.name, config=body.model.config, hf_config=body.model.hf_config)
    )
    seq = body.training.seq_len or getattr(model.config, "seq_len", 0) or 0
    return getattr(model.config, "layers", 1), True, model.family.name, seq


def check_work(body: PlanCreate | SizingCreate, profile: ClusterProfile, model: tuple, limit):
    """Refuse what the per-job time limit would cut, naming what is too big. `model`:
    check_model's (layers, traced, family, sequence length)."""
    from planner.search.work import planning_work

    layers, traced, family, seq = model
    pinned = body.search.mesh is not None
    batch = body.training.global_batch_size
    work = planning_work(profile, layers, batch, traced, family, seq)
    # A pinned mesh leaves only its micro-batch sizes (at most 32) to search.
    share = min(1.0, 32 / max(work.combinations, 1)) if pinned else 1.0
    seconds = work.trace_s + work.search_s * share
    if seconds <= limit:
        return
    field = "model.config.layers" if work.trace_s >= work.search_s * share else "cluster"
    raise InputError(
        field,
        f"planning this request would take {work.describe()}, past this service's "
        f"per-job limit of {limit:g} s",
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
    for nodes in sizes or [None]:
        sized = profile if nodes is None else profile.with_nodes(nodes, field="sizing.max_nodes")
        check_work(body, sized, model, settings.job_time_limit_s / len(sizes or [None]))
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
        raise InputError(
            "Idempotency-Key",
            "was sent before with a different request",
            "a new key for a new request",
        ) from None
    if not new:
        metrics.cache_hits.inc()
        response.status_code = 200
        return view(job, True)
    response.headers["Location"] = f"/v1/{kind}s/{job_id}"
    return view(job, False)
