"""The interleaved schedules' orders (torch 2.13's ScheduleInterleaved1F1B and
ScheduleInterleavedZeroBubble), for the micro-batch counts their closed forms
(planner.cost.schedules) do not time: fewer micro-batches than stages, or a count that is not
a whole number of rounds of pp. There the order is replayed (planner.cost.schedule_v.v_time).

torch splits m micro-batches into r = max(1, m // pp) rounds of m / r (it refuses m that r
does not divide). Device d (chunks d, d + pp, ..., v chunks) runs:
    warm-up   w_d = min((v - 1) m / r + k (pp - 1 - d), v m) forwards, k = 2 for 1F1B and
              1 for zero bubble, cycling through its chunks a round at a time;
    steady    v m - w_d pairs: the next forward, then the next backward (full for 1F1B, the
              input gradient for zero bubble), backwards cycling through the chunks from the last;
    cool-down the w_d backwards left.
Zero bubble also runs each backward's weight gradient (W), in backward order: after each
backward once the device has run d of them in the steady phase, the rest at the end.
(tests/executor/test_schedule_orders.py compares these orders with torch's, action by action.)
"""

from __future__ import annotations

import functools
from collections import defaultdict

INTERLEAVED = ("interleaved_1f1b", "interleaved_zero_bubble")


def closed_form_holds(schedule: str, pp: int, microbatches: int) -> bool:
    """Whether the closed forms time (and count) this schedule exactly: whole rounds of pp."""
    return schedule not in INTERLEAVED or pp == 1 or microbatches % pp == 0


@functools.lru_cache(maxsize=16)
def interleaved_order(
    schedule: str, pp: int, microbatches: int, virtual_stages: int
) -> tuple[tuple[tuple[int, str, int], ...], ...]:
    """Per device, its (chunk, kind, micro-batch) actions in the order torch runs them."""
    return tuple(
        _device_order(schedule == "interleaved_zero_bubble", d, pp, microbatches, virtual_stages)
        for d in range(pp)
    )


def _device_order(split: bool, d: int, pp: int, m: int, v: int) -> tuple:
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + (1 if split else 2) * (pp - 1 - d), v * m)
    work = v * m
    next_mb: dict[tuple[str, int], int] = defaultdict(int)
    out: list[tuple[int, str, int]] = []
    backwards: list[int] = []  # chunk of each backward run, for the W passes in that order
    weights_run = 0

    def act(kind: str, chunk: int) -> None:
        out.append((chunk, kind, next_mb[kind, chunk]))
        next_mb[kind, chunk] += 1

    def weight() -> None:
        nonlocal weights_run
        act("W", backwards[weights_run])
        weights_run += 1

    for step in range(work + warmup):
        if step < work:
            act("F", ((step // per_round) % v) * pp + d)
        if step < warmup:
            continue
        chunk = (v - 1 - ((step - warmup) // per_round) % v) * pp + d
        act("B" if split else "BW", chunk)
        backwards.append(chunk)
        if split and step - warmup >= d:
            weight()
    while split and weights_run < len(backwards):
        weight()
    return tuple(out)
