"""planner.cost.schedules against torch's own schedules: real gloo processes build
torch.distributed.pipelining's ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble, ScheduleDualPipeV and ScheduleLoopedBFS (the schedules that run from an
action list; Schedule1F1B's listed order
is not the one it runs) and hand back every rank's action list; this test replays the
lists with given forward (F), input-gradient (B) and weight-gradient (W) times per chunk and
no communication, and compares the step time with pipeline_time() (the replayed schedules:
v_time(), with times that differ between chunks too) and the most micro-batches a rank holds
(forward run, its backward not yet finished) with inflight_microbatches(); the replayed
schedules' orders are compared with the planner's (planner.cost.schedule_v.v_order), action by
action."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from planner.cost.schedule_v import device_of_chunk, replayed, v_order, v_time
from planner.cost.schedules import (
    WEIGHT_SPLIT,
    inflight_microbatches,
    pipeline_time,
    split_backward_points,
)

# (torch class, planner name, chunks per device, micro-batches) built on 2 and on 4 ranks. The
# interleaved ones with fewer micro-batches than ranks, or not whole rounds of them, are
# replayed from planner.cost.schedule_interleaved's orders (one micro-batch: nothing overlaps).
SCHEDULES = [
    ("ScheduleInterleaved1F1B", "interleaved_1f1b", 2, 8),
    ("ScheduleInterleaved1F1B", "interleaved_1f1b", 3, 8),
    ("ScheduleInterleaved1F1B", "interleaved_1f1b", 2, 1),
    ("ScheduleInterleaved1F1B", "interleaved_1f1b", 2, 3),
    ("ScheduleInterleaved1F1B", "interleaved_1f1b", 4, 2),
    ("ScheduleInterleaved1F1B", "interleaved_1f1b", 3, 6),
    ("ScheduleInterleavedZeroBubble", "interleaved_zero_bubble", 1, 8),
    ("ScheduleInterleavedZeroBubble", "interleaved_zero_bubble", 2, 4),
    ("ScheduleInterleavedZeroBubble", "interleaved_zero_bubble", 3, 8),
    ("ScheduleInterleavedZeroBubble", "interleaved_zero_bubble", 1, 3),
    ("ScheduleInterleavedZeroBubble", "interleaved_zero_bubble", 2, 1),
    ("ScheduleInterleavedZeroBubble", "interleaved_zero_bubble", 3, 3),
    ("ScheduleInterleavedZeroBubble", "interleaved_zero_bubble", 2, 6),
    ("ScheduleZBVZeroBubble", "zbv_zero_bubble", 2, 3),
    ("ScheduleZBVZeroBubble", "zbv_zero_bubble", 2, 8),
    ("ScheduleZBVZeroBubble", "zbv_zero_bubble", 2, 11),
    ("ScheduleDualPipeV", "dualpipe_v", 2, 8),
    ("ScheduleDualPipeV", "dualpipe_v", 2, 13),
    ("ScheduleLoopedBFS", "looped_bfs", 2, 4),
    ("ScheduleLoopedBFS", "looped_bfs", 3, 5),
]
TIMES = [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 1.2, 0.8)]  # F, B, W per chunk


def _orders(rank: int, world: int, port: int, out) -> None:
    from torch.distributed import pipelining

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    found = {}
    for cls_name, name, v, m in SCHEDULES:
        chunks = [c for c in range(v * world) if device_of_chunk(name, c, world) == rank]
        stages = [
            pipelining.PipelineStage(nn.Linear(2, 2), c, v * world, torch.device("cpu"))
            for c in chunks
        ]
        loss = lambda a, b: ((a - b) ** 2).mean()  # noqa: E731
        sched = getattr(pipelining, cls_name)(stages, n_microbatches=m, loss_fn=loss)
        found[(cls_name, v, m)] = {r: _flat(acts) for r, acts in sched.pipeline_order.items()}
    if rank == 0:
        out.put(found)
    dist.destroy_process_group()


def _flat(actions) -> list:
    """(stage, kind, micro-batch) per action; DualPipeV's OVERLAP_F_B pairs, which torch runs
    one after the other, as their two sub-actions."""
    out = []
    for a in actions:
        if a is not None and a.sub_actions:
            out += _flat(a.sub_actions)
        else:
            kind = None if a is None else a.computation_type.name
            out.append(None if a is None else (a.stage_index, kind, a.microbatch_index))
    return out


@pytest.fixture(scope="module", params=[2, 4])
def orders(request):
    world = request.param
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_orders, args=(world, port, queue), nprocs=world, start_method="spawn")
    return world, queue.get()


def _replay(order: dict, chunks: int, f, b, w):
    """Makespan, per rank the most micro-batches (in whole-device units) held, and per rank
    every (held, pending) pair along its order (pending: input gradient run, weight gradient
    not yet); f, b, w: one time for every chunk, or a list of one per chunk."""
    f, b, w = ([t] * chunks if isinstance(t, float) else t for t in (f, b, w))
    done: dict = {}
    free = {r: 0.0 for r in order}
    held = {r: 0.0 for r in order}
    peak = {r: 0.0 for r in order}
    pending = {r: 0.0 for r in order}
    points: dict = {r: [] for r in order}
    todo = {r: [a for a in acts if a is not None] for r, acts in order.items()}
    per_rank = {r: len({a[0] for a in acts}) for r, acts in todo.items()}
    progress = True
    while progress:
        progress = False
        for r, acts in todo.items():
            while acts:
                stage, op, mb = acts[0]
                if op == "FORWARD":
                    need, key, t = ([(stage - 1, "F", mb)] if stage else []), "F", f[stage]
                elif op in ("BACKWARD_INPUT", "FULL_BACKWARD"):
                    last = stage == chunks - 1
                    need = [(stage, "F", mb)] if last else [(stage + 1, "B", mb)]
                    key, t = "B", (b[stage] if op == "BACKWARD_INPUT" else b[stage] + w[stage])
                elif op == "BACKWARD_WEIGHT":
                    need, key, t = [(stage, "B", mb)], "W", w[stage]
                else:
                    acts.pop(0)
                    continue
                if any(n not in done for n in need):
                    break
                start = max([free[r]] + [done[n] for n in need])
                done[(stage, key, mb)] = free[r] = start + t
                if op == "FORWARD":
                    held[r] += 1 / per_rank[r]
                elif op in ("BACKWARD_WEIGHT", "FULL_BACKWARD"):
                    held[r] -= 1 / per_rank[r]
                if op == "BACKWARD_INPUT":
                    pending[r] += 1 / per_rank[r]
                elif op == "BACKWARD_WEIGHT":
                    pending[r] -= 1 / per_rank[r]
                peak[r] = max(peak[r], held[r])
                points[r].append((held[r], pending[r]))
                acts.pop(0)
                progress = True
    assert not any(todo.values()), "the replay deadlocked"
    return max(free.values()), peak, points


def _check_pending(name: str, world: int, m: int, v: int, points: dict) -> None:
    """The split backward's worst held + ratio x pending, for a few ratios of the weight
    gradients' waiting bytes to the activations' (planner.cost.schedules.pending_weight_bytes),
    is the replay's."""
    for r in range(world):
        planned = split_backward_points(name, r, world, m, v)
        assert bool(planned) == (name in WEIGHT_SPLIT)
        for ratio in (0.0, 0.3, 0.7, 1.5) if planned else ():
            found = max(h + ratio * p for h, p in points[r])
            assert max(h + ratio * p for h, p in planned) == pytest.approx(found), (r, ratio)


