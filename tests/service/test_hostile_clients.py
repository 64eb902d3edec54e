"""Hostile and unlucky clients (issue 35): each probe that once froze, leaked, resurrected or
500'd, reproduced against the service. Where timing or processes matter the server is a
real uvicorn (or `autopar serve`) process; the store races run on SQLite and on a real
PostgreSQL."""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from fastapi.testclient import TestClient

from api.service.app import create_app
from api.service.store import PlanRow, Store
from tests.service.conftest import TINY_GPT, make_settings, plan_body, serve

# A count with a unit, padded: two \s* around an optional unit made the parsers quadratic
# (40 KB held a replica for 34 s; these 200 KB, minutes).
SLOW_TEXT = "1" + " " * 200_000 + "x"


def _loc(response: httpx.Response) -> list:
    return response.json()["detail"][0]["loc"]


# --- 1. no request holds the server ---------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "overrides", "loc"),
    [
        ("/v1/plans", {"run": {"train_tokens": SLOW_TEXT}}, ["run", "train_tokens"]),
        ("/v1/plans", {"cluster": {"name": "cpu-local", "memory_headroom": SLOW_TEXT}}, None),
        (
            "/v1/sizings",
            {"sizing": {"train_tokens": "1T", "deadline": SLOW_TEXT, "max_nodes": 2}},
            ["sizing", "deadline"],
        ),
    ],
)
def test_a_long_quantity_is_refused_while_health_answers(live_server, path, overrides, loc):
    answers: list[int] = []
    stop, polling = threading.Event(), threading.Event()

    def poll_health() -> None:
        with httpx.Client(base_url=live_server, timeout=30) as c:
            while not stop.is_set():
                answers.append(c.get("/healthz").status_code)
                polling.set()
                time.sleep(0.02)

    poller = threading.Thread(target=poll_health)
    poller.start()
    # the poller answered once before the request starts: a request refused in milliseconds
    # (on a loaded machine, before the poller's first answer) still has health beside it
    assert polling.wait(30), "health never answered"
    result: list[httpx.Response] = []
    post = threading.Thread(
        target=lambda: result.append(
            httpx.post(f"{live_server}{path}", json=plan_body(**overrides), timeout=120)
        )
    )
    post.start()
    post.join(timeout=10)  # the quadratic parser took 34 s for this body
    stop.set()
    poller.join()
    assert not post.is_alive(), "the request still runs after 10 s"
    response = result[0]
    assert response.status_code == 422, response.text
    where = _loc(response)
    assert "train_tokens" in where or "deadline" in where or "memory_headroom" in where, where
    if loc:
        assert [p for p in where if p != "body"][: len(loc)] == loc, where
    assert answers and set(answers) == {200}


