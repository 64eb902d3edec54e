"""Processes that must not outlive the process that started them.

Linux delivers a chosen signal to a process when its parent exits (prctl PR_SET_PDEATHSIG),
even when the parent is killed with SIGKILL and runs no clean-up. The service's planning
processes, the torchrun it launches and every rank torchrun starts ask for SIGKILL this way,
so `kill -9` of the server ends the whole tree. Elsewhere (macOS) this is a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
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
