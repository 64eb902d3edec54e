"""Cyclic garbage collection paused for a bounded phase that allocates many objects and
frees them by reference counting (loading cached traces, the search).

CPython's collector runs every few hundred net allocations and, every tenth and hundredth
time, scans older generations; in a process that has imported torch and holds a traced
graph those scans walk hundreds of thousands of live objects that cannot be garbage. For a
warm gpt-39b search they took ~0.3 s of ~1.3 s (bench/results/search_scale.md). Objects
without reference cycles are still freed at once while collection is paused; what the phase
leaves in cycles is collected by the next collection after it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collection_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block (nested uses keep it paused to the end)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