def _string_schemas(node, where: str = ""):
    if isinstance(node, dict):
        if node.get("type") == "string":
            yield where, node
        for key, value in node.items():
            yield from _string_schemas(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _string_schemas(value, f"{where}[{i}]")


def test_every_request_string_has_a_length_bound(idle_client):
    components = idle_client.get("/openapi.json").json()["components"]["schemas"]
    requests = [
        "PlanCreate",
        "SizingCreate",
        "ModelInput",
        "ClusterInput",
        "TrainingInput",
        "SearchInput",
        "RunInput",
        "SizingInput",
        "ExecutionCreate",
        "ClusterProfile",
        "DeviceSpec",
        "Measured",
        "ExecutorOverhead",
        "OpTimeRow",
    ]
    unbounded = [
        f"{name}{where}"
        for name in requests
        for where, schema in _string_schemas(components[name])
        if not {"maxLength", "pattern", "enum", "const"} & set(schema)
    ]
    assert unbounded == []


def test_the_quantity_parsers_are_linear():
    from planner.cluster.headroom import headroom_bytes
    from planner.errors import InputError
    from planner.search.sizing import parse_duration, parse_tokens

    calls = [
        lambda: parse_tokens(SLOW_TEXT, "run.train_tokens"),
        lambda: parse_duration(SLOW_TEXT, "sizing.deadline"),
        lambda: headroom_bytes(SLOW_TEXT, 2**30, "cluster.memory_headroom"),
    ]
    for call in calls:
        outcome: list[BaseException] = []

        def run(call=call, outcome=outcome) -> None:
            try:
                call()
            except InputError as err:
                outcome.append(err)

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(timeout=20)
        assert outcome, "still parsing after 20 s"


# --- 2. a stalled upload holds nothing for long --------------------------------------------
def _stalled_upload(base: str, declared: int, sent: int) -> socket.socket:
    url = urlparse(base)
    sock = socket.create_connection((url.hostname, url.port))
    head = (
        f"POST /v1/plans HTTP/1.1\r\nHost: {url.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + b" " * sent)
    return sock


def _status(sock: socket.socket, timeout: float) -> int | None:
    sock.settimeout(timeout)
    try:
        line = sock.recv(4096).split(b"\r\n", 1)[0]
    except TimeoutError:
        return None
    return int(line.split()[1]) if line.startswith(b"HTTP/") else None


def test_stalled_uploads_time_out_and_share_a_memory_budget(tmp_path):
    mib = 1 << 20
    settings = make_settings(tmp_path, body_read_timeout_s=1.5, body_memory_bytes=3 * mib)
    with serve(settings, start_workers=False) as base:
        stalled = [_stalled_upload(base, 8 * mib - 1, mib) for _ in range(2)]
        time.sleep(0.5)  # both bodies' first MiB is in the server
        over = _stalled_upload(base, 8 * mib - 1, 2 * mib)  # 4 MiB in flight: past 3 MiB
        assert _status(over, 5) == 503
        # An ordinary request is not turned away while the stalled ones hold the budget.
        assert httpx.post(f"{base}/v1/plans", json=plan_body(), timeout=30).status_code == 202
        # The stalled ones are answered 408 at their deadline (they held on before).
        assert [_status(s, 5) for s in stalled] == [408, 408]
        for s in (*stalled, over):
            s.close()
        # Their memory was given back: a body of the whole budget is read again.
        r = httpx.post(f"{base}/v1/plans", content=b" " * (3 * mib - 100), timeout=30)
        assert r.status_code in (400, 422), r.text


# --- 3. a deleted plan is gone everywhere ---------------------------------------------------
def _finished_row(store: Store, plan_id: str) -> None:
    with store.session() as s:
        s.add(
            PlanRow(
                id=plan_id,
                request_hash=plan_id,
                status="failed",
                error="a finished job",
                model_name="m",
                cluster_name="c",
                request_json="{}",
                created_at=time.time(),
                finished_at=time.time(),
                progress_done=0,
                progress_total=0,
            )
        )


def test_a_deleted_plan_is_not_served_by_any_replica(store_url, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = make_settings(tmp_path / "a", database_url=store_url)
    b = make_settings(tmp_path / "b", database_url=store_url)
    with (
        TestClient(create_app(a, start_workers=False)) as one,
        TestClient(create_app(b, start_workers=False)) as two,
    ):
        store = Store(store_url)
        for plan_id in ("deleted-plan-1", "deleted-plan-2"):
            _finished_row(store, plan_id)
        store.close()
        for client in (one, two):  # both replicas have it cached now
            assert client.get("/v1/plans/deleted-plan-1").status_code == 200
        assert one.delete("/v1/plans/deleted-plan-1").status_code == 204
        assert two.get("/v1/plans/deleted-plan-1").status_code == 404
        assert one.get("/v1/plans/deleted-plan-1").status_code == 404

        # Readers beside the delete on one replica: once DELETE answered, nothing serves it.
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                one.get("/v1/plans/deleted-plan-2")

        readers = [threading.Thread(target=read) for _ in range(3)]
        for t in readers:
            t.start()
        time.sleep(0.2)
        assert one.delete("/v1/plans/deleted-plan-2").status_code == 204
        after = [one.get("/v1/plans/deleted-plan-2").status_code for _ in range(20)]
        stop.set()
        for t in readers:
            t.join()
        after += [one.get("/v1/plans/deleted-plan-2").status_code for _ in range(5)]
        assert set(after) == {404}


# --- 4. the graph validator outlives the thread that started it ------------------------------
def test_the_graph_validator_survives_its_first_thread():
    from api.service.validation import GraphValidator
    from planner.graph.tracing import trace_model
    from planner.models import ModelSpec, resolve

    config = {**TINY_GPT["config"], "layers": 1}
    graph = trace_model(resolve(ModelSpec(name="gpt-350m", config=config)), 1, 16, "fp32")
    validator = GraphValidator(4 * 2**30)
    try:
        first = threading.Thread(target=validator.summary, args=(graph.to_json(),))
        first.start()
        first.join()  # the pool's process was started from this thread, which is now gone
        worker = next(iter(validator._pool._processes.values()))
        deadline = time.monotonic() + 3
        while worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker.is_alive(), "the validator died with the thread that started it"
        assert validator.summary(graph.to_json())["nodes"] == len(graph.nodes)
    finally:
        validator.close()


# --- 5 and 10. the queue bound and identical requests hold under concurrency ---------------
def _post_all(base: str, bodies: list[dict], headers: dict | None = None) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(
            pool.map(
                lambda body: httpx.post(
                    f"{base}/v1/plans", json=body, headers=headers or {}, timeout=60
                ),
                bodies,
            )
        )


def test_the_queue_bound_and_one_job_per_request_hold_under_concurrency(store_url, tmp_path):
    settings = make_settings(tmp_path, database_url=store_url, max_queued_jobs=8)
    with serve(settings, start_workers=False) as base:
        distinct = [
            plan_body(training={"global_batch_size": b, "seq_len": 64, "dtype": "fp32"})
            for b in range(1, 31)
        ]
        codes = [r.status_code for r in _post_all(base, distinct)]
        assert codes.count(202) == 8 and codes.count(429) == 22, codes
        # Identical requests (the queue has room again after a delete of everything).
        for job in httpx.get(f"{base}/v1/plans?limit=100").json()["items"]:
            httpx.delete(f"{base}/v1/plans/{job['id']}")
        same = _post_all(base, [plan_body()] * 10)
        assert {r.json()["id"] for r in same} == {same[0].json()["id"]}
        assert sorted(r.status_code for r in same) == [200] * 9 + [202]


def test_an_idempotency_key_returns_the_first_job(idle_client):
    key = {"Idempotency-Key": "retry-7f3a"}
    first = idle_client.post("/v1/plans", json=plan_body(), headers=key)
    assert first.status_code == 202
    again = idle_client.post("/v1/plans", json=plan_body(), headers=key)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    # A failed job is not reused by content, but a retry with its key gets it back.
    other = plan_body(training={"global_batch_size": 4, "seq_len": 64, "dtype": "fp32"})
    assert idle_client.post("/v1/plans", json=other, headers=key).status_code == 409
    # Executions: a retried launch is the first one (slurm: rendered, no processes).
    store = idle_client.app.state.store
    _finished_row(store, "plan-for-keys")
    plan = _a_plan_json()
    with store.session() as s:
        row = s.get(PlanRow, "plan-for-keys")
        row.status, row.plan_json = "done", plan
    run = {"plan_id": "plan-for-keys", "target": "slurm", "steps": 2}
    one = idle_client.post("/v1/executions", json=run, headers=key)
    two = idle_client.post("/v1/executions", json=run, headers=key)
    assert one.status_code == 202 and two.status_code == 200, (one.text, two.text)
    assert one.json()["id"] == two.json()["id"]
    changed = idle_client.post("/v1/executions", json={**run, "steps": 3}, headers=key)
    assert changed.status_code == 409
    assert len(idle_client.get("/v1/executions").json()) == 1


def _a_plan_json() -> str:
    import autopar

    plan = autopar.plan(
        "gpt-350m",
        config=TINY_GPT["config"],
        cluster="cpu-local",
        global_batch_size=8,
        seq_len=64,
        dtype="fp32",
    )
    return plan.model_dump_json()


# --- 6. what once was a 500 ----------------------------------------------------------------
def test_non_ascii_token_deep_override_and_sizing_id_are_4xx(tmp_path):
    settings = make_settings(tmp_path, api_tokens=frozenset({"secret"}))
    with TestClient(create_app(settings, start_workers=False)) as c:
        r = c.post("/v1/plans", json=plan_body(), headers={"Authorization": b"Bearer \xe9"})
        assert r.status_code == 403, r.text
        auth = {"Authorization": "Bearer secret"}
        hf = {
            "model_type": "llama",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "vocab_size": 128,
            "intermediate_size": 128,
        }
        for deep in ("[" * 50_000, "[" * 999):
            model = {"hf_config": hf, "config": {"rope_scaling": deep}}
            r = c.post("/v1/plans", json=plan_body(model=model), headers=auth)
            assert r.status_code == 422, r.text
            assert "rope_scaling" in _loc(r), r.text
        sizing = plan_body(sizing={"train_tokens": "1T", "max_nodes": 1})
        sizing.pop("run", None)
        made = c.post("/v1/sizings", json=sizing, headers=auth)
        assert made.status_code == 202, made.text
        r = c.post("/v1/executions", json={"plan_id": made.json()["id"]}, headers=auth)
        assert r.status_code == 422 and _loc(r) == ["plan_id"], r.text


# --- 7. metrics labels come from closed sets ------------------------------------------------
def test_made_up_methods_do_not_grow_the_metrics(live_server):
    with httpx.Client(base_url=live_server) as c:
        for i in range(30):
            c.request(f"MADEUP{i}", f"/v1/plans/x{i}")  # httptools answers these itself
        for method in ("PROPFIND", "MKCOL", "PURGE"):  # parsed: they reach the app
            c.request(method, "/v1/plans")
        text = c.get("/metrics").text
    assert "MADEUP" not in text and "PROPFIND" not in text and "PURGE" not in text
    assert 'method="other"' in text


# --- 8. children import the installed code, whatever the working directory ----------------
def test_rank_and_planning_processes_ignore_the_working_directory(tmp_path):
    from executor.launch import _worker_command
    from executor.lifetime import SAFE_PATH

    marker = tmp_path / "ran-from-cwd"
    fake = tmp_path / "executor"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "worker.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    # The rank command as torchrun runs it, from a folder holding executor/worker.py.
    command = _worker_command(Path("plan.json"), 1, {}, False)
    module = command[command.index("executor.worker") - 1 :]
    probe = [sys.executable, *module[:2], "--help"]
    env = {**os.environ, **SAFE_PATH}
    run = subprocess.run(probe, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert not marker.exists() and run.returncode == 0, run.stderr[-2000:]
    assert "--steps" in run.stdout  # the real worker's help
    # Without it, the folder's file runs (what the launcher used to do).
    subprocess.run([sys.executable, *module[:2]], cwd=tmp_path, env={**os.environ})
    assert marker.exists()


@pytest.mark.slow
def test_the_fork_server_imports_the_installed_planner(tmp_path):
    marker = tmp_path / "ran-from-cwd"
    for package in ("api", "api/service"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "api/service/orphan_guard.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
    )
    from tests.service.test_replicas import _wait, replica

    (tmp_path / "data").mkdir()
    url = f"sqlite:///{tmp_path / 'data' / 'store.db'}"
    with replica(tmp_path / "data", url, cwd=tmp_path) as (_pid, base):
        job = httpx.post(f"{base}/v1/plans", json=plan_body()).json()["id"]
        done = _wait(
            lambda: (
                (j := httpx.get(f"{base}/v1/plans/{job}").json())["status"]
                not in ("queued", "running")
                and j
            ),
            120,
            "the plan",
        )
    assert done["status"] == "done", done
    assert not marker.exists()


# --- 9. children end with the process that started them ------------------------------------
def test_a_watched_process_exits_within_a_second_of_its_parent():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    code = (
        "import time; from executor.lifetime import exit_when_gone; "
        f"exit_when_gone({sleeper.pid}); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(1.0)
    assert child.poll() is None
    sleeper.kill()
    sleeper.wait()
    started = time.monotonic()
    child.wait(timeout=10)
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize(
    ("path", "before"),
    [("executor/worker.py", "import torch"), ("api/service/planning.py", "limit_memory(")],
)
def test_children_watch_their_parent_before_heavy_work(path, before):
    """A rank asks for its death signal and watches its launcher before importing torch; a
    planning process watches its replica before anything else."""
    source = (Path(__file__).resolve().parents[2] / path).read_text()
    lines = source.splitlines()
    watch = next(
        i for i, line in enumerate(lines) if "exit_when_gone(" in line and "import" not in line
    )
    heavy = next(i for i, line in enumerate(lines) if line.strip().startswith(before))
    assert watch < heavy
    ast.parse(source)


# --- 11. the schema says what the service takes --------------------------------------------
def test_options_of_a_static_path_lists_its_own_methods(idle_client):
    r = idle_client.options("/v1/plans/compare")
    assert r.headers["allow"] == "GET, OPTIONS"


def test_schema_valid_bodies_that_were_refused_are_accepted(idle_client):
    from api.service.routes_sizings import SIZING_EXAMPLE
    from planner.cluster.profile import load_cluster

    assert idle_client.post("/v1/sizings", json=SIZING_EXAMPLE).status_code == 202
    run = idle_client.post("/v1/executions", json={"plan_id": "nothing-here", "steps": 484.0})
    assert run.status_code == 404, run.text  # past validation: there is no such plan
    training = {"global_batch_size": 8.0, "seq_len": 64, "dtype": "fp32"}
    assert idle_client.post("/v1/plans", json=plan_body(training=training)).status_code == 202
    profile = load_cluster("cpu-local").model_dump(mode="json")
    profile |= {"name": "all-headroom", "memory_headroom_bytes": profile["device"]["memory_bytes"]}
    assert idle_client.post("/v1/clusters", json=profile).status_code == 201
    schema = idle_client.get("/openapi.json").json()["components"]["schemas"]["ModelInput"]
    zoo = schema["oneOf"][2]["anyOf"]
    gpt = next(b for b in zoo if "gpt-350m" in b["properties"]["name"]["enum"])
    assert gpt["properties"]["config"]["additionalProperties"] is False
    assert "layers" in gpt["properties"]["config"]["properties"]


def test_values_the_schema_refuses_are_refused(idle_client):
    from planner.cluster.profile import load_cluster

    strings = plan_body(model={"name": "gpt-350m", "config": {"layers": "4"}})
    assert idle_client.post("/v1/plans", json=strings).status_code == 422
    profile = load_cluster("cpu-local").model_dump(mode="json") | {"nodes": "1"}
    r = idle_client.post("/v1/plans", json=plan_body(cluster={"profile": profile}))
    assert r.status_code == 422 and "nodes" in r.text
    r = idle_client.post("/v1/plans", json=plan_body(cluster={"name": "cpu-local", "nodes": None}))
    assert r.status_code == 422


# --- 12. pages say nosniff and carry a policy; the Host is checked -------------------------
def test_security_headers_and_trusted_hosts(tmp_path):
    with TestClient(create_app(make_settings(tmp_path), start_workers=False)) as c:
        page = c.get("/v1/plans/nothing/view")
        assert page.headers["x-content-type-options"] == "nosniff"
        assert "script-src 'self'" in page.headers["content-security-policy"]
        docs = c.get("/docs").headers["content-security-policy"]
        assert "'sha256-" in docs and "unsafe-eval" not in docs
        assert c.get("/healthz", headers={"host": "attacker.example"}).status_code == 400
    loopback = make_settings(tmp_path).model_copy(update={"allowed_hosts": frozenset()})
    with TestClient(create_app(loopback, start_workers=False), base_url="http://localhost") as c:
        assert c.get("/healthz").status_code == 200
        assert c.get("/healthz", headers={"host": "rebound.example:8000"}).status_code == 400


# --- 1. leases are kept while the server's interpreter is held -----------------------------
@pytest.mark.slow
@pytest.mark.distributed
def test_a_frozen_replica_keeps_its_jobs(postgres_url, tmp_path):
    """The server and its planning processes stopped (SIGSTOP), as a request holding the
    server's interpreter once stopped it (a 34 s regex): its heartbeat process, left
    running, keeps the leases, so the other replica does not take the job over, and the job
    finishes once, where it started."""
    import psutil

    from tests.service.test_replicas import LEASE_S, _rows, _slow_body, _wait, two_replicas

    with two_replicas(postgres_url, tmp_path) as ((pid_a, url_a), (pid_b, _url_b)):
        job = httpx.post(f"{url_a}/v1/plans", json=_slow_body(8)).json()["id"]
        _wait(lambda: _rows(postgres_url)[job].status == "running", 120, "a replica to run it")
        owner = _rows(postgres_url)[job].owner
        server = psutil.Process(pid_a if f"-{pid_a}-" in owner else pid_b)
        frozen = [
            p
            for p in (server, *server.children(recursive=True))
            if "multiprocessing.spawn" not in " ".join(p.cmdline())  # the heartbeat runs on
        ]
        for proc in frozen:
            proc.suspend()
        try:
            time.sleep(3 * LEASE_S)  # the other expires lapsed leases every LEASE_S / 3
            row = _rows(postgres_url)[job]
            assert (row.status, row.attempts, row.owner) == ("running", 1, owner)
        finally:
            for proc in frozen:
                with contextlib.suppress(psutil.Error):
                    proc.resume()
        rows = _wait(
            lambda: (r := _rows(postgres_url))[job].status not in ("queued", "running") and r,
            180,
            "the job to finish",
        )
    assert rows[job].status == "done" and rows[job].attempts == 1
    assert rows[job].owner == owner


def test_a_choice_pin_takes_its_values_as_json_says_them(idle_client):
    # pydantic's Literal takes false for ZeRO 0 and 1 for checkpointing true (equal in
    # Python); a request means neither (found by schemathesis)
    for search, field in (({"zero": False}, "zero"), ({"checkpointing": 1}, "checkpointing")):
        r = idle_client.post("/v1/plans", json=plan_body(search=search))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == field, r.text
    for search in ({"zero": 0}, {"checkpointing": True}, {"cp_comm": "ring"}):
        assert idle_client.post("/v1/plans", json=plan_body(search=search)).status_code == 202
