"""Issue 42 part 5's lead: what rank processes kept warm across gloo equivalence cases would
save. Six of tests/executor/test_strategies.py's einsum cases (graph mode, 2 ranks, 2 steps)
run twice: each in fresh rank processes (executor.local_ranks.run_local, as the tests do),
then in turn in the same two processes (a fresh process group per case, DTensor's sharding
caches kept). Measures only: no harness uses warm ranks yet.

    python bench/warm_ranks.py   (writes bench/results/warm_ranks.md; ~1.5 min)
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common import header, write  # noqa: E402

CASES = ["split_c", "split_c+zero3", "split_e", "split_f", "split_g", "split_m"]


def _ranks_loop(rank: int, world: int, jobs, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    from executor.training import RunOptions
    from executor.worker import run
    from planner.plan import Plan

    while (job := jobs[rank].get()) is not None:
        port, plan_json = job
        os.environ["MASTER_PORT"] = str(port)
        run(Plan.from_json(plan_json), RunOptions(steps=2))
        results.put(rank)


def main() -> None:
    import tests.executor.test_strategies as ts
    from executor.local_ranks import _free_port, run_local

    plans = []
    for strategy in CASES:
        family = ts.CASES["einsum", strategy]
        plans.append(
            ts.strategy_plan(
                ts.MODELS[family],
                ts._cluster(),
                "einsum",
                strategy,
                tp=ts.TP,
                global_batch=ts.BATCH,
                seq=ts.SEQ,
                graph=ts._graph(family),
            )
        )
    world = plans[0].mesh.shape[0] * plans[0].mesh.shape[1] * plans[0].mesh.shape[2]
    fresh = []
    for plan in plans:
        started = time.perf_counter()
        run_local(plan, steps=2)
        fresh.append(time.perf_counter() - started)
    ctx = multiprocessing.get_context("forkserver")
    jobs, results = [ctx.Queue() for _ in range(world)], ctx.Queue()
    procs = [ctx.Process(target=_ranks_loop, args=(r, world, jobs, results)) for r in range(world)]
    for p in procs:
        p.start()
    warm = []
    for plan in plans:
        started = time.perf_counter()
        port = _free_port()
        for r in range(world):
            jobs[r].put((port, plan.to_json()))
        for _ in range(world):
            results.get(timeout=300)
        warm.append(time.perf_counter() - started)
    for r in range(world):
        jobs[r].put(None)
    for p in procs:
        p.join(timeout=30)
    rows = [
        f"| einsum {s} | {f:.1f} | {w:.1f} |" for s, f, w in zip(CASES, fresh, warm, strict=True)
    ]
    text = header(
        "Warm rank processes across gloo cases (issue 42, part 5)", "python bench/warm_ranks.py"
    )
    text += "\n".join(
        [
            "",
            f"{world} ranks, 2 steps per case, seconds per case (the first fresh case also "
            "starts the fork server). Fresh: executor.local_ranks.run_local, new rank processes "
            "per case, as the tests run; warm: the same processes run the cases in turn, a new "
            "process group each, DTensor's sharding-propagation caches kept (in a fresh rank, "
            "an einsum case spends most of its training time propagating shardings the first "
            "time: `_StridedShard` transforms take torch's graph-based min-cost search).",
            "",
            "| case | fresh s | warm s |",
            "| --- | --- | --- |",
            *rows,
            f"| total | {sum(fresh):.1f} | {sum(warm):.1f} |",
            "",
        ]
    )
    write("warm_ranks.md", text)


if __name__ == "__main__":
    main()
