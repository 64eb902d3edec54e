"""Issue 42 part 5: what the gloo equivalence cases cost in their rank processes, three ways.
Six of tests/executor/test_strategies.py's einsum cases (graph mode, 2 ranks, 2 steps), run

- fresh, unit dims kept: new rank processes per case, the stage's DTensors on the whole
  (dp, tp) = (1, 2) mesh (graph mode before executor.graph_mode.UnitFreeMesh);
- fresh: new rank processes per case, the 1-D mesh graph mode now uses;
- pooled: executor.local_ranks.run_local as the tests run it, the ranks kept across cases.

    python bench/warm_ranks.py   (writes bench/results/warm_ranks.md; ~3 min)
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


def _fresh_rank(rank: int, world: int, port: int, plan_json: str, keep_units: bool, done) -> None:
    from executor.local_ranks import rank_environment

    os.environ.update(rank_environment(rank, world, port))
    import executor.graph_mode as graph_mode
    from executor.training import RunOptions
    from executor.worker import run
    from planner.plan import Plan

    if keep_units:  # the whole (dp, tp) mesh, as graph mode ran before UnitFreeMesh
        unit_free_init = graph_mode.UnitFreeMesh.__init__

        def every_dim(self, mesh):
            unit_free_init(self, mesh)
            self.kept, self.mesh = tuple(range(mesh.ndim)), mesh

        graph_mode.UnitFreeMesh.__init__ = every_dim
    run(Plan.from_json(plan_json), RunOptions(steps=2))
    done.put(rank)


def _fresh(plan, keep_units: bool) -> float:
    from executor.local_ranks import loopback_store

    world = plan.mesh.dims.world
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["executor.worker", "executor.local_warmup"])
    done = ctx.Queue()
    with loopback_store() as port:
        started = time.perf_counter()
        procs = [
            ctx.Process(target=_fresh_rank, args=(r, world, port, plan.to_json(), keep_units, done))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for _ in procs:
            done.get(timeout=300)
        for p in procs:
            p.join(timeout=30)
        return time.perf_counter() - started


def main() -> None:
    import tests.executor.test_strategies as ts
    from executor.local_ranks import RUNS_PER_POOL, run_local

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
    _fresh(plans[-1], keep_units=False)  # the fork server starts (not timed)
    kept = [_fresh(plan, keep_units=True) for plan in plans]
    fresh = [_fresh(plan, keep_units=False) for plan in plans]
    run_local(plans[-1], steps=2)  # the pool starts (not timed)
    pooled = []
    for plan in plans:
        started = time.perf_counter()
        run_local(plan, steps=2)
        pooled.append(time.perf_counter() - started)
    rows = [
        f"| einsum {s} | {k:.1f} | {f:.1f} | {p:.1f} |"
        for s, k, f, p in zip(CASES, kept, fresh, pooled, strict=True)
    ]
    world = plans[0].mesh.dims.world
    title = "Rank processes of the gloo cases (issue 42, part 5)"
    text = header(title, "python bench/warm_ranks.py")
    text += "\n".join(
        [
            "",
            f"{world} ranks, (dp, tp) = (1, 2), 2 steps per case, seconds per case from starting "
            "the ranks to their last result (the fork server and the pool started before). "
            "Unit dims kept: the stage's DTensors on the (1, 2) mesh, as graph mode ran them "
            "before: DTensor's sharding propagation enumerates each op's strategies over both "
            "dims, and a split merged by a view becomes a `_StridedShard` whose redistribute "
            "cost DTensor finds by a shortest-path search. Fresh: the 1-D mesh graph mode "
            "uses now (executor.graph_mode.UnitFreeMesh). Pooled: executor.local_ranks.run_local, "
            "as the tests run, the rank processes kept across cases (a new process group each; "
            f"a pool serves {RUNS_PER_POOL} runs, so the pool started before serves the first "
            "four cases and a new one the rest).",
            "",
            "| case | fresh, unit dims kept s | fresh s | pooled s |",
            "| --- | --- | --- | --- |",
            *rows,
            f"| total | {sum(kept):.1f} | {sum(fresh):.1f} | {sum(pooled):.1f} |",
            "",
        ]
    )
    write("warm_ranks.md", text)


if __name__ == "__main__":
    main()
