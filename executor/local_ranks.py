"""Run `executor.worker.run` on N local processes (gloo on CPU): a fast harness for tests that
execute many small plans. Same worker code, real processes, real gloo; `autopar execute`
(torchrun) is what users run.

The rank processes are kept between runs (a pool per calling process, replaced every
RUNS_PER_POOL runs): each run is a new process group on a new port in the same processes,
which have imported torch and the worker and warmed torch's per-process caches (export's
machinery, DTensor's sharding propagation) in the runs before. A fresh rank spends seconds
on those; torchrun's start-up alone takes ~5 s. A rank that fails exits (its peers, blocked
in a collective with it, then fail at once instead of at the gloo timeout), and a pool with a
failed, killed or late rank is discarded whole: the next run starts fresh processes."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import queue as queue_module
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator

from planner.plan import Plan

# A rank whose memory has grown past this after a run is replaced (caches and the
# allocator's fragments of many runs add up; each rank of a 2-core CI machine's pools counts).
RANK_RSS_LIMIT_BYTES = 2 << 30
# Runs a pool serves before its ranks are replaced. A destroyed gloo process group leaves its
# transport threads behind in torch 2.13 (~10 per run: pt_gloo_runloop, gloo_tcp_loop, the
# store's), and the gloo_tcp_loop ones wake up on their own: 12 of them took 1.8% of a core
# while the rank sat idle, so a rank kept for 100 runs would spend half a core on them.
RUNS_PER_POOL = 5


@contextlib.contextmanager
def loopback_store() -> Iterator[int]:
    """A rendezvous store on a port the OS picks, held by the caller for the job, as torchrun's
    agent holds its own; the ranks join it as clients (`rank_environment`). A port picked,
    released and bound again by rank 0 could be taken by another job's gloo connection
    in between (EADDRINUSE was seen in CI)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun tells a local rank about its job, for a process group on loopback whose
    store `loopback_store` holds."""
    return {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
    }


def _rank_loop(index: int, jobs, results, crash_path: str) -> None:
    """One pooled rank: runs the jobs it is given, in turn, until it gets None."""
    import faulthandler

    import torch

    from executor.training import RunOptions, rss_bytes
    from executor.worker import run

    # One intra-op thread per rank, as torchrun gives each of several local processes
    # (OMP_NUM_THREADS=1): ranks outnumber the cores, and their thread pools would contend.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # A rank that dies by a signal (a crash in gloo or a kernel) reports nothing through the
    # queue: the stacks of its threads, written here, say where it was (`_crash_report`).
    faulthandler.enable(file=open(crash_path, "w"), all_threads=True)  # noqa: SIM115

    while (job := jobs.get()) is not None:
        world, port, plan_json, options = job
        os.environ.update(rank_environment(index, world, port))
        try:
            result = run(Plan.from_json(plan_json), RunOptions(**options))
        except Exception as err:  # reported to the caller, then this rank exits
            error = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
            results.put((index, None, error, 0))
            results.close()
            results.join_thread()
            os._exit(1)
        _forget_run_state()
        results.put((index, result, None, rss_bytes()))


def _forget_run_state() -> None:
    """What a run leaves in the process that the next run must not inherit: whatever holds
    the finished run's meshes. A mesh equal to one of the next run's (same ranks, dims and
    names) matches it in DTensor's caches, but names process groups of the old run: its
    sharding-propagation results (output specs carry the mesh) and redistribute planners
    go, and so does the random-number tracker. The redistribute transforms stay: they
    are cached by value (mesh dims and placements), and they are what a fresh rank spends
    its time finding."""
    from torch.distributed.tensor import _random
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()
    _random._rng_tracker = None


class _RankPool:
    def __init__(self, size: int):
        # forkserver, not fork: a child forked from a process that already ran torch's OpenMP
        # thread pool can hang in its first parallel region. The server imports the worker
        # once, so each rank starts in a fraction of a second.
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["executor.worker", "executor.local_warmup"])
        self.jobs = [ctx.Queue() for _ in range(size)]
        self.results = ctx.Queue()
        self.crash_dir = tempfile.mkdtemp(prefix="autopar-ranks-")
        self.procs = [
            ctx.Process(
                target=_rank_loop,
                args=(i, self.jobs[i], self.results, self.crash_path(i)),
                daemon=True,
            )
            for i in range(size)
        ]
        for p in self.procs:
            p.start()
        self.runs = 0  # runs started on this pool

    def crash_path(self, rank: int) -> str:
        return os.path.join(self.crash_dir, f"rank{rank}.stacks")

    def crash_report(self, rank: int) -> str:
        """How rank `rank`'s process ended: its exit code and, where a signal killed it, the
        stacks faulthandler wrote (the innermost frames of each thread)."""
        code = self.procs[rank].exitcode
        try:
            with open(self.crash_path(rank)) as f:
                stacks = f.read().strip()
        except OSError:
            stacks = ""
        return f"rank process exited (code {code})" + (f"\n{stacks}" if stacks else "")

    @property
    def size(self) -> int:
        return len(self.procs)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, graceful: bool) -> None:
        if graceful:
            for q in self.jobs:
                q.put(None)
        for p in self.procs:
            p.join(timeout=10 if graceful else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        shutil.rmtree(self.crash_dir, ignore_errors=True)


_pool: _RankPool | None = None


def _rank_pool(world: int) -> _RankPool:
    global _pool
    if _pool is not None and (
        _pool.size < world or _pool.runs >= RUNS_PER_POOL or not _pool.alive()
    ):
        close_pool()
    if _pool is None:
        _pool = _RankPool(world)
    return _pool


@atexit.register
def close_pool(graceful: bool = True) -> None:
    """Stop the pooled ranks (a caller done with gloo runs for a while); not `graceful`:
    kill them (a run failed or ran late, and they may be stuck in its collectives)."""
    global _pool
    if _pool is not None:
        _pool.close(graceful=graceful and _pool.alive())
        _pool = None


def run_local(plan: Plan, steps: int = 3, timeout_s: float = 120, **options) -> list[dict]:
    """Every rank's result, in rank order; raises with the first rank's error. `options`:
    further executor.training.RunOptions fields (checkpoint_dir, resume, lr, ...)."""
    world = plan.mesh.processes
    try:
        return _run(world, plan, steps, timeout_s, options)
    except RankCrashed as crash:
        # Once in ~1,400 runs of CI's suite, a rank of a run that passes on rerun died
        # by SIGSEGV, cause not found (a pooled rank holds the transport threads of every
        # finished run's gloo group: RUNS_PER_POOL). A crash that recurs on fresh processes
        # is the run's own, and raised; a first one is reported with its stacks.
        warnings.warn(f"rerun on fresh ranks after {crash}", RuntimeWarning, stacklevel=2)
    return _run(world, plan, steps, timeout_s, options)


def _run(world: int, plan: Plan, steps: int, timeout_s: float, options: dict) -> list[dict]:
    pool = _rank_pool(world)
    pool.runs += 1
    with loopback_store() as port:
        return _run_on_pool(pool, world, port, plan, steps, timeout_s, options)


class RankCrashed(RuntimeError):
    """A rank process was killed by a signal (not an error its code raised)."""


def _lost_peer(error: str) -> bool:
    """Whether a rank's error is gloo's report of a peer gone (a consequence, not a cause)."""
    return "closed by peer" in error or "Connection reset by peer" in error


def _run_on_pool(
    pool: _RankPool, world: int, port: int, plan: Plan, steps: int, timeout_s: float, options: dict
) -> list[dict]:
    job = (world, port, plan.to_json(), {"steps": steps, **options})
    for rank in range(world):
        pool.jobs[rank].put(job)
    results: dict[int, dict] = {}
    errors: dict[int, str] = {}
    signalled: set[int] = set()  # ranks killed by a signal
    grown = False
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world:
            try:
                rank, result, error, rss = pool.results.get(timeout=1.0)
            except queue_module.Empty:
                # a rank killed outright reports nothing: its peers' errors are the answer
                heard = set(results) | set(errors)
                dead = [r for r in range(world) if r not in heard and not pool.procs[r].is_alive()]
                if dead and len(heard) + len(dead) >= world:
                    for r in dead:
                        errors.setdefault(r, pool.crash_report(r))
                        if (pool.procs[r].exitcode or 0) < 0:
                            signalled.add(r)
                    break
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world)) - set(results) - set(errors))
                    raise RuntimeError(
                        f"ranks {missing} gave no result within {timeout_s:g} s"
                    ) from None
                continue
            if error:
                errors[rank] = error
            else:
                results[rank] = result
                grown |= rss > RANK_RSS_LIMIT_BYTES
    except BaseException:
        close_pool(graceful=False)
        raise
    if errors or grown:
        close_pool(graceful=False)
    if errors:
        # The rank that failed first, not one that lost its connection to it.
        rank = min(errors, key=lambda r: (r not in signalled, _lost_peer(errors[r]), r))
        raise (RankCrashed if rank in signalled else RuntimeError)(f"rank {rank}: {errors[rank]}")
    return [results[r] for r in range(world)]
