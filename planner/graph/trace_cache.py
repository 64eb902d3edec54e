"""Traces from the on-disk cache (planner.disk_cache), keyed by the model (family, name,
resolved config), sequence, dtype and micro-batch; a miss traces and stores. trace_batches
traces the misses of several micro-batch sizes side by side in forked processes."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from planner import disk_cache
from planner.gc_pause import collection_paused
from planner.graph.opgraph import OpGraph


def trace_batches(
    resolved: Any, batches: tuple[int, ...], seq: int, dtype: str, workers: int = 1
) -> list[OpGraph]:
    """trace_cached at each batch; with workers > 1, misses beyond the first are traced in
    forked processes while this one traces the first (each writes its trace to the cache)."""
    found = {b: _load(resolved, b, seq, dtype) for b in batches}
    missing = [b for b in batches if found[b] is None]
    if workers <= 1 or len(missing) < 2:
        return [found[b] or trace_cached(resolved, b, seq, dtype) for b in batches]
    global _FORKED
    _FORKED = (resolved, seq, dtype)
    try:
        with ProcessPoolExecutor(min(workers, len(missing)) - 1 or 1, get_context("fork")) as ex:
            others = ex.map(_trace_in_worker, missing[1:])
            found[missing[0]] = trace_cached(resolved, missing[0], seq, dtype)
            for b, payload in zip(missing[1:], others, strict=True):
                found[b] = OpGraph.from_dict(payload)
    finally:
        _FORKED = None
    return [found[b] for b in batches]


_FORKED: tuple | None = None  # (resolved model, seq, dtype) for trace_batches' workers


def _trace_in_worker(batch: int) -> dict:
    assert _FORKED is not None, "trace_batches sets the model before forking"
    resolved, seq, dtype = _FORKED
    return trace_cached(resolved, batch, seq, dtype).to_dict()


def _key(resolved: Any, batch: int, seq: int, dtype: str) -> str:
    model = resolved.with_seq(seq)
    material = {
        "family": model.family.name,
        "name": model.name,
        "config": model.config_dict(),
        "seq": seq,
        "dtype": dtype,
        "batch": batch,
    }
    return disk_cache.key_of("trace", material)


def _load(resolved: Any, batch: int, seq: int, dtype: str) -> OpGraph | None:
    with collection_paused():
        payload = disk_cache.load("trace", _key(resolved, batch, seq, dtype))
        if payload is not None:
            try:
                return OpGraph.from_dict(payload)
            except Exception:
                pass  # an entry from a graph format this code does not read: traced again
    return None


def trace_model(resolved: Any, batch: int, seq: int, dtype: str) -> OpGraph:
    """planner.graph.tracing's, imported on a miss: a warm plan loads no torch."""
    from planner.graph.tracing import trace_model as trace

    return trace(resolved, batch, seq, dtype)


def trace_cached(resolved: Any, batch: int, seq: int, dtype: str) -> OpGraph:
    graph = _load(resolved, batch, seq, dtype)
    if graph is None:
        graph = trace_model(resolved, batch, seq, dtype)
        disk_cache.store("trace", _key(resolved, batch, seq, dtype), graph.to_dict())
    return graph
