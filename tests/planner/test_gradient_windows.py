"""Which chunks hold their whole gradients at once under torch's multi-stage schedules: a
chunk from its first gradient-making backward to its last, after which torch reduces it
(REDUCE_GRAD, torch 2.13 schedules._add_reduce_grad). Read off the orders the planner
replays (tests/executor/test_schedule_orders.py compares them with torch's)."""

import itertools

import pytest

from planner.cost.schedule_v import (
    chunks_of_device,
    gradient_holders,
    held_from_order,
    holds_every_chunk_at_once,
    v_order,
)


def _windows(order):
    """Written apart from the planner's: per chunk, the positions of its gradient actions."""
    seen: dict[int, list[int]] = {}
    for i, (chunk, kind, _mb) in enumerate(order):
        if kind in ("BW", "W"):
            seen.setdefault(chunk, []).append(i)
    return {c: (min(p), max(p)) for c, p in seen.items()}


@pytest.mark.parametrize(
    "schedule", ["interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipe_v"]
)
def test_two_rounds_or_more_hold_every_chunk_at_once(schedule):
    vs = (2,) if schedule in ("zbv_zero_bubble", "dualpipe_v") else (2, 3, 4)
    for pp, v, rounds in itertools.product((2, 3, 4), vs, (2, 3)):
        m = rounds * pp + (1 if schedule == "zbv_zero_bubble" else 0)  # ZB-V: any count
        for d in range(pp):
            windows = _windows(v_order(schedule, pp, m, v)[d])
            assert max(a for a, _ in windows.values()) <= min(b for _, b in windows.values())
            assert gradient_holders(schedule, pp, m, v, d) == (
                frozenset(chunks_of_device(schedule, d, pp, v)),
            )
        assert holds_every_chunk_at_once(schedule, pp, m, v)


def test_one_round_holds_one_chunk_at_a_time():
    """Interleaved 1F1B, 2 micro-batches over 2 stages of 3 chunks: each chunk's backwards
    run together, so device 0 holds chunk 4's, then 2's, then 0's."""
    order = v_order("interleaved_1f1b", 2, 2, 3)[0]
    assert [c for c, kind, _ in order if kind == "BW"] == [4, 4, 2, 2, 0, 0]
    held = gradient_holders("interleaved_1f1b", 2, 2, 3, 0)
    assert sorted(map(sorted, held)) == [[0], [2], [4]]
    assert not holds_every_chunk_at_once("interleaved_1f1b", 2, 2, 3)


@pytest.mark.parametrize(
    "schedule, pp, m, v",
    [("looped_bfs", 2, 4, 2), ("zbv_zero_bubble", 2, 4, 2), ("dualpipe_v", 2, 8, 2)],
)
def test_the_sets_are_the_overlapping_windows(schedule, pp, m, v):
    for d in range(pp):
        order = v_order(schedule, pp, m, v)[d]
        windows = _windows(order)
        expected = set()
        for i in range(len(order)):
            live = frozenset(c for c, (a, b) in windows.items() if a <= i <= b)
            expected.add(live)
        maximal = {s for s in expected if s and not any(s < o for o in expected)}
        assert set(held_from_order(order)) == maximal


def test_looped_bfs_holds_one_chunk_at_a_time():
    for pp, v, m in itertools.product((2, 3), (2, 3), (2, 4, 8)):
        for d in range(pp):
            windows = sorted(_windows(v_order("looped_bfs", pp, m, v)[d]).values())
            assert all(a[1] < b[0] for a, b in itertools.pairwise(windows))
            held = gradient_holders("looped_bfs", pp, m, v, d)
            assert sorted(map(len, held)) == [1] * v