@pytest.mark.distributed
@pytest.mark.parametrize("case", SCHEDULES, ids=lambda c: f"{c[1]}-v{c[2]}-m{c[3]}")
def test_step_time_and_memory_are_those_of_torchs_schedule(orders, case):
    world, found = orders
    cls_name, name, v, m = case
    if replayed(name, world, m):
        return _check_v(name, world, found[(cls_name, v, m)], m, v)
    order = found[(cls_name, v, m)]
    for f, b, w in TIMES:
        makespan, peak, points = _replay(order, world * v, f, b, w)
        _check_pending(name, world, m, v, points)
        stage = v * (f + b + w)  # one device's chunks, one micro-batch
        weight = [v * w] * world if name == "interleaved_zero_bubble" else None
        assert makespan == pytest.approx(pipeline_time([stage] * world, m, v, weight))
        for r in range(world):
            assert peak[r] == pytest.approx(inflight_microbatches(name, r, world, m, v)), r


def _check_v(name: str, world: int, order: dict, m: int, v: int) -> None:
    planned = v_order(name, world, m, v)
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "BW"}
    for r, acts in order.items():
        torch_order = [(c, kinds[op], mb) for c, op, mb in (a for a in acts if a is not None)]
        assert torch_order == list(planned[r]), r
    chunks = v * world
    uneven = [1.0 + 0.3 * c for c in range(chunks)]  # every chunk its own F, B and W
    for f, b, w in [*TIMES, (uneven, uneven[::-1], [0.5] * chunks)]:
        makespan, peak, points = _replay(order, chunks, f, b, w)
        _check_pending(name, world, m, v, points)
        lists = ([t] * chunks if isinstance(t, float) else t for t in (f, b, w))
        per_chunk = list(zip(*lists, strict=True))
        assert makespan == pytest.approx(v_time(name, per_chunk, m, world))
        for r in range(world):
            assert peak[r] == pytest.approx(inflight_microbatches(name, r, world, m, v))
