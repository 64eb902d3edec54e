"""Property-based fuzz of POST /v1/plans (hypothesis): valid bodies with a few fields replaced
by hostile values (NaN, Infinity, huge or negative numbers, lone surrogates, wrong types,
unknown keys). Whatever is sent: never a 5xx; and a body the service accepts plans to an
outcome (done, infeasible, or an error naming a field), never an internal error."""

from __future__ import annotations

import contextlib
import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.service.app import create_app
from api.service.store import Store
from planner.errors import AutoparError
from tests.service.conftest import make_settings, plan_body

PATHS = [
    ("model", "name"),
    ("model", "config", "layers"),
    ("model", "config", "hidden"),
    ("model", "config", "heads"),
    ("model", "config", "vocab"),
    ("model", "config", "seq_len"),
    ("model", "config", "tie_embeddings"),
    ("model", "hf_config"),
    ("model", "graph"),
    ("cluster", "name"),
    ("cluster", "nodes"),
    ("training", "global_batch_size"),
    ("training", "seq_len"),
    ("training", "dtype"),
    ("training", "optimizer"),
    ("search", "top_k"),
    ("search", "mesh"),
    ("search", "zero"),
    ("search", "microbatch_size"),
    ("search", "unknown"),
]

scalars = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=0, max_value=64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, 2**63, 0, -1]),
    st.text(alphabet=st.characters(codec=None), max_size=20),
    st.sampled_from(["\ud800", "gpt-350m\n", "cpu-local", "../../etc/passwd", "fp8", ""]),
    st.booleans(),
    st.none(),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
mutations = st.lists(st.tuples(st.sampled_from(PATHS), values), min_size=1, max_size=3)


def _mutated(changes) -> dict:
    body = plan_body(search={"baselines": False})
    for path, value in changes:
        node = body
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[path[-1]] = value
    return body


@pytest.fixture(scope="module")
def fuzz_client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    with TestClient(
        create_app(make_settings(tmp, job_time_limit_s=30, max_queued_jobs=10_000), False),
        raise_server_exceptions=False,
    ) as client:
        client.accepted = {}
        yield client


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(changes=mutations)
def test_no_body_gets_a_server_error(fuzz_client, changes):
    text = json.dumps(_mutated(changes), allow_nan=True)
    r = fuzz_client.post("/v1/plans", content=text, headers={"content-type": "application/json"})
    assert r.status_code < 500, (text[:500], r.text[:500])
    if r.status_code in (200, 202):
        fuzz_client.accepted[r.json()["id"]] = text
    else:
        assert r.status_code in (413, 422), r.text
        assert r.json()["detail"]


def test_accepted_fuzzed_bodies_plan_without_an_internal_error(fuzz_client):
    """Run the planning of a few accepted fuzzed bodies (those that differ from the plain
    body) as the worker would; each ends in a plan, or an error meant for the user."""
    from api.service.planning import plan_stored

    if not fuzz_client.accepted:  # run on its own: fuzz first
        test_no_body_gets_a_server_error(fuzz_client)
    plain = json.dumps(plan_body(search={"baselines": False}))
    store: Store = fuzz_client.app.state.store
    tried = 0
    for plan_id, text in fuzz_client.accepted.items():
        if text == plain or tried >= 3:
            continue
        stored = json.loads(store.get_plan(plan_id).request_json)
        tried += 1
        # A failed or infeasible job carries a message naming what is wrong (AutoparError);
        # anything else would reach the user as an internal error.
        with contextlib.suppress(AutoparError):
            plan_stored(stored["request"], stored["profile"], lambda *_: None)
    assert fuzz_client.accepted, "no fuzzed body was accepted: the fuzz tests nothing valid"
