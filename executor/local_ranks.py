"""Run `executor.worker.run` on N local processes (gloo on CPU): a fast harness for tests that
execute many small plans (torchrun's start-up takes ~5 s; a forkserver that has imported the
worker once starts N ranks in well under a second). Same worker code, real processes, real
gloo; `autopar execute` (torchrun) is what users run."""

from __future__ import annotations

import multiprocessing
import os
import socket
import traceback

from planner.plan import Plan


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, plan_json: str, options: dict, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    try:
        from executor.training import RunOptions
        from executor.worker import run

        result = run(Plan.from_json(plan_json), RunOptions(**options))
        queue.put((rank, result, None))
    except Exception as err:
        queue.put((rank, None, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def run_local(plan: Plan, steps: int = 3, timeout_s: float = 120, **options) -> list[dict]:
    """Every rank's result, in rank order; raises with the first rank's error. `options`:
    further executor.training.RunOptions fields (checkpoint_dir, resume, lr, ...)."""
    world = plan.mesh.shape[0] * plan.mesh.shape[1] * plan.mesh.shape[2]
    # forkserver, not fork: a child forked from a process that already ran torch's OpenMP
    # thread pool can hang in its first parallel region. The server imports the worker once,
    # so each rank still starts in a fraction of a second.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["executor.worker", "executor.local_warmup"])
    queue = ctx.Queue()
    port = _free_port()
    settings = {"steps": steps, **options}
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, plan.to_json(), settings, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    errors: dict[int, str] = {}
    try:
        for _ in range(world):
            rank, result, error = queue.get(timeout=timeout_s)
            if error:
                errors[rank] = error
            else:
                results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        # The rank that failed first, not one that lost its connection to it.
        rank = min(errors, key=lambda r: ("closed by peer" in errors[r], r))
        raise RuntimeError(f"rank {rank}: {errors[rank]}")
    return [results[r] for r in range(world)]
