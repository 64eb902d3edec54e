"""Memory headroom: device memory a plan leaves free.

A plan predicted at 79.7 of 80 GiB runs out of memory in practice: the caching allocator
keeps freed blocks it cannot reuse for a larger request (fragmentation), and NCCL and the
CUDA context take memory no trace shows. Serving and runtime stacks leave a share free by
default (vLLM's `gpu_memory_utilization` 0.9, Ascend's `mem_utilization` 0.95); autopar keeps
`DEFAULT_HEADROOM` (5%) free unless the request says otherwise: a fraction ("0.08", "8%") or
an amount ("4GiB", "512MiB"); 0 plans to the last byte, as the bare datasheet figure does.
"""

from __future__ import annotations

import re

from planner.cluster.profile import ClusterProfile
from planner.errors import InputError

DEFAULT_HEADROOM = 0.05
EXPECTED = 'a fraction of device memory in [0, 0.9] ("0.05", "5%") or an amount ("4GiB", "512MiB")'
_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# The forms a headroom takes, as the API's schema states them (no flags, ASCII classes, as
# JSON Schema's regex reads them too); the parser strips the spaces and matches the rest whole
# (linear in its length), after refusing longer texts.
HEADROOM_PATTERN = r"^[ \t\r\n]*[0-9]+(\.[0-9]+)?( *%| *[kKmMgGtT][iI][bB])?[ \t\r\n]*$"
_AMOUNT = re.compile(r"([0-9]+(?:\.[0-9]+)?) *([kKmMgGtT][iI][bB])")
_PERCENT = re.compile(r"([0-9]+(?:\.[0-9]+)?) *%")
_FRACTION = re.compile(r"[0-9]+(?:\.[0-9]+)?")
MAX_HEADROOM_CHARS = 64


def headroom_bytes(value: float | str | None, memory_bytes: int, field: str) -> int:
    """The bytes per device `value` keeps free of `memory_bytes` (None: the default)."""
    if value is None:
        value = DEFAULT_HEADROOM
    if isinstance(value, bool):
        raise InputError(field, f"{value!r}", EXPECTED)
    fraction: float | None = None
    if isinstance(value, str):
        if len(value) > MAX_HEADROOM_CHARS:
            raise InputError(field, f"{len(value)} characters", EXPECTED)
        value = value.strip(" \t\r\n")
    if isinstance(value, int | float):
        fraction = float(value)
    elif isinstance(value, str) and (m := _PERCENT.fullmatch(value)):
        fraction = float(m.group(1)) / 100
    elif isinstance(value, str) and (m := _AMOUNT.fullmatch(value)):
        amount = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if amount >= memory_bytes * 0.9:
            raise InputError(
                field, f"{value!r} leaves less than a tenth of the device's memory", EXPECTED
            )
        return amount
    elif isinstance(value, str) and _FRACTION.fullmatch(value):
        fraction = float(value)
    elif isinstance(value, str):
        raise InputError(field, f"{value!r} is not a fraction or an amount", EXPECTED)
    else:
        raise InputError(field, f"{value!r}", EXPECTED)
    if not 0 <= fraction <= 0.9:
        raise InputError(field, f"{value!r} is outside [0, 0.9] of device memory", EXPECTED)
    return int(memory_bytes * fraction)


def with_headroom(
    cluster: ClusterProfile, value: float | str | None, field: str = "cluster.memory_headroom"
) -> ClusterProfile:
    """The profile with `value`'s headroom kept free (replacing any it carried)."""
    kept = headroom_bytes(value, cluster.device.memory_bytes, field)
    if kept == cluster.memory_headroom_bytes:
        return cluster
    return cluster.model_copy(update={"memory_headroom_bytes": kept})
