"""No predicted pipeline beats its critical path: for every schedule, small pp, chunks per
device and micro-batch counts torch runs, and random per-chunk forward (F), input-gradient (B)
and weight-gradient (W) times, the step time the evaluator uses (pipeline_span) is at least
- one micro-batch's path: its forwards through every chunk, its backwards back, and at least
  one weight gradient after the last input gradient, and
- each device's work: m micro-batches of all its chunks' F + B + W.
(With one micro-batch nothing overlaps: an interleaved schedule used to be priced at a
fraction of that.)"""

import random

import pytest

from planner.cost.schedule_v import V_SHAPED, device_of_chunk, replayed, v_time
from planner.cost.schedules import WEIGHT_SPLIT, pipeline_span
from planner.parallel.pipeline import not_runnable
from planner.vocab import SCHEDULES


def _chunks_per_device(schedule: str) -> tuple[int, ...]:
    if schedule in V_SHAPED:
        return (2,)
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return (2, 3)
    if schedule == "interleaved_zero_bubble":
        return (1, 2, 3)
    return (1,)


CASES = [
    (schedule, pp, v, m)
    for schedule in SCHEDULES
    for pp in (2, 3, 4)
    for v in _chunks_per_device(schedule)
    for m in range(1, 9)
    if not_runnable(schedule, pp, m) is None
]


@pytest.mark.parametrize(("schedule", "pp", "v", "m"), CASES)
def test_no_schedule_beats_its_critical_path(schedule, pp, v, m):
    rng = random.Random(f"{schedule}-{pp}-{v}-{m}")
    for _ in range(3):
        chunks = [
            (rng.uniform(0.5, 2.0), rng.uniform(0.5, 3.0), rng.uniform(0.1, 0.5))
            for _ in range(pp * v)
        ]
        devices = [device_of_chunk(schedule, c, pp) for c in range(pp * v)]
        stage_times = [
            sum(sum(t) for t, d in zip(chunks, devices, strict=True) if d == s) for s in range(pp)
        ]
        weight_grad = None
        if schedule in WEIGHT_SPLIT:
            weight_grad = [
                sum(t[2] for t, d in zip(chunks, devices, strict=True) if d == s) for s in range(pp)
            ]
        span, bubble = pipeline_span(schedule, stage_times, m, v, weight_grad, lambda c=chunks: c)
        one_microbatch = sum(f + b for f, b, _ in chunks) + min(w for *_, w in chunks)
        work = m * max(stage_times)
        assert span >= max(one_microbatch, work) * (1 - 1e-9), (span, one_microbatch, work)
        if replayed(schedule, pp, m):  # whatever shortcut is taken, the replay's answer
            assert span == pytest.approx(v_time(schedule, chunks, m, pp), rel=1e-12)
        assert 0.0 <= bubble < 1.0
