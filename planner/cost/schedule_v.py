"""The V-shaped schedules, ZB-V (torch's ScheduleZBVZeroBubble) and DualPipeV (torch's
ScheduleDualPipeV, dualpipe_v_order), timed exactly.

ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6) gives each of the p devices
two model chunks placed in a V: device d holds chunk d and chunk 2p - 1 - d, so the last
chunk's output turns back on device 0 and the first device holds the embedding and the head.
Each backward is split into the input gradient (B) and the weight gradient (W); W passes fill
what would be the drain. The bubble has no closed form once F, B and W differ (the order's
critical path changes with their ratios), so this module builds the order torch 2.13 runs on
every device and takes the step time as the longest path through it: with the order per
device fixed and each action starting once its device is free and its inputs are there, the
makespan is the heaviest chain of actions linked by device order or data dependence
(v_time: a few numpy passes).

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
per device is read off its order, in units of the device's two chunks. DualPipeV is placed and
timed the same way, from its own order.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from planner.cost.schedule_interleaved import INTERLEAVED, closed_form_holds, interleaved_order

ZBV = "zbv_zero_bubble"
DUALPIPE_V = "dualpipe_v"
V_SHAPED = (ZBV, DUALPIPE_V)
# Breadth-first (torch's ScheduleLoopedBFS, Lamy-Poirier 2022): chunks placed in a loop, each
# device runs every micro-batch's forward of its first chunk, then of its next, and the full
# backwards in reverse; timed by the same replay.
LOOPED_BFS = "looped_bfs"
REPLAYED = (*V_SHAPED, LOOPED_BFS)
# Action kinds: forward, input gradient, weight gradient, and both gradients at once ("BW",
# DualPipeV's full backward); a chunk's times are (F, B, W) and BW takes B + W.
_KIND = {"F": 0, "B": 1, "W": 2, "BW": 3}


def device_of_chunk(schedule: str, chunk: int, pp: int) -> int:
    """The device (pipeline stage) running `chunk`: chunk % pp, or in a V for V_SHAPED."""
    if schedule in V_SHAPED and chunk >= pp:
        return 2 * pp - 1 - chunk
    return chunk % pp


@functools.cache  # per stage of every configuration the search evaluates
def chunks_of_device(schedule: str, device: int, pp: int, virtual_stages: int) -> tuple[int, ...]:
    """The chunks device `device` runs, in pipeline order."""
    chunks = range(pp * virtual_stages)
    return tuple(c for c in chunks if device_of_chunk(schedule, c, pp) == device)


# The orders and their arrays are kept for a few sizes only: at the replay's limit
# (planner.limits.MAX_REPLAYED_ACTIONS) one takes ~100 MB.
@functools.lru_cache(maxsize=8)
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


@functools.lru_cache(maxsize=8)
def dualpipe_v_order(pp: int, microbatches: int) -> tuple[tuple[tuple[int, str, int], ...], ...]:
    """DualPipeV's order per device (torch's ScheduleDualPipeV, after DeepSeek-V3's DualPipe,
    arXiv 2412.19437): F, B, W and BW (a full backward) actions. Torch 2.13 runs each of its
    "overlapped" forward + backward pairs one after the other unless a callback that overlaps
    them is registered (our executor registers none), so they are two actions here."""
    return tuple(_dualpipe_device(d, pp, microbatches) for d in range(pp))


def _dualpipe_device(d: int, p: int, m: int) -> tuple[tuple[int, str, int], ...]:
    c0, c1 = d, 2 * p - 1 - d
    nxt = {(c, k): 0 for c in (c0, c1) for k in "FBW"}
    pending: list[tuple[int, int]] = []  # (chunk, micro-batch) whose W has not run
    out: list[tuple[int, str, int]] = []

    def add(c: int, k: str) -> None:
        mb = nxt[c, "F" if k == "F" else "B"]
        out.append((c, k, mb))
        if k == "F":
            nxt[c, "F"] += 1
            return
        nxt[c, "B"] += 1
        if k == "B":
            pending.append((c, mb))
        else:
            nxt[c, "W"] += 1

    def weight() -> None:
        if pending:
            c, mb = pending.pop(0)
            out.append((c, "W", mb))
            nxt[c, "W"] += 1

    for _ in range(2 * (p - d - 1)):
        add(c0, "F")
    for _ in range(d + 1):
        add(c0, "F")
        add(c1, "F")
    for _ in range(p - d - 1):
        add(c1, "B")
        weight()
        add(c1, "F")
    for _ in range(m - 2 * p + d + 1):
        add(c0, "F")
        add(c1, "BW")
        add(c1, "F")
        add(c0, "BW")
    for _ in range(p - d - 1):
        add(c1, "BW")
        add(c1, "F")
        add(c0, "BW")
    split = False  # the second half of the last backwards run as B, their W later
    for i in range(d + 1):
        split = split or (i == (d + 1) // 2 and d % 2 == 1)
        add(c1, "B" if split else "BW")
        split = split or (i == (d + 1) // 2 and d % 2 == 0)
        add(c0, "B" if split else "BW")
    for _ in range(p - d - 1):
        weight()
        add(c0, "B" if split else "BW")
    for _ in range(d + 1):
        weight()
    return tuple(out)


@functools.lru_cache(maxsize=8)
def looped_bfs_order(pp: int, microbatches: int, virtual_stages: int):
    """Looped BFS's order per device: F of every micro-batch chunk by chunk, then BW of every
    micro-batch (last first) chunk by chunk backwards."""
    out = []
    for d in range(pp):
        mine = [d + k * pp for k in range(virtual_stages)]
        acts = [(c, "F", mb) for c in mine for mb in range(microbatches)]
        acts += [(c, "BW", mb) for c in reversed(mine) for mb in reversed(range(microbatches))]
        out.append(tuple(acts))
    return tuple(out)


def replayed(schedule: str, pp: int, microbatches: int) -> bool:
    """Whether the step time and activation counts come from replaying the order: always
    for REPLAYED, for the interleaved ones where their closed forms do not hold."""
    return schedule in REPLAYED or not closed_form_holds(schedule, pp, microbatches)


def v_order(schedule: str, pp: int, microbatches: int, virtual_stages: int = 2):
    """The per-device order of a replayed schedule."""
    if schedule == LOOPED_BFS:
        return looped_bfs_order(pp, microbatches, virtual_stages)
    if schedule in INTERLEAVED:
        return interleaved_order(schedule, pp, microbatches, virtual_stages)
    return (zbv_order if schedule == ZBV else dualpipe_v_order)(pp, microbatches)


@functools.lru_cache(maxsize=32)
def _chains(
    schedule: str, pp: int, microbatches: int, virtual_stages: int
) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """The order as arrays, devices one after another: per action its weight index
    (4 chunk + kind) and the index of the action whose output it needs (-1: none), and where
    each device's actions start. A BW action produces the input gradient as B does."""
    order = v_order(schedule, pp, microbatches, virtual_stages)
    acts = np.array([a for dev in order for a in dev], dtype=object).reshape(-1, 3)
    chunk = acts[:, 0].astype(np.int64)
    kind = np.array([_KIND[k] for k in acts[:, 1]], dtype=np.int64)
    mb = acts[:, 2].astype(np.int64)
    m, last = microbatches, virtual_stages * pp - 1
    made = np.where(kind == _KIND["BW"], _KIND["B"], kind)  # the output others wait for
    where = np.full(virtual_stages * pp * 3 * m, -1, dtype=np.int64)
    where[(3 * chunk + made) * m + mb] = np.arange(len(chunk))
    f, b = made == _KIND["F"], made == _KIND["B"]
    need_chunk = np.where(f, chunk - 1, np.where(b & (chunk < last), chunk + 1, chunk))
    need_kind = np.where(f | (b & (chunk == last)), _KIND["F"], _KIND["B"])
    need = where[(3 * np.maximum(need_chunk, 0) + need_kind) * m + mb]
    need[f & (chunk == 0)] = -1
    starts = tuple(int(x) for x in np.cumsum([0] + [len(dev) for dev in order]))
    return 4 * chunk + kind, need, starts


