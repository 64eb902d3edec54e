"""Pipeline schedules: step time from per-stage times, bubble, in-flight micro-batches.

With per-micro-batch stage times t_1..t_p (forward + backward on one device) and m
micro-batches, GPipe and 1F1B take (Alpa, eq. 2; Narayanan et al. 2021 section 2.2)
    T = (m - 1) * max_j t_j + sum_j t_j
which for uniform stages is (m + p - 1) t, a bubble of (p - 1) / (m + p - 1). The interleaved
1F1B schedule with v model chunks per device shrinks the fill and drain by v:
    T = m * max_j t_j + (sum_j t_j - max_j t_j) / v      (bubble (p - 1) / (v m) relative).
The interleaved zero-bubble schedule (torch's ScheduleInterleavedZeroBubble, the ZB-1p schedule
of Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 2.1, with v chunks per device)
splits each backward into the input gradient (B) and the weight gradient (W) and runs the W
passes in the drain, so a stage's fill and drain carry t_j - 2 w_j (w_j: its weight-gradient
time per micro-batch; ZB-H1's (p - 1)(T_F + T_B - T_W) for uniform stages):
    T = m * max_j t_j + (sum_j (t_j - 2 w_j) - max_j (t_j - 2 w_j)) / v
Activation memory, in micro-batches of a device's whole share of layers: GPipe keeps all m;
1F1B keeps min(m, p - s) on stage s (0-based); interleaved 1F1B keeps
min(m, p + (p - 1 - 2 s) / v) (Korthikanti et al. 2022, section 4.2.3, give the first stage's);
the zero-bubble schedule keeps min(m, p) on every stage (a micro-batch's activations live until
its W pass; between its B and W passes its weight gradients' inputs wait too:
split_backward_points). ZB-V and DualPipeV (two chunks per device in a V) are timed by
replaying their orders:
planner.cost.schedule_v. The interleaved closed forms hold for whole rounds of pp micro-batches
(m a multiple of p); for fewer micro-batches than stages, or a partial round, the interleaved
schedules are replayed too, from their orders (planner.cost.schedule_interleaved): with one
micro-batch nothing overlaps, which the closed forms miss. These step times and counts are those
of torch's own action lists (tests/executor/test_schedule_orders.py replays them with no
communication), and no schedule's step time beats its critical path
(tests/planner/test_schedule_bounds.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from planner.cost.schedule_v import (
    DUALPIPE_V,
    LOOPED_BFS,
    V_SHAPED,
    ZBV,
    replayed,
    v_inflight,
    v_split_points,
    v_time,
)
from planner.errors import InputError
from planner.vocab import SCHEDULES

# Schedules that run several model chunks per device (v >= 2; the zero-bubble one also v = 1;
# ZB-V and DualPipeV exactly 2, in a V; Looped BFS any: planner.cost.schedule_v).
MULTI_CHUNK = ("interleaved_1f1b", "interleaved_zero_bubble", ZBV, DUALPIPE_V, LOOPED_BFS)
# Schedules that split each backward into input and weight gradients (w_j above).
WEIGHT_SPLIT = ("interleaved_zero_bubble", ZBV, DUALPIPE_V)


def check_schedule(name: str, virtual_stages: int) -> None:
    if name not in SCHEDULES:
        raise InputError("schedule.name", f"unknown schedule {name!r}", ", ".join(SCHEDULES))
    if virtual_stages < 1:
        raise InputError("schedule.virtual_stages", f"{virtual_stages} is not >= 1", ">= 1")
    if name in V_SHAPED and virtual_stages != 2:
        raise InputError(
            "schedule.virtual_stages", f"{name} runs 2 chunks per device, not {virtual_stages}", "2"
        )
    if name not in MULTI_CHUNK and virtual_stages != 1:
        raise InputError(
            "schedule.virtual_stages",
            f"{name} has one chunk per device",
            f"1, or schedule {' or '.join(MULTI_CHUNK)}",
        )


def pipeline_time(
    stage_times: list[float],
    microbatches: int,
    virtual_stages: int = 1,
    weight_grad: list[float] | None = None,
) -> float:
    """Step time of the pipeline (module docstring); `weight_grad`: per stage, the weight-
    gradient part of its time for a schedule in WEIGHT_SPLIT."""
    if not stage_times:
        return 0.0
    slowest = max(stage_times)
    if weight_grad is not None:
        short = [t - 2 * w for t, w in zip(stage_times, weight_grad, strict=True)]
        return microbatches * slowest + (sum(short) - max(short)) / virtual_stages
    total = sum(stage_times)
    if virtual_stages == 1:
        return (microbatches - 1) * slowest + total
    return microbatches * slowest + (total - slowest) / virtual_stages


def pipeline_span(
    schedule: str,
    stage_times: list[float],
    microbatches: int,
    virtual_stages: int,
    weight_grad: list[float] | None,
    chunk_times: Callable[[], list[tuple[float, float, float]]],
) -> tuple[float, float]:
    """(step time, bubble fraction) of the pipeline: the closed forms where they hold, else the
    replay of the schedule's order with `chunk_times()`, (F, B, W) per chunk in pipeline order."""
    pp = len(stage_times)
    if microbatches == 1 and schedule not in WEIGHT_SPLIT:
        # one micro-batch's forwards and backwards are one chain through every chunk: nothing
        # overlaps, whatever the order (the replay's answer, without replaying)
        span = float(sum(stage_times))
    elif replayed(schedule, pp, microbatches):
        span = v_time(schedule, chunk_times(), microbatches, pp)
    else:
        span = pipeline_time(stage_times, microbatches, virtual_stages, weight_grad)
    return span, idle_share(stage_times, microbatches, span)


