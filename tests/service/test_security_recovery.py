"""Bearer tokens, `autopar serve` on a public host, and start-up recovery of stale jobs."""

from __future__ import annotations

import json
import time

from fastapi.testclient import TestClient

from api.cli import main
from api.service.app import create_app
from api.service.store import ExecutionRow, PlanRow, Store
from tests.service.conftest import make_settings, plan_body, wait_for


def test_tokens_guard_mutating_endpoints(tmp_path):
    settings = make_settings(tmp_path, api_tokens=frozenset({"s3cret"}))
    with TestClient(create_app(settings, start_workers=False)) as c:
        missing = c.post("/v1/plans", json=plan_body())
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = c.post("/v1/plans", json=plan_body(), headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 403
        ok = c.post("/v1/plans", json=plan_body(), headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 202
        plan_id = ok.json()["id"]
        assert c.get(f"/v1/plans/{plan_id}").status_code == 200  # reads stay open
        assert c.delete(f"/v1/plans/{plan_id}").status_code == 401
        assert c.post("/v1/executions", json={"plan_id": plan_id}).status_code == 401
        assert c.post("/v1/clusters", json={}).status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert c.delete(f"/v1/plans/{plan_id}", headers=auth).status_code == 204


def test_serve_refuses_public_host_without_tokens(monkeypatch, capsys):
    monkeypatch.delenv("AUTOPAR_API_TOKENS", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "8123"]) == 2
    err = capsys.readouterr().err
    assert "--host" in err and "AUTOPAR_API_TOKENS" in err and "--insecure" in err


def test_restart_requeues_jobs_whose_lease_ran_out_and_fails_their_executions(tmp_path):
    settings = make_settings(tmp_path)
    settings.data_dir.mkdir(parents=True)
    store = Store(settings.database_url)
    request = json.dumps({"request": plan_body(), "profile": {}})
    now = time.time()
    with store.session() as s:
        for plan_id, status in (("stale-running", "running"), ("left-queued", "queued")):
            s.add(
                PlanRow(
                    id=plan_id,
                    request_hash=plan_id,
                    status=status,
                    model_name="gpt-350m",
                    cluster_name="cpu-local",
                    request_json=request,
                    created_at=now,
                    progress_done=0,
                    progress_total=0,
                )
            )
        s.add(
            ExecutionRow(
                id="stale-exec",
                plan_id="stale-running",
                target="local",
                status="running",
                options_json="{}",
                created_at=now,
            )
        )
    store.close()
    with TestClient(create_app(settings, start_workers=False)) as c:
        # Rows without a lease (a replica that died, or the release before leases): the plan
        # goes back to the queue, the execution (not restarted behind the user) fails.
        stale = c.get("/v1/plans/stale-running").json()
        assert stale["status"] == "queued" and "re-queued" in stale["progress"]["step"]
        failed = c.get("/v1/executions/stale-exec").json()
        assert failed["status"] == "failed" and "replica" in failed["error"]
        assert c.get("/v1/plans/left-queued").json()["status"] == "queued"
        assert c.get("/healthz").json()["queued_or_running_plans"] == 2


def test_requeued_job_runs_after_restart(tmp_path):
    settings = make_settings(tmp_path)
    with TestClient(create_app(settings, start_workers=False)) as c:
        plan_id = c.post("/v1/plans", json=plan_body()).json()["id"]
    with TestClient(create_app(settings)) as c:  # the "restarted" service
        done = wait_for(c, f"/v1/plans/{plan_id}", ("done", "failed", "infeasible"))
        assert done["status"] == "done", done