def v_time(
    schedule: str,
    chunk_times: list[tuple[float, float, float]],
    microbatches: int,
    pp: int | None = None,
) -> float:
    """Step time of a replayed schedule (_v_time) on pp devices (default: two chunks each);
    ZeRO levels 0-2 give the same chunk times, so the result is kept."""
    fbw = tuple((f, b, w, b + w) for f, b, w in chunk_times)
    return _v_time(schedule, fbw, microbatches, pp or len(chunk_times) // 2)


@functools.lru_cache(maxsize=4096)
def _v_time(
    schedule: str, chunk_times: tuple[tuple[float, ...], ...], microbatches: int, pp: int
) -> float:
    """Step time of the pipeline: `chunk_times[c]` = (F, B, W, B + W) of chunk c for one
    micro-batch (the chunks in pipeline order), no time between devices beyond what the
    chunks carry.

    Along one device, finish_i = max(finish_(i-1), ready_i) + w_i, i.e. with S the running
    sum of its weights, finish_i = S_i + max over j <= i of (ready_j - S_(j-1)): a running
    maximum. Starting from no cross-device waits, passes over the devices (0 to pp - 1 and
    back, each using the finishes the pass has already updated) recompute each device's
    finishes; they only grow, and stop changing once they are the longest paths."""
    widx, need, starts = _chains(schedule, pp, microbatches, len(chunk_times) // pp)
    weights = np.asarray(chunk_times, dtype=float).reshape(-1)[widx]
    spans = list(itertools.pairwise(starts))
    total = np.empty_like(weights)
    for a, b in spans:
        total[a:b] = np.cumsum(weights[a:b])
    before = total - weights
    finish = np.zeros_like(weights)
    waits = [need[a:b] >= 0 for a, b in spans]
    sources = [np.where(w, need[a:b], 0) for w, (a, b) in zip(waits, spans, strict=True)]
    sweep = [*range(pp), *reversed(range(pp))]
    changed = True
    while changed:
        changed = False
        for d in sweep:
            a, b = spans[d]
            slack = np.where(waits[d], finish[sources[d]], 0.0) - before[a:b]
            grown = total[a:b] + np.maximum.accumulate(slack)
            if not np.array_equal(grown, finish[a:b]):
                finish[a:b] = grown
                changed = True
    return float(finish.max(initial=0.0))


def v_inflight(
    schedule: str, device: int, pp: int, microbatches: int, virtual_stages: int = 2
) -> float:
    """Most micro-batches whose activations `device` holds at once, in units of its
    chunks' share (a chunk's from its F to its W or BW): Looped BFS runs every forward first."""
    if schedule == LOOPED_BFS:
        return float(microbatches)
    if schedule == ZBV:
        return zbv_inflight(device, pp, microbatches)
    return _counted_inflight(schedule, pp, microbatches, virtual_stages)[device]


@functools.lru_cache(maxsize=256)
def _counted_inflight(
    schedule: str, pp: int, microbatches: int, virtual_stages: int
) -> tuple[float, ...]:
    """Per device, the most chunk activations held along its order, in units of its chunks."""
    out = []
    for actions in v_order(schedule, pp, microbatches, virtual_stages):
        held = peak = 0
        for _, kind, _ in actions:
            held += {"F": 1, "B": 0, "W": -1, "BW": -1}[kind]
            peak = max(peak, held)
        out.append(peak / virtual_stages)
    return tuple(out)


@functools.lru_cache(maxsize=256)
def v_split_points(
    schedule: str, pp: int, microbatches: int, virtual_stages: int = 2
) -> tuple[tuple[tuple[float, float], ...], ...]:
    """Per device, the (held, pending) chunk activations along its order, in units of its chunks,
    where no other point holds as many of both: held from a chunk's F to its W (or BW),
    pending from its B to its W (planner.cost.schedules.split_backward_points)."""
    out, v = [], virtual_stages
    for actions in v_order(schedule, pp, microbatches, v):
        held = pending = 0
        most: dict[int, int] = {}  # held -> the most pending seen with it
        for _, kind, _ in actions:
            held += {"F": 1, "B": 0, "W": -1, "BW": -1}[kind]
            pending += {"F": 0, "B": 1, "W": -1, "BW": 0}[kind]
            most[held] = max(most.get(held, 0), pending)
        front, best = [], -1
        for h in sorted(most, reverse=True):  # kept where no larger held has as many pending
            if most[h] > best:
                front.append((h / v, most[h] / v))
                best = most[h]
        out.append(tuple(front))
    return tuple(out)


def zbv_inflight(device: int, pp: int, microbatches: int) -> float:
    """Most micro-batches whose activations `device` holds at once, in units of its two
    chunks' share (a chunk's from its F to its W): read off the order, the most chunk
    activations a device holds are min(2 pp, m + device + 1, 2 m) (tests/planner/test_zbv.py
    counts them along the order for pp <= 9, m <= 44)."""
    m = microbatches
    return min(2 * pp, m + device + 1, 2 * m) / 2


# The actions that make a chunk's weight gradients: a full backward, or a split backward's
# weight pass (its input pass makes none).
GRADIENT_ACTIONS = ("BW", "W")


@functools.lru_cache(maxsize=4096)
def gradient_holders(
    schedule: str, pp: int, microbatches: int, virtual_stages: int, device: int
) -> tuple[frozenset[int], ...]:
    """The device's chunks whose whole gradients it holds at once, as the maximal such sets:
    torch 2.13's multi-stage schedules reduce a chunk's gradients right after its last
    backward (schedules._add_reduce_grad: a REDUCE_GRAD after the chunk's last full or
    weight backward, "reduce_grad frees memory"), so a chunk holds them from its first
    gradient-making action to its last. With 2 pp micro-batches or more the interleaved and
    V schedules reach the first chunk's first backward before the last chunk's last one
    (every chunk at once), and Looped BFS runs each chunk's backwards together (one at a
    time): tests/planner/test_gradient_windows.py checks both on the orders, which are read
    only for the fewer micro-batches (the long orders would cost the search its time)."""
    chunks = chunks_of_device(schedule, device, pp, virtual_stages)
    if len(chunks) == 1 or (schedule in (*INTERLEAVED, *V_SHAPED) and microbatches >= 2 * pp):
        return (frozenset(chunks),)
    if schedule == LOOPED_BFS:
        return tuple(frozenset({c}) for c in chunks)
    return held_from_order(v_order(schedule, pp, microbatches, virtual_stages)[device])


def held_from_order(order) -> tuple[frozenset[int], ...]:
    """gradient_holders read off one device's order of (chunk, kind, micro-batch) actions."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, (chunk, kind, _mb) in enumerate(order):
        if kind in GRADIENT_ACTIONS:
            first.setdefault(chunk, i)
            last[chunk] = i
    sets = {frozenset(c for c in first if first[c] <= i <= last[c]) for i in first.values()}
    return tuple(s for s in sets if not any(s < other for other in sets))


@functools.lru_cache(maxsize=4096)
def holds_every_chunk_at_once(
    schedule: str, pp: int, microbatches: int, virtual_stages: int
) -> bool:
    """Whether each device holds all its chunks' whole gradients at once at some point
    (gradient_holders): then pricing every parameter's whole is exact."""
    return all(
        len(held := gradient_holders(schedule, pp, microbatches, virtual_stages, d)) == 1
        and len(held[0]) == len(chunks_of_device(schedule, d, pp, virtual_stages))
        for d in range(pp)
    )
