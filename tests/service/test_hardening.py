"""Hostile and careless requests (issue 12): each probe that once failed, reproduced.

No file is opened because a request named it; absurd sizes and non-finite numbers are 4xx
naming the field, never a 500 or a job that later fails as an internal error; the OpenAPI
schema says what the service accepts; OPTIONS lists the documented methods."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from api.service.app import create_app
from planner.cluster.profile import load_cluster
from tests.service.conftest import TINY_GPT, make_settings, plan_body, serve, wait_for


def _post(client, path: str, body) -> httpx.Response:
    """POST `body` as Python's json writes it (NaN and Infinity included, as a careless
    client would send them)."""
    text = json.dumps(body, allow_nan=True)
    return client.post(path, content=text, headers={"content-type": "application/json"})


def _loc(response) -> list:
    return response.json()["detail"][0]["loc"]


# --- 1. a request body never reaches the file system ----------------------------------------
def test_a_profile_cannot_name_a_file_to_open(idle_client, tmp_path):
    target = tmp_path / "victim.db"
    target.write_bytes(b"")
    profile = load_cluster("cpu-local").model_dump(mode="json")
    profile["measured"] = {"op_db": str(target)}
    r = _post(idle_client, "/v1/plans", plan_body(cluster={"profile": profile}))
    assert r.status_code == 422
    assert _loc(r)[-2:] == ["measured", "op_db"]
    created = _post(idle_client, "/v1/clusters", {**profile, "name": "with-a-path"})
    assert created.status_code == 422 and "op_db" in created.text
    assert target.read_bytes() == b""  # untouched: still not a database
    assert "op_db" not in idle_client.get("/openapi.json").text


def test_measured_operator_times_travel_inline(client):
    from planner.cluster.profiling import signature, work
    from planner.graph.tracing import trace_model
    from planner.models import ModelSpec, resolve

    graph = trace_model(resolve(ModelSpec(**TINY_GPT)), 1, 64, "fp32")
    linear = next(n for n in graph.nodes if n.kind == "linear")
    row = {
        "dtype": "fp32",
        "op": linear.op,
        "signature": signature(linear),
        "work": work(linear),
        "fwd_s": 0.5,
        "bwd_s": 1.0,
    }
    profile = load_cluster("cpu-local").model_dump(mode="json")
    profile["measured"] = {"op_times": [row]}
    training = {"global_batch_size": 4, "dtype": "fp32"}  # the measured row's dtype
    body = plan_body(cluster={"profile": profile}, training=training)
    r = _post(client, "/v1/plans", body)
    assert r.status_code == 202, r.text
    done = wait_for(client, f"/v1/plans/{r.json()['id']}", ("done", "failed", "infeasible"))
    assert done["status"] == "done", done
    # One measured linear at 0.5 s forward dominates a step that is otherwise milliseconds.
    assert done["plan"]["predicted"]["step_time_s"] > 0.5


# --- 2. sizes are bounded and the work is estimated before it starts ------------------------
@pytest.mark.parametrize(
    ("overrides", "loc"),
    [
        ({"model": {"name": "gpt-350m", "config": {"layers": 1e9}}}, ["model", "config", "layers"]),
        ({"model": {"name": "gpt-350m", "config": {"hidden": 2**40}}}, ["model", "config"]),
        ({"training": {"global_batch_size": 8, "seq_len": 10**9}}, ["body", "training"]),
        ({"training": {"global_batch_size": 2**63}}, ["body", "training"]),
        ({"cluster": {"name": "cpu-local", "nodes": 10**12}}, ["body", "cluster", "nodes"]),
    ],
)
def test_absurd_sizes_are_refused_naming_the_field(idle_client, overrides, loc):
    r = _post(idle_client, "/v1/plans", plan_body(**overrides))
    assert r.status_code == 422, r.text
    assert _loc(r)[: len(loc)] == loc


def test_absurd_profiles_and_graphs_are_refused(idle_client):
    profile = load_cluster("cpu-local").model_dump(mode="json")
    for path, value in (
        (("nodes",), 10**12),
        (("links", "inter_node", "bandwidth"), float("inf")),
        (("device", "peak_flops", "fp32"), float("nan")),
        (("name",), "evil\nname"),
    ):
        bad = json.loads(json.dumps(profile))
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        r = _post(idle_client, "/v1/plans", plan_body(cluster={"profile": bad}))
        assert r.status_code == 422, (path, r.text)
        assert _loc(r)[-len(path) :] == list(path), (path, _loc(r))
    node = {"name": "n", "op": "aten.mm.default", "kind": "linear", "layer": 10**12}
    graph = {"schema_version": "1", "batch": 1, "seq": 8, "dtype": "fp32", "nodes": [node]}
    graph["edges"] = []
    r = _post(idle_client, "/v1/plans", plan_body(model={"graph": graph}))
    assert r.status_code == 422 and "layer" in r.text
    idle = {**graph, "nodes": [{**node, "layer": 0}]}  # valid, but it computes nothing
    r = _post(idle_client, "/v1/plans", plan_body(model={"graph": idle}))
    assert r.status_code == 422 and "does no work" in r.text


def test_work_past_the_job_time_limit_is_refused_up_front(tmp_path):
    settings = make_settings(tmp_path, job_time_limit_s=20)
    with TestClient(create_app(settings, start_workers=False)) as c:
        deep = plan_body(model={"name": "llama3-70b", "config": {"layers": 400}})
        r = _post(c, "/v1/plans", deep)
        assert r.status_code == 422 and _loc(r) == ["model", "config", "layers"]
        assert "per-job limit of 20 s" in r.text
        wide = plan_body(
            model={"name": "gpt-1.3b"},
            cluster={"name": "dgx-h100", "nodes": 64},
            training={"global_batch_size": 4096},
        )
        r = _post(c, "/v1/plans", wide)
        assert r.status_code == 422 and _loc(r) == ["cluster"], r.text
        # The same cluster with the mesh pinned is a small search, and is accepted.
        pinned = {**wide, "search": {"mesh": [1, 512, 1], "baselines": False}}
        assert _post(c, "/v1/plans", pinned).status_code == 202


def test_planning_workers_stay_within_their_memory_limit(tmp_path):
    """Absurd but accepted requests, planned by workers limited to 2 GiB of address space:
    each ends done or infeasible (a worker past its limit would fail with MemoryError)."""
    settings = make_settings(tmp_path, worker_memory_bytes=2 * 2**30, plan_workers=2)
    from planner.limits import MAX_SEQ

    with TestClient(create_app(settings)) as c:
        huge_seq = plan_body(training={"global_batch_size": 8, "seq_len": MAX_SEQ})
        nodes = [
            {
                "name": f"n{i}",
                "op": "aten.relu.default",
                "kind": "elementwise",
                "layer": i % 50,
                "bytes_read": 4096,
                "bytes_written": 4096,
            }
            for i in range(10_000)
        ]
        graph = {"schema_version": "1", "batch": 1, "seq": 8, "dtype": "fp32", "nodes": nodes}
        big_graph = plan_body(model={"graph": {**graph, "edges": []}})
        ids = [_post(c, "/v1/plans", body).json()["id"] for body in (huge_seq, big_graph)]
        for plan_id in ids:
            done = wait_for(c, f"/v1/plans/{plan_id}", ("done", "failed", "infeasible"), 300)
            assert done["status"] in ("done", "infeasible"), done


# --- 4. never a 500 ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b["search"].update(top_k=float("nan")),
        lambda b: b["training"].update(global_batch_size=float("inf")),
        lambda b: b["training"].update(global_batch_size=True),
        lambda b: b["model"].update(name="gpt-350m\ud800"),
        lambda b: b["model"]["config"].update(layers=float("-inf")),
        lambda b: b.update(model={"hf_config": {"architectures": 5}}),
        lambda b: b.update(model={"hf_config": {**_llama_hf(), "max_position_embeddings": "abc"}}),
        lambda b: b.update(model={"hf_config": {**_llama_hf(), "rope_theta": [1]}}),
        lambda b: b.update(model={"hf_config": {**_llama_hf(), "rms_norm_eps": float("nan")}}),
        lambda b: b.update(model={"graph": {"nodes": [], "note": "\ud800"}}),
    ],
)
def test_bad_values_are_422_not_500(idle_client, mutate):
    body = plan_body()
    mutate(body)
    r = _post(idle_client, "/v1/plans", body)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"]


def _llama_hf() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 256,
    }


def test_other_endpoints_refuse_non_finite_numbers(idle_client):
    r = _post(idle_client, "/v1/executions", {"plan_id": "x", "steps": float("nan")})
    assert r.status_code == 422
    profile = load_cluster("cpu-local").model_dump(mode="json")
    profile["device"]["memory_bandwidth"] = float("inf")
    assert _post(idle_client, "/v1/clusters", {**profile, "name": "inf"}).status_code == 422
    profile = load_cluster("cpu-local").model_dump(mode="json")
    r = _post(idle_client, "/v1/clusters", {**profile, "name": "ok", "description": "\ud800"})
    assert r.status_code == 422 and _loc(r)[-1] == "description"


def test_a_chunked_body_over_the_limit_is_413(tmp_path):
    settings = make_settings(tmp_path, max_body_bytes=1 << 20)
    with TestClient(create_app(settings, start_workers=False)) as c:
        blob = json.dumps(plan_body(model={"graph": {"pad": "x" * (2 << 20)}})).encode()
        chunks = (blob[i : i + 65536] for i in range(0, len(blob), 65536))
        r = c.post("/v1/plans", content=chunks, headers={"content-type": "application/json"})
        assert r.status_code == 413


def test_large_bodies_are_parsed_a_few_at_a_time():
    import asyncio

    from api.service.security import BodySizeLimit

    inside, release = asyncio.Event(), asyncio.Event()

    async def slow_app(scope, receive, send):
        await receive()
        inside.set()
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = BodySizeLimit(slow_app, max_bytes=1000, large_bytes=10, max_large=1)

    async def request() -> int:
        sent: list[dict] = []
        body = [{"type": "http.request", "body": b"x" * 100, "more_body": False}]

        async def receive():
            return body.pop() if body else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await app({"type": "http", "method": "POST", "headers": []}, receive, send)
        return sent[0]["status"]

    async def scenario() -> tuple[int, int]:
        first = asyncio.create_task(request())
        await inside.wait()
        second = await request()  # the first is still being handled
        release.set()
        return await first, second

    assert asyncio.run(scenario()) == (200, 503)


# --- 5. a big graph does not stall the server -----------------------------------------------
def test_validating_a_big_graph_does_not_block_other_requests(tmp_path):
    settings = make_settings(tmp_path, max_queued_jobs=4, max_body_bytes=16 << 20)
    nodes = [{"name": f"n{i}", "op": "x", "kind": "other"} for i in range(199_999)]
    graph = {"schema_version": "1", "batch": 1, "seq": 8, "dtype": "fp32", "nodes": nodes}
    body = json.dumps(plan_body(model={"graph": {**graph, "edges": []}}), separators=(",", ":"))
    assert len(body) < settings.max_body_bytes
    with serve(settings, start_workers=False) as url:
        outcome: dict = {}

        def big() -> None:
            r = httpx.post(
                f"{url}/v1/plans",
                content=body,
                headers={"content-type": "application/json"},
                timeout=300,
            )
            outcome["status"] = r.status_code
            outcome["at"] = time.monotonic()

        thread = threading.Thread(target=big)
        thread.start()
        health: list[float] = []
        while thread.is_alive():
            assert httpx.get(f"{url}/healthz", timeout=300).status_code == 200
            health.append(time.monotonic())
        thread.join()
    assert outcome["status"] in (202, 422)
    # Health checks were answered while the big graph was being validated, not after it.
    assert sum(1 for t in health if t < outcome["at"]) >= 3, (len(health), outcome)


# --- 9. strict types, OPTIONS, the schema says what is accepted -----------------------------
def test_options_lists_the_documented_methods(idle_client):
    r = idle_client.options("/v1/plans")
    assert r.status_code == 204 and r.headers["allow"] == "GET, OPTIONS, POST"
    r = idle_client.options("/v1/plans/abc")
    assert r.headers["allow"] == "DELETE, GET, OPTIONS"
    assert idle_client.options("/v1/nothing-here").status_code == 404


def test_the_schema_states_the_one_of_rules_and_name_patterns(idle_client):
    from jsonschema import Draft202012Validator

    spec = idle_client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    model, cluster = schemas["ModelInput"], schemas["ClusterInput"]
    assert len(model["oneOf"]) == 3 and len(cluster["oneOf"]) == 2
    assert "pattern" in model["properties"]["name"]
    assert "pattern" in cluster["properties"]["name"]

    def valid(name: str, doc: dict) -> bool:
        return Draft202012Validator({**schemas[name], "$defs": schemas}).is_valid(doc)

    # Bodies the service refuses, refused by the schema too.
    assert not valid("ModelInput", {"name": "gpt-350m", "graph": {}})
    assert not valid("ModelInput", {})
    assert not valid("ModelInput", {"name": "x\ny"})
    assert not valid("ClusterInput", {"name": "a", "profile": {}})
    assert valid("ModelInput", {"name": "gpt-350m", "config": {"layers": 2}})
    assert valid("ModelInput", {"hf_config": {"model_type": "llama"}, "name": "my-llama"})
    assert not valid("ModelInput", {"hf_config": {}, "name": "my-llama"})  # no model type
    assert not valid("ModelInput", {"name": "gpt-350m", "config": {"experts": 2}})  # MoE's key
    assert not valid("ModelInput", {"name": "not-in-the-zoo"})


def test_a_boolean_is_not_a_number(idle_client):
    for field in ("global_batch_size", "seq_len"):
        body = plan_body()
        body["training"][field] = True
        r = _post(idle_client, "/v1/plans", body)
        assert r.status_code == 422 and _loc(r) == ["body", "training", field]


# --- 3. names are data -------------------------------------------------------------------
def test_a_model_name_cannot_carry_shell_or_yaml(idle_client):
    for name in ("gpt-350m\necho pwned", "a b", "$(id)", "x;rm -rf /"):
        r = _post(idle_client, "/v1/plans", plan_body(model={"name": name}))
        assert r.status_code == 422 and _loc(r)[-1] == "name", name


def test_stored_plans_keep_no_request_path(idle_client, tmp_path):
    """GET /v1/clusters/{name} shows what was stored; nothing in it is a path."""
    profile = load_cluster("cpu-local").model_dump(mode="json")
    assert _post(idle_client, "/v1/clusters", {**profile, "name": "lab"}).status_code == 201
    stored = idle_client.get("/v1/clusters/lab").json()
    assert "op_db" not in json.dumps(stored)
    db = sqlite3.connect(tmp_path / "data" / "autopar.db")
    assert "op_db" not in db.execute("SELECT profile_json FROM clusters").fetchone()[0]


def test_an_old_stored_profile_with_a_path_is_served_without_it(idle_client, tmp_path):
    from api.service.store import ClusterRow

    profile = load_cluster("cpu-local").model_dump(mode="json")
    profile.update(name="old-lab", measured={"op_db": str(tmp_path / "x.db")})
    with idle_client.app.state.store.session() as s:
        s.add(ClusterRow(name="old-lab", profile_json=json.dumps(profile), created_at=1.0))
    assert "op_db" not in idle_client.get("/v1/clusters/old-lab").text
    assert "old-lab" in idle_client.get("/v1/clusters").text
    assert not (tmp_path / "x.db").exists()
