"""A pipeline schedule as a timeline, for the plan viewer's Gantt chart.

A small list scheduler: every device runs the forward/backward of its model chunks as their
inputs arrive, backward first, and caps forwards in flight the way the schedule does (GPipe:
no cap; 1F1B: p - s on stage s; interleaved: Megatron's warm-up of 2 (p - s - 1) + (v - 1) p
chunk-micro-batches, plus one). Forward is a third of a stage's per-micro-batch time and
backward two thirds (the usual 1:2 FLOP ratio); communication is not drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cost.schedule_v import V_SHAPED, chunks_of_device


@dataclass(frozen=True)
class Block:
    device: int
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int
    start: float
    end: float


def timeline(
    schedule: str, stage_times: list[float], microbatches: int, virtual_stages: int = 1
) -> list[Block]:
    p, v, m = len(stage_times), max(virtual_stages, 1), microbatches
    if p == 0 or m == 0:
        return []
    chunks = p * v  # virtual stage k runs on device k % p as chunk k // p (ZB-V: in a V)
    own = [chunks_of_device(schedule, d, p, v) for d in range(p)]
    device = {k: d for d in range(p) for k in own[d]}
    fwd = [stage_times[device[k]] / 3 / v for k in range(chunks)]
    bwd = [2 * stage_times[device[k]] / 3 / v for k in range(chunks)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    groups = [range(g, min(g + p, m)) for g in range(0, m, p)] if v > 1 else [range(m)]
    fq = [[(own[d][c], i) for g in groups for c in range(v) for i in g] for d in range(p)]
    bq = [[(own[d][c], i) for g in groups for c in reversed(range(v)) for i in g] for d in range(p)]
    in_flight = [0] * p
    if schedule in ("gpipe", "looped_bfs"):
        cap = [m * v] * p
    elif schedule in ("interleaved_zero_bubble", *V_SHAPED):  # as many as the first
        cap = [min(m, p) * v] * p
    elif v > 1:
        cap = [min(m * v, 2 * (p - d - 1) + (v - 1) * p + 1) for d in range(p)]
    else:
        cap = [min(m, p - d) for d in range(p)]
    blocks: list[Block] = []

    def ready_at(kind: str, k: int, i: int) -> float | None:
        deps = [("F", k - 1, i)] if kind == "F" and k > 0 else []
        if kind == "B":
            deps = [("F", k, i)] + ([("B", k + 1, i)] if k + 1 < chunks else [])
        if any(dep not in done for dep in deps):
            return None
        return max((done[dep] for dep in deps), default=0.0)

    relax = False
    while any(fq) or any(bq):
        best = None  # ((start, priority...), device, kind)
        for d in range(p):
            heads = []
            if bq[d] and not (schedule == "gpipe" and fq[d]):
                heads.append(("B", *bq[d][0]))
            if fq[d] and (relax or in_flight[d] < cap[d]):
                heads.append(("F", *fq[d][0]))
            for kind, k, i in heads:
                at = ready_at(kind, k, i)
                if at is None:
                    continue
                prio = (max(at, free[d]), 0 if kind == "B" else 1, d)
                if best is None or prio < best[0]:
                    best = (prio, d, kind)
        if best is None:  # the caps blocked every device: let forwards through
            if relax:
                break
            relax = True
            continue
        relax = False
        (start, *_), d, kind = best
        k, i = (bq if kind == "B" else fq)[d].pop(0)
        end = start + (fwd[k] if kind == "F" else bwd[k])
        done[(kind, k, i)] = end
        free[d] = end
        in_flight[d] += 1 if kind == "F" else -1
        blocks.append(Block(d, kind, i, own[d].index(k), start, end))
    return blocks
