"""The V-shaped zero-bubble schedule (ZB-V; torch's ScheduleZBVZeroBubble), timed exactly.

ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6) gives each of the p devices
two model chunks placed in a V: device d holds chunk d and chunk 2p - 1 - d, so the last
chunk's output turns back on device 0 and the first device holds the embedding and the head.
Each backward is split into the input gradient (B) and the weight gradient (W); W passes fill
what would be the drain. The bubble has no closed form once F, B and W differ (the order's
critical path changes with their ratios), so this module builds the order torch 2.13 runs on
every device and takes the step time as the longest path through it: with the order per
device fixed and each action starting once its device is free and its inputs are there, the
makespan is the heaviest chain of actions linked by device order or data dependence.

The order per device d (chunk0 = d, chunk1 = 2p - 1 - d; m micro-batches, the phases sized
for n = max(m, 2p - 1) and actions past m dropped):
    warm-up   2(p - d) - 1 forwards of chunk0; d pairs F(chunk1) F(chunk0);
              p - d triples F B W of chunk1
    steady    F B W of chunk0 (F while chunk0 has forwards left), then F B W of chunk1,
              while chunk1 trails chunk0 or chunk0 has forwards left
    cool-down d pairs B(chunk0) B(chunk1); p - d pairs B(chunk0) W(chunk0);
              then the W passes left, chunk1's first
(tests/executor/test_schedule_orders.py compares this order with torch's own, action by
action, and the replayed step time and memory with these functions.)
Activation memory: a micro-batch's chunk activations live from its F to its W; the peak count
per device is read off its order, in units of the device's two chunks.
"""

from __future__ import annotations

import functools

ZBV = "zbv_zero_bubble"
V_SHAPED = (ZBV,)
_KIND = {"F": 0, "B": 1, "W": 2}


def device_of_chunk(schedule: str, chunk: int, pp: int) -> int:
    """The device (pipeline stage) running `chunk`: chunk % pp, or in a V for V_SHAPED."""
    if schedule in V_SHAPED and chunk >= pp:
        return 2 * pp - 1 - chunk
    return chunk % pp


def chunks_of_device(schedule: str, device: int, pp: int, virtual_stages: int) -> list[int]:
    """The chunks device `device` runs, in pipeline order."""
    chunks = range(pp * virtual_stages)
    return [c for c in chunks if device_of_chunk(schedule, c, pp) == device]


@functools.cache
def zbv_order(pp: int, microbatches: int) -> tuple[tuple[tuple[int, str, int], ...], ...]:
    """Per device, its actions (chunk, "F" | "B" | "W", micro-batch) in the order it runs them."""
    return tuple(_device_order(d, pp, microbatches) for d in range(pp))


def _device_order(d: int, p: int, m: int) -> tuple[tuple[int, str, int], ...]:
    n = max(m, 2 * p - 1)
    c0, c1 = d, 2 * p - 1 - d
    nxt = {(c, k): 0 for c in (c0, c1) for k in "FBW"}
    out: list[tuple[int, str, int]] = []

    def add(*steps: tuple[int, str]) -> None:
        for c, k in steps:
            out.append((c, k, nxt[c, k]))
            nxt[c, k] += 1

    add(*[(c0, "F")] * (2 * (p - d) - 1))
    for _ in range(d):
        add((c1, "F"), (c0, "F"))
    for _ in range(p - d):
        add((c1, "F"), (c1, "B"), (c1, "W"))
    while nxt[c1, "F"] < nxt[c0, "F"] or nxt[c0, "F"] < n:
        if nxt[c0, "F"] < n:
            add((c0, "F"))
        add((c0, "B"), (c0, "W"), (c1, "F"), (c1, "B"), (c1, "W"))
    for _ in range(d):
        add((c0, "B"), (c1, "B"))
    for _ in range(p - d):
        add((c0, "B"), (c0, "W"))
    add(*[(c1, "W")] * (nxt[c1, "B"] - nxt[c1, "W"]))
    add(*[(c0, "W")] * (nxt[c0, "B"] - nxt[c0, "W"]))
    return tuple(a for a in out if a[2] < m)


@functools.cache
def _graph(pp: int, microbatches: int) -> tuple[tuple[int, int, int], ...]:
    """The order's actions as (weight index 3 * chunk + kind, index of the device's previous
    action, index of the action whose output it needs), each after those it depends on."""
    order = zbv_order(pp, microbatches)
    last_chunk = 2 * pp - 1
    index: dict[tuple[int, str, int], int] = {}
    out: list[tuple[int, int, int]] = []
    at = [0] * pp
    prev = [-1] * pp
    while len(out) < sum(len(o) for o in order):
        moved = False
        for d in range(pp):
            while at[d] < len(order[d]):
                c, k, mb = order[d][at[d]]
                if k == "F":
                    need = (c - 1, "F", mb) if c else None
                elif k == "B":
                    need = (c, "F", mb) if c == last_chunk else (c + 1, "B", mb)
                else:
                    need = (c, "B", mb)
                if need is not None and need not in index:
                    break
                index[c, k, mb] = len(out)
                out.append((3 * c + _KIND[k], prev[d], -1 if need is None else index[need]))
                prev[d] = len(out) - 1
                at[d] += 1
                moved = True
        if not moved:
            raise AssertionError(f"the ZB-V order deadlocks (pp={pp}, m={microbatches})")
    return tuple(out)


def zbv_time(chunk_times: list[tuple[float, float, float]], microbatches: int) -> float:
    """Step time of the pipeline: `chunk_times[c]` = (F, B, W) of chunk c for one micro-batch
    (2 pp chunks in pipeline order), no time between devices beyond what the chunks carry."""
    pp = len(chunk_times) // 2
    weights = [t for fbw in chunk_times for t in fbw]
    finish: list[float] = []
    for w, prev, need in _graph(pp, microbatches):
        start = finish[prev] if prev >= 0 else 0.0
        if need >= 0 and finish[need] > start:
            start = finish[need]
        finish.append(start + weights[w])
    return max(finish, default=0.0)


@functools.cache
def zbv_inflight(device: int, pp: int, microbatches: int) -> float:
    """Most micro-batches whose activations `device` holds at once, in units of its two
    chunks' share (a chunk's from its F to its W)."""
    held = peak = 0
    for _, kind, _ in zbv_order(pp, microbatches)[device]:
        held += {"F": 1, "B": 0, "W": -1}[kind]
        peak = max(peak, held)
    return peak / 2
