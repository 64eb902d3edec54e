"""Checks of a request body beyond its schema, done before a job is queued.

- Values JSON cannot round-trip (NaN, Infinity, lone surrogates) are refused wherever they
  sit, naming the path.
- A graph body is validated in a separate process (one at a time, under the worker memory
  limit): pydantic validates a 200,000-node graph in one call that holds the GIL for
  seconds, which would stall every other request of the server.
- The planning work is estimated (planner/search/work.py) and a request that the per-job time limit
  would cut is refused up front, naming what is too big.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from typing import Any

from executor.lifetime import safe_path
from planner.errors import InputError


def check_values(obj: Any, field: str = "body") -> None:
    """Refuse non-finite numbers and strings that are not valid Unicode, anywhere in `obj`."""
    stack: list[tuple[Any, str]] = [(obj, field)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(where, f"{value} is not a finite number", "a finite number")
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(str(key), where)
                stack.append((item, f"{where}.{key}"))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(value))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        safe = where.encode("utf-8", "backslashreplace").decode()
        raise InputError(safe, "contains a lone surrogate", "valid Unicode text") from None


def _graph_summary(text: str, field: str) -> dict[str, int]:
    """In the validation process: parse and validate the graph; its size for the estimate."""
    from planner.graph.batch import cluster_layers
    from planner.graph.opgraph import OpGraph

    graph = OpGraph.from_json(text, field=field)
    return {"nodes": len(graph.nodes), "layers": cluster_layers(graph).num_layers}


def _init_worker(memory_bytes: int, parent: int) -> None:
    from executor.lifetime import exit_when_gone, limit_memory

    # Not PR_SET_PDEATHSIG: the pool is started from whichever request thread validated
    # first, and that signal comes when the thread (not the server) ends.
    exit_when_gone(parent)
    limit_memory(memory_bytes)


class GraphValidator:
    """A one-process pool, started on first use and restarted if a graph killed it."""

    def __init__(self, memory_bytes: int):
        self.memory_bytes = memory_bytes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def summary(self, text: str, field: str = "model.graph") -> dict[str, int]:
        """The graph's size; a pool found dead (its process killed from outside) is
        restarted once before the graph is blamed."""
        for attempt in range(2):
            pool = self._running_pool()
            try:
                with safe_path():  # the pool starts its process at a submit
                    future = pool.submit(_graph_summary, text, field)
                return future.result()
            except MemoryError:
                raise InputError(field, "too large to validate", "a smaller graph") from None
            except BrokenProcessPool:
                with self._lock:
                    if self._pool is pool:
                        self._pool = None
                if attempt == 1:
                    raise InputError(field, "too large to validate", "a smaller graph") from None
        raise AssertionError("unreachable")

    def _running_pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    1,
                    mp_context=get_context("spawn"),
                    initializer=_init_worker,
                    initargs=(self.memory_bytes, os.getpid()),
                )
            return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
