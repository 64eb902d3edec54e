"""POST/GET/DELETE /v1/plans: jobs run in real planning processes; statuses, cache, limits."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from api.service.app import create_app
from api.service.schemas import PlanJob
from planner.cluster.profile import load_cluster
from planner.graph.tracing import trace_model
from planner.models import ModelSpec, resolve
from tests.service.conftest import TINY_GPT, make_settings, plan_body, wait_for


def test_plan_round_trip_statuses_cache_list_view_delete(client):
    r = client.post("/v1/plans", json=plan_body(search={"executable_only": True}))
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] == "queued" and r.headers["location"] == f"/v1/plans/{job['id']}"
    seen = [job["status"]]
    deadline = time.monotonic() + 120
    while seen[-1] in ("queued", "running") and time.monotonic() < deadline:
        status = client.get(f"/v1/plans/{job['id']}").json()["status"]
        if status != seen[-1]:
            seen.append(status)
        time.sleep(0.05)
    assert seen[-1] == "done", seen
    assert [s for s in ("queued", "running", "done") if s in seen] == seen  # never backwards
    done = client.get(f"/v1/plans/{job['id']}").json()
    # the stored plan goes out unparsed: the document is PlanJob's, nothing lost or added
    assert PlanJob.model_validate(done).model_dump(mode="json") == done
    plan = done["plan"]
    assert plan["request"]["model"]["name"] == "gpt-350m"
    pp, dp, tp = plan["mesh"]["shape"]
    assert pp * dp * tp == 4 and plan["executable"]
    assert done["step_time_s"] == plan["predicted"]["step_time_s"] > 0
    assert done["started_at"] <= done["finished_at"]
    assert {b["kind"] for b in done["baselines"]} == {"megatron", "fsdp_tp", "dp", "fsdp"}
    # The same request again is answered from the store at once.
    again = client.post("/v1/plans", json=plan_body(search={"executable_only": True}))
    assert again.status_code == 200 and again.json()["cached"] and again.json()["id"] == job["id"]
    # List with filters and paging.
    listing = client.get("/v1/plans", params={"status": "done", "model": "gpt-350m"}).json()
    assert listing["total"] == 1 and listing["items"][0]["id"] == job["id"]
    assert client.get("/v1/plans", params={"cluster": "dgx-h100"}).json()["total"] == 0
    assert client.get("/v1/plans", params={"limit": 0}).status_code == 422
    # The viewer.
    page = client.get(f"/v1/plans/{job['id']}/view")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for part in ("Devices by stage", "<svg", "Memory per device", "Compared with baselines"):
        assert part in page.text
    # Metrics (the runner records a job once its process has exited).
    deadline = time.monotonic() + 10
    while 'autopar_plan_jobs_total{status="done"} 1.0' not in client.get("/metrics").text:
        assert time.monotonic() < deadline, client.get("/metrics").text
        time.sleep(0.1)
    assert "autopar_plan_cache_hits_total 1.0" in client.get("/metrics").text
    # Delete.
    assert client.delete(f"/v1/plans/{job['id']}").status_code == 204
    assert client.get(f"/v1/plans/{job['id']}").status_code == 404
    assert client.delete(f"/v1/plans/{job['id']}").status_code == 404


def test_infeasible_plan_explains_with_inline_profile(client):
    profile = load_cluster("cpu-local").model_dump(mode="json")
    profile["device"]["memory_bytes"] = 1024 * 1024  # 1 MiB per device: nothing fits
    body = plan_body(cluster={"profile": profile})
    job = client.post("/v1/plans", json=body).json()
    done = wait_for(client, f"/v1/plans/{job['id']}", ("done", "infeasible", "failed"))
    assert done["status"] == "infeasible", done
    assert done["explanation"] and done["plan"] is None
    page = client.get(f"/v1/plans/{job['id']}/view").text
    assert "infeasible" in page


def test_plan_from_a_traced_graph(client):
    resolved = resolve(ModelSpec(**TINY_GPT))
    graph = trace_model(resolved, 2, 64, "fp32").to_json()
    import json

    body = plan_body(model={"graph": json.loads(graph)})
    job = client.post("/v1/plans", json=body).json()
    done = wait_for(client, f"/v1/plans/{job['id']}", ("done", "infeasible", "failed"))
    assert done["status"] == "done", done
    model = done["plan"]["request"]["model"]
    assert model["family"] == "graph" and model["config"] == {"vocab": TINY_GPT["config"]["vocab"]}
    # Executable in graph mode once the user's machine supplies the factory
    # (`autopar execute --model`); the service itself never imports one.
    assert done["plan"]["executable"] and done["plan"]["not_executable_reason"] is None
    # Another run to price: still a job (the service process never parses a graph).
    priced = client.post("/v1/plans", json={**body, "run": {"train_tokens": 1e9}})
    assert priced.status_code == 202 and priced.json()["status"] == "queued", priced.text


@pytest.mark.parametrize(
    ("model", "loc"),
    [
        ({"name": "gpt-9t"}, ["model", "name"]),
        ({"name": "gpt-350m", "config": {"layers": -2}}, ["model", "config", "layers"]),
        ({"name": "gpt-350m", "graph": {}}, ["body", "model"]),
        ({"graph": {"nodes": "x"}}, ["model", "graph"]),
    ],
)
def test_bad_model_is_422_naming_the_field(idle_client, model, loc):
    r = idle_client.post("/v1/plans", json=plan_body(model=model))
    assert r.status_code == 422, r.text
    got = r.json()["detail"][0]["loc"]
    assert got[: len(loc)] == loc, got


def test_contradicting_search_pins_are_422_naming_the_field(idle_client):
    pins = {"schedule": "1f1b", "virtual_stages": 3}
    r = idle_client.post("/v1/plans", json=plan_body(search=pins))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["search", "virtual_stages"]
    r = idle_client.post("/v1/plans", json=plan_body(search={"virtual_stages": 0}))
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "search", "virtual_stages"]
    pins = {"tp_layout": "per_node", "sequence_parallel": True}
    r = idle_client.post("/v1/plans", json=plan_body(search=pins))
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["search", "sequence_parallel"]


def test_bad_cluster_and_training_are_422(idle_client):
    r = idle_client.post("/v1/plans", json=plan_body(cluster={"name": "nope"}))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["cluster", "name"]
    headroom = {"name": "cpu-local", "memory_headroom": "4GB"}
    r = idle_client.post("/v1/plans", json=plan_body(cluster=headroom))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["cluster", "memory_headroom"]
    assert "4GiB" in r.json()["detail"][0]["msg"]  # says what is expected
    r = idle_client.post("/v1/plans", json=plan_body(training={"global_batch_size": 0}))
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "training", "global_batch_size"]


def test_limits_413_422_429(tmp_path):
    settings = make_settings(tmp_path, max_body_bytes=20_000, max_graph_nodes=3, max_queued_jobs=1)
    with TestClient(create_app(settings, start_workers=False)) as c:
        huge = plan_body(model={"graph": {"nodes": ["x" * 100] * 400}})
        assert c.post("/v1/plans", json=huge).status_code == 413
        many = plan_body(model={"graph": {"nodes": [{}] * 5}})
        r = c.post("/v1/plans", json=many)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["model", "graph", "nodes"]
        assert c.post("/v1/plans", json=plan_body()).status_code == 202
        full = c.post("/v1/plans", json=plan_body(training={"global_batch_size": 16}))
        assert full.status_code == 429 and int(full.headers["retry-after"]) > 0
        assert c.get("/v1/plans").json()["total"] == 1  # the refused job was not stored


def test_job_time_limit_fails_the_job(tmp_path):
    # A traced graph without repeated blocks (every node in one layer): the work estimate
    # counts clustered layers (about 1 s here) while the ILP prices ~600 distinct nodes per
    # (micro-batch, tp), several seconds, so the 1 s limit cuts the job.
    import json

    config = {"layers": 96, "hidden": 256, "heads": 4, "vocab": 512}
    traced = trace_model(resolve(ModelSpec(name="gpt-350m", config=config)), 2, 64, "fp32")
    graph = json.loads(traced.to_json())
    for node in graph["nodes"]:
        node["layer"] = 0
    settings = make_settings(tmp_path, job_time_limit_s=1)
    training = {"global_batch_size": 2, "seq_len": 64, "dtype": "fp32"}
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/plans", json=plan_body(model={"graph": graph}, training=training))
        assert r.status_code == 202, r.text
        done = wait_for(c, f"/v1/plans/{r.json()['id']}", ("done", "failed", "infeasible"))
        assert done["status"] == "failed" and "time limit" in done["error"], done


def test_delete_cancels_a_running_job(client):
    job = client.post("/v1/plans", json=plan_body()).json()
    wait_for(client, f"/v1/plans/{job['id']}", ("running", "done"))
    assert client.delete(f"/v1/plans/{job['id']}").status_code == 204
    assert client.get(f"/v1/plans/{job['id']}").status_code == 404
    deadline = time.monotonic() + 10
    while client.get("/healthz").json()["queued_or_running_plans"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.get("/healthz").json()["queued_or_running_plans"] == 0


def test_search_pins_are_honoured_and_a_bad_mesh_fails_with_its_field(client):
    pins = {"mesh": [1, 2, 2], "zero": 3, "checkpointing": True, "schedule": "1f1b"}
    cluster = {"name": "cpu-local", "memory_headroom": "25%"}
    body = plan_body(search={"baselines": False, **pins}, cluster=cluster)
    r = client.post("/v1/plans", json=body)
    assert r.status_code == 202, r.text
    done = wait_for(client, f"/v1/plans/{r.json()['id']}", ("done", "failed", "infeasible"))
    assert done["status"] == "done", done
    plan = done["plan"]
    kept = plan["request"]["cluster"]["memory_headroom_bytes"]
    assert kept == int(plan["request"]["cluster"]["device_memory_bytes"] * 0.25)
    assert plan["mesh"]["shape"] == [1, 2, 2] and plan["schedule"]["name"] == "1f1b"
    assert all(st["zero"] == 3 and st["activation_checkpointing"] for st in plan["stages"])
    bad = client.post("/v1/plans", json=plan_body(search={"mesh": [3, 1, 1]}))
    failed = wait_for(client, f"/v1/plans/{bad.json()['id']}", ("done", "failed", "infeasible"))
    assert failed["status"] == "failed" and failed["error"].startswith("search.mesh: 3x1x1 is not")
    # fp8 pinned on an A100 (no fp8 tensor cores): the job fails naming the pin
    a100 = {"name": "dgx-a100-80g"}
    fp8 = client.post("/v1/plans", json=plan_body(cluster=a100, search={"fp8": "tensorwise"}))
    failed = wait_for(client, f"/v1/plans/{fp8.json()['id']}", ("done", "failed", "infeasible"))
    assert failed["status"] == "failed" and failed["error"].startswith("search.fp8: ")
    assert client.post("/v1/plans", json=plan_body(search={"fp8": "mx"})).status_code == 422
    wrong_length = client.post("/v1/plans", json=plan_body(search={"mesh": [2, 2]}))
    assert wrong_length.status_code == 422 and "mesh" in wrong_length.text
    partial = {"baselines": False, "checkpointing": "partial"}
    r = client.post("/v1/plans", json=plan_body(search=partial))
    assert r.status_code == 202, r.text
    done = wait_for(client, f"/v1/plans/{r.json()['id']}", ("done", "failed", "infeasible"))
    assert done["status"] == "done" and all(
        "checkpointed_layers" in st for st in done["plan"]["stages"]
    )
    unknown = client.post("/v1/plans", json=plan_body(search={"checkpointing": "half"}))
    assert unknown.status_code == 422 and "checkpointing" in unknown.text


def test_a_request_whose_search_was_answered_before_is_planned_without_a_job(client):
    """Only the run to price differs from an earlier request: the service prices the cached
    answer in its own process (201, done at once, no planning process started)."""
    search = {"executable_only": True, "baselines": False, "top_k": 2}
    first = client.post("/v1/plans", json=plan_body(search=search))
    assert first.status_code == 202, first.text
    done = wait_for(client, f"/v1/plans/{first.json()['id']}", ("done", "failed"))
    assert done["status"] == "done" and done["plan"]["run"] is None, done
    recorded = 'autopar_plan_jobs_total{status="done"} 1.0'
    deadline = time.monotonic() + 10
    while recorded not in client.get("/metrics").text:
        assert time.monotonic() < deadline, client.get("/metrics").text
        time.sleep(0.1)
    priced = plan_body(search=search, run={"train_tokens": 1e9, "gpu_hour_price": 2.0})
    r = client.post("/v1/plans", json=priced)
    assert r.status_code == 201, r.text
    now = r.json()
    assert now["status"] == "done" and not now["cached"] and now["id"] != done["id"]
    assert PlanJob.model_validate(now).model_dump(mode="json") == now
    assert r.headers["location"] == f"/v1/plans/{now['id']}"
    plan, before = now["plan"], done["plan"]
    assert plan["mesh"] == before["mesh"] and plan["predicted"] == before["predicted"]
    training = plan["request"]["training"]
    tokens_per_step = training["global_batch_size"] * training["seq_len"]
    assert plan["run"]["steps"] == pytest.approx(1e9 / tokens_per_step, rel=0.01)
    time.sleep(0.5)
    metrics = client.get("/metrics").text
    assert "autopar_plan_answers_cached_total 1.0" in metrics
    assert recorded in metrics  # still the one job
    # The same priced request again is the stored row's.
    again = client.post("/v1/plans", json=priced)
    assert again.status_code == 200 and again.json()["id"] == now["id"]
