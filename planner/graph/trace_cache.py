"""Traces from the on-disk cache (planner.disk_cache), keyed by the model (family, name,
resolved config), sequence, dtype and micro-batch; a miss traces and stores."""

from __future__ import annotations

from typing import Any

from planner import disk_cache
from planner.graph.opgraph import OpGraph
from planner.graph.tracing import trace_model


def trace_cached(resolved: Any, batch: int, seq: int, dtype: str) -> OpGraph:
    model = resolved.with_seq(seq)
    material = {
        "family": model.family.name,
        "name": model.name,
        "config": model.config_dict(),
        "seq": seq,
        "dtype": dtype,
        "batch": batch,
    }
    key = disk_cache.key_of("trace", material)
    payload = disk_cache.load("trace", key)
    if payload is not None:
        try:
            return OpGraph.from_dict(payload)
        except Exception:
            pass
    graph = trace_model(resolved, batch, seq, dtype)
    disk_cache.store("trace", key, graph.to_dict())
    return graph
