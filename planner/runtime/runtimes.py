"""The runtimes a plan can be predicted for, by name (training.runtime)."""

from __future__ import annotations

from planner.errors import InputError
from planner.runtime.autopar import RUNTIME as AUTOPAR
from planner.runtime.declaration import Runtime
from planner.runtime.deepspeed import RUNTIME as DEEPSPEED
from planner.runtime.megatron import RUNTIME as MEGATRON
from planner.runtime.torchtitan import RUNTIME as TORCHTITAN

RUNTIMES: dict[str, Runtime] = {r.name: r for r in (AUTOPAR, TORCHTITAN, MEGATRON, DEEPSPEED)}


def runtime_of(name: str) -> Runtime:
    if name not in RUNTIMES:
        raise InputError("training.runtime", f"unknown runtime {name!r}", ", ".join(RUNTIMES))
    return RUNTIMES[name]
