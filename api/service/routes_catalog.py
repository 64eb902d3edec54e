"""/v1/models and /v1/clusters: the zoo, the bundled profiles, and stored custom profiles."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Annotated

from fastapi import APIRouter, Body, Depends, HTTPException
from sqlalchemy import select

from api.service.deps import StoreDep
from api.service.errors import ERRORS, MUTATING_ERRORS
from api.service.schemas import ClusterInfo, ConfigField, ModelDetail, ModelInfo, ProfileInput
from api.service.security import require_token
from api.service.store import ClusterRow, Store
from api.service.validation import check_values
from planner.cluster.profile import ClusterProfile, bundled_names, load_cluster
from planner.models.registry import FAMILIES, ZOO, list_models

router = APIRouter(prefix="/v1", tags=["catalog"])


@router.get("/models", response_model=list[ModelInfo], summary="List the model zoo")
def models() -> list[dict]:
    return list_models()


@router.get(
    "/models/{name}",
    response_model=ModelDetail,
    responses=ERRORS,
    summary="One zoo model: config, overridable keys, parameter count",
)
def model(name: str) -> dict:
    if name not in ZOO:
        raise HTTPException(404, f"unknown model {name!r}; GET /v1/models lists the zoo")
    family = FAMILIES[ZOO[name]]
    cfg = family.zoo[name]
    values = dataclasses.asdict(cfg)
    schema = {
        f.name: ConfigField(type=getattr(f.type, "__name__", str(f.type)), default=values[f.name])
        for f in dataclasses.fields(cfg)
    }
    return {
        "name": name,
        "family": family.name,
        "params": family.param_count(cfg),
        "config": dataclasses.asdict(cfg),
        "config_schema": schema,
    }


def _info(profile: ClusterProfile, source: str) -> dict:
    return {
        "name": profile.name,
        "source": source,
        "device": profile.device.name,
        "nodes": profile.nodes,
        "devices_per_node": profile.devices_per_node,
        "memory_bytes": profile.device.memory_bytes,
    }


def stored_profile(text: str) -> ClusterProfile:
    """A stored custom profile. Stores written before profiles carried their operator times
    inline may hold a `measured.op_db` path: it is dropped, never opened."""
    doc = json.loads(text)
    if isinstance(doc.get("measured"), dict):
        doc["measured"].pop("op_db", None)
    return ClusterProfile.model_validate(doc)


def find_cluster(store: Store, name: str) -> ClusterProfile | None:
    """A bundled profile, else a stored custom one."""
    if name in bundled_names():
        return load_cluster(name)
    with store.session() as s:
        row = s.get(ClusterRow, name)
        return stored_profile(row.profile_json) if row else None


@router.get("/clusters", response_model=list[ClusterInfo], summary="Bundled and custom profiles")
def clusters(store: StoreDep) -> list[dict]:
    out = [_info(load_cluster(n), "bundled") for n in bundled_names()]
    with store.session() as s:
        for row in s.scalars(select(ClusterRow).order_by(ClusterRow.name)):
            out.append(_info(stored_profile(row.profile_json), "custom"))
    return out


@router.get(
    "/clusters/{name}", response_model=ClusterProfile, responses=ERRORS, summary="One profile"
)
def cluster(name: str, store: StoreDep) -> ClusterProfile:
    profile = find_cluster(store, name)
    if profile is None:
        raise HTTPException(404, f"unknown cluster {name!r}; GET /v1/clusters lists them")
    return profile


def _example_profile() -> dict:
    """A bundled profile as JSON (its YAML writes numbers like 312.0e12, which YAML 1.1 reads
    as strings; the API takes numbers)."""
    profile = load_cluster("dgx-a100-80g").model_dump(mode="json", exclude_defaults=True)
    profile.update(name="my-a100-cluster", nodes=4, description="4 DGX A100 nodes (example)")
    return profile


@router.post(
    "/clusters",
    response_model=ClusterInfo,
    status_code=201,
    responses=MUTATING_ERRORS,
    dependencies=[Depends(require_token)],
    summary="Store a custom cluster profile (validated)",
)
def create_cluster(
    store: StoreDep,
    body: Annotated[
        ProfileInput,
        Body(
            openapi_examples={"a100x4": {"summary": "4 DGX A100", "value": _example_profile()}},
            description="a cluster profile, same schema as GET /v1/clusters/{name}",
        ),
    ],
) -> dict:
    profile = body
    check_values(profile.model_dump(mode="python"))
    if profile.name in bundled_names():
        raise HTTPException(409, f"body.name: {profile.name!r} is a bundled profile; pick another")
    with store.session() as s:
        row = s.get(ClusterRow, profile.name)
        text = json.dumps(profile.model_dump(mode="json"))
        if row is None:
            s.add(ClusterRow(name=profile.name, profile_json=text, created_at=time.time()))
        else:
            row.profile_json = text
    return _info(profile, "custom")
