"""The activation peak does not depend on which thread frees a storage last: gloo's worker
thread often drops a collective's buffers a moment after the wait returns, and the peak
must not count them then."""

import threading

import torch

from executor.ledger import LiveBytes

FLOAT = 4


def _peak(release_on_another_thread: bool) -> int:
    """`a` is used once, then dropped here while (optionally) another thread still holds
    it; `c` is made; only then does the other thread let `a` go."""
    held: list[torch.Tensor] = []
    release, released = threading.Event(), threading.Event()

    def holder() -> None:
        release.wait()
        held.clear()
        released.set()

    thread = threading.Thread(target=holder)
    thread.start()
    with LiveBytes([], {}) as live:
        a = torch.ones(1000)
        b = a * 2
        if release_on_another_thread:
            held.append(a)
        del a
        c = torch.ones(2000)
        release.set()
        released.wait()
        d = b[:10] + c[:10]
        del b, c, d
    thread.join()
    return live.peak()


def test_a_storage_freed_by_another_thread_counts_as_freed_after_its_last_use():
    alone = _peak(release_on_another_thread=False)
    # b, c and d live together; a went after b was made from it
    assert alone == (1000 + 2000 + 10) * FLOAT
    assert _peak(release_on_another_thread=True) == alone
