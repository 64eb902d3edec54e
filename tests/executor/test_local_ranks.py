"""The gloo test harness (executor.local_ranks): runs reuse the rank processes, a failed run
leaves no process behind to poison the next, and a reused rank reports its run's own results
(the same losses as a fresh one, the memory peak of that run alone)."""

import os
import signal

import pytest

import executor.local_ranks as local_ranks
from executor.data import synthetic_batch
from executor.local_ranks import run_local
from tests.executor.test_execute import TINY, _plan

# ~170 MB of fp32 parameters and as much in gradients per rank, against ~100 kB
LARGE = {**TINY, "hidden": 1024, "heads": 8, "vocab": 16384}


def _pids() -> list[int]:
    return [p.pid for p in local_ranks._pool.procs]


@pytest.mark.distributed
def test_runs_reuse_ranks_and_a_failed_run_starts_them_afresh(tmp_path):
    (tmp_path / "large").mkdir()
    plan, _ = _plan(tmp_path, "--mesh", "1x4x1", "--zero", "0", layers=1)
    large, _ = _plan(
        tmp_path / "large", "--mesh", "1x4x1", "--zero", "0", model=("gpt-350m", LARGE)
    )
    first = run_local(plan, steps=2)
    pids = _pids()
    big = run_local(large, steps=1)
    again = run_local(plan, steps=2)
    assert _pids() == pids  # the same processes ran all three
    assert [s["loss"] for s in again[0]["steps"]] == [s["loss"] for s in first[0]["steps"]]
    # the small run's peak is its own, not the large run's, which the process also held
    for small, large_run in zip(again, big, strict=True):
        grew = large_run["steps"][-1]["peak_rss_bytes"] - large_run["start_rss_bytes"]
        assert grew > 100e6
        assert small["steps"][-1]["peak_rss_bytes"] < large_run["steps"][-1]["peak_rss_bytes"]

    # every rank fails (a data factory that does not exist): the error names it, and the
    # failed processes are gone
    with pytest.raises(RuntimeError, match="no_such_module"):
        run_local(plan, steps=1, data="no_such_module:batches")
    assert local_ranks._pool is None
    assert not any(_alive(pid) for pid in pids)
    fresh = run_local(plan, steps=2)
    assert set(_pids()).isdisjoint(pids)
    assert [s["loss"] for s in fresh[0]["steps"]] == [s["loss"] for s in first[0]["steps"]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


def crashing_rank_batches(seq_len: int, vocab: int, seed: int):
    """A data factory (executor/data.py) whose rank 1 dies by SIGSEGV, as a crash in native
    code would kill it, in a frame of its own that its stacks must show."""
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSEGV)
    return lambda step, batch: synthetic_batch(step, batch, seq_len, vocab, seed)


@pytest.mark.distributed
def test_a_rank_killed_by_a_signal_is_named_with_where_it_was(tmp_path):
    plan, _ = _plan(tmp_path, "--mesh", "1x4x1", "--zero", "0", layers=1)
    # a crash is rerun once on fresh ranks (local_ranks.run_local); this one recurs
    with (
        pytest.warns(RuntimeWarning, match="rerun on fresh ranks"),
        pytest.raises(local_ranks.RankCrashed) as failed,
    ):
        run_local(plan, steps=1, data=f"{__name__}:crashing_rank_batches")
    message = str(failed.value)
    assert message.startswith(f"rank 1: rank process exited (code {-signal.SIGSEGV})")
    assert "Segmentation fault" in message
    assert "crashing_rank_batches" in message  # the Python frame it died in
    assert local_ranks._pool is None
