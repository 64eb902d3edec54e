"""POST/GET/DELETE /v1/executions: a plan trained on 2 real gloo ranks through the API."""

from __future__ import annotations

import time

import pytest
import yaml

from planner.cluster.profile import load_cluster
from tests.service.conftest import plan_body, wait_for


def _two_rank_plan(client) -> str:
    profile = load_cluster("cpu-local").model_dump(mode="json")
    profile.update(name="cpu-2", devices_per_node=2)
    assert client.post("/v1/clusters", json=profile).status_code == 201
    body = plan_body(
        cluster={"name": "cpu-2"}, training={"global_batch_size": 4, "seq_len": 32, "dtype": "fp32"}
    )
    job = client.post("/v1/plans", json=body).json()
    done = wait_for(client, f"/v1/plans/{job['id']}", ("done", "failed", "infeasible"))
    assert done["status"] == "done", done
    return job["id"]


@pytest.mark.distributed
def test_execute_a_plan_on_two_gloo_ranks(client):
    plan_id = _two_rank_plan(client)
    r = client.post("/v1/executions", json={"plan_id": plan_id, "steps": 3})
    assert r.status_code == 202, r.text
    done = wait_for(
        client, f"/v1/executions/{r.json()['id']}", ("succeeded", "failed", "timed_out"), 180
    )
    assert done["status"] == "succeeded", done
    result = done["result"]
    assert set(result["ranks"]) == {"0", "1"}
    assert all(len(rank["steps"]) == 3 for rank in result["ranks"].values())
    assert result["measured_step_s"] > 0 and result["predicted_step_s"] > 0
    listed = client.get("/v1/executions", params={"plan_id": plan_id}).json()
    assert [e["id"] for e in listed] == [done["id"]]
    # A finished execution cannot be cancelled.
    assert client.delete(f"/v1/executions/{done['id']}").status_code == 409

    slurm = client.post("/v1/executions", json={"plan_id": plan_id, "target": "slurm"}).json()
    assert slurm["status"] == "succeeded" and "#SBATCH" in slurm["files"]["job.sbatch"]
    k8s = client.post("/v1/executions", json={"plan_id": plan_id, "target": "k8s"}).json()
    manifest = yaml.safe_load(k8s["files"]["pytorchjob.yaml"])
    assert manifest["kind"] == "PyTorchJob"


@pytest.mark.distributed
def test_cancel_a_running_execution(client):
    plan_id = _two_rank_plan(client)
    ex = client.post("/v1/executions", json={"plan_id": plan_id, "steps": 1000}).json()
    wait_for(client, f"/v1/executions/{ex['id']}", ("running",), 60)
    time.sleep(1.0)
    assert client.delete(f"/v1/executions/{ex['id']}").status_code == 202
    done = wait_for(client, f"/v1/executions/{ex['id']}", ("cancelled", "failed", "succeeded"), 60)
    assert done["status"] == "cancelled", done


def test_execution_refusals(client):
    assert client.post("/v1/executions", json={"plan_id": "nope"}).status_code == 404
    big = plan_body(
        model={"name": "gpt-1.3b"}, cluster={"name": "dgx-a100-80g"}, search={"baselines": False}
    )
    big["training"] = {"global_batch_size": 64, "seq_len": 1024}
    job = client.post("/v1/plans", json=big).json()
    early = client.post("/v1/executions", json={"plan_id": job["id"]})
    assert early.status_code in (409, 422)  # not done yet, or (if very fast) too big
    wait_for(client, f"/v1/plans/{job['id']}", ("done", "failed", "infeasible"), 240)
    r = client.post("/v1/executions", json={"plan_id": job["id"]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["plan_id"]
