"""Processes that must not outlive the process that started them.

Linux delivers a chosen signal to a process when its parent exits (prctl PR_SET_PDEATHSIG),
even when the parent is killed with SIGKILL and runs no clean-up. The service's planning
processes, the torchrun it launches and every rank torchrun starts ask for SIGKILL this way,
so `kill -9` of the server ends the whole tree. Elsewhere (macOS) this is a no-op.

Two gaps are closed by watching a process id instead (`exit_when_gone`): the "parent" of
PR_SET_PDEATHSIG is the thread that started the child, so a child started from a pool
thread dies when that thread retires (the graph validator died after ~11 s idle); and a
process that asks for its signal only after its heavy imports lives on through them (ranks
importing torch outlived a killed server by ~50 s). Each such child starts a watcher before
anything heavy, on the pid of the process whose death must end it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None = None) -> None:
    """Ask for SIGKILL when the parent exits; exit now if it already has (the race between
    fork and this call), which shows as a parent other than `expected_parent`."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def exit_when_gone(pid: int | str | None, interval_s: float = 0.25) -> None:
    """Exit this process (status 1, no clean-up) within `interval_s` of process `pid`'s end;
    a daemon thread polls it. No-op for None (a process started by hand)."""
    if pid is None or pid == "":
        return
    if process_gone(pid):
        os._exit(1)

    def watch() -> None:
        while not process_gone(pid):
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name=f"exit-when-{pid}-gone", daemon=True).start()


# Children are started without the working directory on their import path (Python's -P):
# `python -m executor.worker` or `python -c ...` (multiprocessing's spawn and fork server)
# otherwise import from the folder the user stands in first, and a folder holding
# executor/worker.py ran that file on every rank, reported "succeeded".
SAFE_PATH = {"PYTHONSAFEPATH": "1"}
_environ_lock = threading.Lock()


@contextlib.contextmanager
def safe_path(**extra: str) -> Iterator[None]:
    """While inside, processes started through os.environ (multiprocessing's spawn and fork
    server) get SAFE_PATH and `extra`; subprocess calls pass `{**os.environ, **SAFE_PATH}`
    instead."""
    values = {**SAFE_PATH, **extra}
    with _environ_lock:
        before = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def launcher_gone() -> bool:
    """For a rank: True when the process that launched its torchrun (AUTOPAR_LAUNCHER_PID)
    is gone. A rank that asks for its death signal only after torchrun already died would
    otherwise live on (its parent is then init)."""
    pid = os.environ.get("AUTOPAR_LAUNCHER_PID")
    return bool(pid) and process_gone(pid)


def process_gone(pid: int | str) -> bool:
    """Whether process `pid` has exited (or is a zombie: killed, not yet reaped)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    try:  # killed but not yet reaped by its own parent: a zombie is gone too
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
        state = stat.rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


def limit_memory(max_bytes: int) -> None:
    """Cap this process's address space: allocations past it raise MemoryError here."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))
