"""Pipeline schedules: step time from per-stage times, bubble, in-flight micro-batches.

With per-micro-batch stage times t_1..t_p (forward + backward on one device) and m
micro-batches, GPipe and 1F1B take (Alpa, eq. 2; Narayanan et al. 2021 section 2.2)
    T = (m - 1) * max_j t_j + sum_j t_j
which for uniform stages is (m + p - 1) t, a bubble of (p - 1) / (m + p - 1). The interleaved
1F1B schedule with v model chunks per device shrinks the fill and drain by v:
    T = m * max_j t_j + (sum_j t_j - max_j t_j) / v      (bubble (p - 1) / (v m) relative).
Activation memory: GPipe keeps all m micro-batches in flight; 1F1B keeps at most p - s on
stage s (0-based); interleaved keeps (p - s) (1 + (p - 1) / (p v)) chunk-equivalents
(Korthikanti et al. 2022, section 4.2.3, for the first stage).
"""

from __future__ import annotations

import functools

from planner.errors import InputError
from planner.vocab import SCHEDULES


def check_schedule(name: str, virtual_stages: int) -> None:
    if name not in SCHEDULES:
        raise InputError("schedule.name", f"unknown schedule {name!r}", ", ".join(SCHEDULES))
    if virtual_stages < 1:
        raise InputError("schedule.virtual_stages", f"{virtual_stages} is not >= 1", ">= 1")
    if name != "interleaved_1f1b" and virtual_stages != 1:
        raise InputError(
            "schedule.virtual_stages",
            f"{name} has one chunk per device",
            "1, or schedule interleaved_1f1b",
        )


def pipeline_time(stage_times: list[float], microbatches: int, virtual_stages: int = 1) -> float:
    if not stage_times:
        return 0.0
    slowest = max(stage_times)
    total = sum(stage_times)
    if virtual_stages == 1:
        return (microbatches - 1) * slowest + total
    return microbatches * slowest + (total - slowest) / virtual_stages


def bubble_fraction(stage_times: list[float], microbatches: int, virtual_stages: int = 1) -> float:
    """Idle share of the pipeline time, averaged over devices."""
    span = pipeline_time(stage_times, microbatches, virtual_stages)
    if span <= 0:
        return 0.0
    busy = microbatches * sum(stage_times) / len(stage_times)
    return max(0.0, 1.0 - busy / span)


@functools.cache  # called per stage of every configuration the search evaluates
def inflight_microbatches(
    schedule: str, stage: int, stages: int, microbatches: int, virtual_stages: int = 1
) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak (in units of its
    whole share of layers)."""
    if schedule == "gpipe":
        return float(microbatches)
    depth = min(stages - stage, microbatches)
    if schedule == "interleaved_1f1b" and virtual_stages > 1:
        return min(float(microbatches), depth * (1 + (stages - 1) / (stages * virtual_stages)))
    return float(depth)
