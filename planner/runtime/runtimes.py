"""The runtimes a plan can be predicted for, by name (training.runtime)."""

from __future__ import annotations

from planner.errors import InputError
from planner.runtime import autopar, deepspeed, megatron, torchtitan
from planner.runtime.declaration import Runtime

RUNTIMES: dict[str, Runtime] = {
    r.name: r for r in (autopar.RUNTIME, torchtitan.RUNTIME, megatron.RUNTIME, deepspeed.RUNTIME)
}


def runtime_of(name: str) -> Runtime:
    if name not in RUNTIMES:
        raise InputError("training.runtime", f"unknown runtime {name!r}", ", ".join(RUNTIMES))
    return RUNTIMES[name]