def bubble_fraction(
    stage_times: list[float],
    microbatches: int,
    virtual_stages: int = 1,
    weight_grad: list[float] | None = None,
) -> float:
    """Idle share of the pipeline time, averaged over devices."""
    span = pipeline_time(stage_times, microbatches, virtual_stages, weight_grad)
    return idle_share(stage_times, microbatches, span)


def idle_share(stage_times: list[float], microbatches: int, span: float) -> float:
    """Idle share of a pipeline that takes `span`, averaged over devices."""
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
    if replayed(schedule, stages, microbatches):
        return v_inflight(schedule, stage, stages, microbatches, virtual_stages)
    if schedule == "interleaved_zero_bubble":
        return float(min(stages, microbatches))
    if schedule == "interleaved_1f1b" and virtual_stages > 1:
        return min(float(microbatches), stages + (stages - 1 - 2 * stage) / virtual_stages)
    return float(min(stages - stage, microbatches))


@functools.cache  # called per stage of every configuration the search evaluates
def split_backward_points(
    schedule: str, stage: int, stages: int, microbatches: int, virtual_stages: int = 1
) -> tuple[tuple[float, float], ...]:
    """Under a schedule in WEIGHT_SPLIT, (held, pending) pairs along stage `stage`'s order,
    in units of its whole share of layers: micro-batches whose activations it holds (F to W)
    and those whose weight gradients wait (B to W), each pair one the other pairs do not
    exceed in both; empty for the other schedules. In torch's interleaved zero-bubble order
    both peak together, pending then min(s + 1, v m) / v on stage s (tests/executor/
    test_schedule_orders.py replays torch's orders)."""
    if schedule not in WEIGHT_SPLIT:
        return ()
    if replayed(schedule, stages, microbatches):
        return v_split_points(schedule, stages, microbatches, virtual_stages)[stage]
    if schedule == "interleaved_zero_bubble":
        held = inflight_microbatches(schedule, stage, stages, microbatches, virtual_stages)
        return ((held, min(stage + 1, virtual_stages * microbatches) / virtual_stages),)
    return ()


def pending_weight_bytes(points, held_peak: float, per_microbatch: float, stash: int) -> int:
    """What a split backward adds to `held_peak` micro-batches of `per_microbatch` bytes: at
    the worst of `points` (split_backward_points), its held micro-batches and the weight
    gradients' waiting inputs (`stash` bytes per micro-batch: NodeCost.wgrad_stash)."""
    extra = (((held - held_peak) * per_microbatch + pending * stash) for held, pending in points)
    return int(max([0.0, *extra]))
