"""Shared fixtures: small traced graphs are cached per session (tracing is deterministic)."""

from __future__ import annotations

import functools
import os
import tempfile
from collections import Counter

import pytest

from planner.graph.tracing import trace_model
from planner.models import ModelSpec, resolve

# One disk cache (planner.disk_cache) per test session, shared by subprocesses: tests never
# read or write the user's ~/.cache, and repeated traces within a session are reused.
os.environ.setdefault("AUTOPAR_CACHE_DIR", tempfile.mkdtemp(prefix="autopar-test-cache-"))


# Files whose few tests take minutes (a fresh clone's `make test`, --durations): sent to the
# pytest-xdist workers first, so that none is left running one alone at the end. The rest
# keep xdist's own order, most tests first (the Makefile turns xdist's reordering off, which
# would otherwise put these one-test files last).
SLOW_FILES = (
    "tests/service/test_schemathesis.py",
    "tests/api/test_deepspeed_config.py",
    "tests/service/test_replicas.py",
    "tests/service/test_hostile_clients.py",
    "tests/executor/test_example.py",
    "tests/planner/test_hf_planning.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    files = [item.nodeid.split("::")[0] for item in items]
    counts = Counter(files)
    first = {f: i for i, f in enumerate(SLOW_FILES)}
    keys = [(first.get(f, len(first)), -counts[f]) for f in files]
    ordered = sorted(zip(keys, range(len(items)), items, strict=True))  # a file's tests in order
    items[:] = [item for *_, item in ordered]


@functools.cache
def traced(name: str, batch: int = 2, seq: int | None = None, dtype: str = "bf16", **config):
    return trace_model(resolve(ModelSpec(name=name, config=config)), batch, seq, dtype)


@pytest.fixture(scope="session")
def small_gpt():
    """A 4-layer GPT small enough to trace in well under a second."""
    return traced("gpt-350m", batch=2, seq=64, layers=4, hidden=256, heads=4)


def planning_inputs(model: dict, training: dict, cluster: str = "dgx-a100-80g", memory_gib=None):
    """A request traced for the search, on a bundled profile whose device memory may be set."""
    from planner.cluster.profile import load_cluster
    from planner.request import resolve_request

    profile = load_cluster(cluster)
    if memory_gib is not None:
        device = profile.device.model_copy(update={"memory_bytes": int(memory_gib * 2**30)})
        profile = profile.model_copy(update={"device": device})
    return resolve_request(model, profile, training).trace()
