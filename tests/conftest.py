"""Shared fixtures: small traced graphs are cached per session (tracing is deterministic)."""

from __future__ import annotations

import functools
import os
import tempfile

import pytest

from planner.graph.tracing import trace_model
from planner.models import ModelSpec, resolve

# One disk cache (planner.disk_cache) per test session, shared by subprocesses: tests never
# read or write the user's ~/.cache, and repeated traces within a session are reused.
os.environ.setdefault("AUTOPAR_CACHE_DIR", tempfile.mkdtemp(prefix="autopar-test-cache-"))


@functools.cache
def traced(name: str, batch: int = 2, seq: int | None = None, dtype: str = "bf16", **config):
    return trace_model(resolve(ModelSpec(name=name, config=config)), batch, seq, dtype)


@pytest.fixture(scope="session")
def small_gpt():
    """A 4-layer GPT small enough to trace in well under a second."""
    return traced("gpt-350m", batch=2, seq=64, layers=4, hidden=256, heads=4)
