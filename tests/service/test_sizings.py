"""POST /v1/sizings: the model planned on a sweep of cluster sizes in a real planning
process, the run's time and cost per size, the sizing page with its chart; plans with a run."""

from __future__ import annotations

import pytest

from tests.service.conftest import TINY_GPT, plan_body, wait_for

TRAINING = {"global_batch_size": 8, "seq_len": 64, "dtype": "fp32"}


def sizing_body(**sizing) -> dict:
    fields = {"min_nodes": 1, "max_nodes": 2, "train_tokens": "2B", "gpu_hour_price": 1.5}
    return {
        "model": TINY_GPT,
        "cluster": {"name": "cpu-local"},
        "training": TRAINING,
        "search": {"executable_only": True},
        "sizing": {**fields, **sizing},
    }


def test_sizing_round_trip_arithmetic_page_and_separation_from_plans(client):
    r = client.post("/v1/sizings", json=sizing_body(deadline="400d"))
    assert r.status_code == 202, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/sizings/{job['id']}"
    done = wait_for(client, f"/v1/sizings/{job['id']}", ("done", "failed", "infeasible"))
    assert done["status"] == "done", done
    sizing = done["sizing"]
    rows = sizing["rows"]
    assert [r["nodes"] for r in rows] == [1, 2]
    for row in rows:
        assert row["fits"]
        run = row["run"]
        # Meta's 90% goodput for Llama 3, the default (planner.search.sizing)
        assert run["time_s"] == pytest.approx(2e9 / row["tokens_per_s"] / 0.9, rel=1e-12)
        assert run["gpu_hours"] == pytest.approx(row["gpus"] * run["time_s"] / 3600, rel=1e-12)
        assert run["cost"] == pytest.approx(run["gpu_hours"] * 1.5, rel=1e-12)
    meets = [r for r in rows if r["run"]["time_s"] <= 400 * 86400]
    assert sizing["cheapest_within_deadline"] == min(meets, key=lambda r: r["run"]["cost"])["nodes"]
    page = client.get(f"/v1/sizings/{job['id']}/view")
    assert page.status_code == 200 and "<svg" in page.text and "GPU-hours" in page.text
    # the same request again is answered from the store; sizings are not plans
    again = client.post("/v1/sizings", json=sizing_body(deadline="400d"))
    assert again.status_code == 200 and again.json()["id"] == job["id"]
    assert client.get(f"/v1/plans/{job['id']}").status_code == 404
    assert all(item["id"] != job["id"] for item in client.get("/v1/plans").json()["items"])
    assert client.delete(f"/v1/sizings/{job['id']}").status_code == 204
    assert client.get(f"/v1/sizings/{job['id']}").status_code == 404


def test_a_plan_with_a_run_carries_its_time_and_cost(client):
    body = plan_body(run={"train_tokens": "1B", "gpu_hour_price": 2, "goodput": 0.8})
    r = client.post("/v1/plans", json=body)
    assert r.status_code == 202, r.text
    done = wait_for(client, f"/v1/plans/{r.json()['id']}", ("done", "failed", "infeasible"))
    plan = done["plan"]
    run = plan["run"]
    assert run["goodput"] == 0.8
    assert run["time_s"] == pytest.approx(1e9 / plan["predicted"]["tokens_per_s"] / 0.8, rel=1e-12)
    assert run["cost"] == pytest.approx(run["gpu_hours"] * 2, rel=1e-12)
    page = client.get(f"/v1/plans/{r.json()['id']}/view").text
    assert "GPU-hours" in page and "run time" in page


@pytest.mark.parametrize(
    ("sizing", "loc"),
    [
        ({"train_tokens": "15X"}, ["sizing", "train_tokens"]),
        ({"deadline": "soon"}, ["sizing", "deadline"]),
        ({"gpu_hour_price": None, "budget": 5}, ["sizing", "budget"]),
        ({"min_nodes": 4, "max_nodes": 2}, ["sizing", "max_nodes"]),
    ],
)
def test_bad_sizing_fields_are_422_naming_them(idle_client, sizing, loc):
    r = idle_client.post("/v1/sizings", json=sizing_body(**sizing))
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == loc


def test_a_bad_run_on_a_plan_is_422(idle_client):
    r = idle_client.post("/v1/plans", json=plan_body(run={"train_tokens": "lots"}))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["run", "train_tokens"]
