"""GET/POST /v1/models and /v1/clusters, /healthz, /metrics."""

from __future__ import annotations

from planner.cluster.profile import load_cluster
from planner.models.registry import ZOO


def test_models_list_and_detail(client):
    rows = client.get("/v1/models").json()
    assert {r["name"] for r in rows} == set(ZOO)
    detail = client.get("/v1/models/gpt-1.3b").json()
    assert detail["family"] == "gpt"
    assert 1.2e9 < detail["params"] < 1.4e9
    assert detail["config_schema"]["layers"]["type"] == "int"
    assert detail["config_schema"]["layers"]["default"] == detail["config"]["layers"]
    missing = client.get("/v1/models/gpt-9t")
    assert missing.status_code == 404
    assert "gpt-9t" in missing.json()["detail"]


def test_clusters_bundled_and_custom(client):
    names = {c["name"]: c for c in client.get("/v1/clusters").json()}
    assert names["dgx-a100-80g"]["source"] == "bundled"
    profile = client.get("/v1/clusters/dgx-a100-80g").json()
    assert profile == load_cluster("dgx-a100-80g").model_dump(mode="json")
    assert client.get("/v1/clusters/nope").status_code == 404

    custom = {**profile, "name": "lab-a100", "nodes": 3}
    created = client.post("/v1/clusters", json=custom)
    assert created.status_code == 201, created.text
    assert created.json()["source"] == "custom"
    assert client.get("/v1/clusters/lab-a100").json()["nodes"] == 3
    assert "lab-a100" in {c["name"] for c in client.get("/v1/clusters").json()}


def test_cluster_validation_names_the_field(client):
    profile = load_cluster("cpu-local").model_dump(mode="json")
    bad = {**profile, "name": "x", "devices_per_node": 0}
    r = client.post("/v1/clusters", json=bad)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"][-1] == "devices_per_node"
    clash = client.post("/v1/clusters", json={**profile, "name": "dgx-h100"})
    assert clash.status_code == 409
    odd = client.post("/v1/clusters", json={**profile, "name": "../etc"})
    assert odd.status_code == 422
    assert odd.json()["detail"][0]["loc"] == ["body", "name"]


def _bundled(name: str) -> str:
    from importlib import resources

    return str(resources.files("cluster_profiles") / f"{name}.yaml")


def test_health_and_metrics(client):
    health = client.get("/healthz").json()
    assert health["status"] == "ok"
    client.get("/v1/models/gpt-9t")
    text = client.get("/metrics").text
    assert (
        'autopar_http_requests_total{method="GET",route="/v1/models/{name}",status="404"} 1.0'
        in text
    )
    assert "autopar_plan_jobs_queued" in text
    assert "autopar_http_request_duration_seconds_bucket" in text
