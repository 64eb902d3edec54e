"""The replica's heartbeat: a process of its own that keeps the leases of the jobs the replica
runs, and gives them up the moment the replica dies.

The supervisor thread (api.service.jobs) renews leases too, but it shares the server's
interpreter with the request handlers: a handler that held it (a quadratic regex once held
it 34 s) stopped the renewals, another replica took the jobs over, and a healthy training
run was stopped. This process renews whatever the server's interpreter is doing. It watches
the server's pid: once the server is gone (kill -9 included) it releases the replica's jobs
at once (Store.release: plans back to the queue, executions failed), so another replica
takes them without waiting for the leases to run out, and whatever an orphaned process of
the dead replica still writes under its old lease is refused by the store.
"""

from __future__ import annotations

import multiprocessing
import sys
import time

from api.service.store import Store
from executor.lifetime import process_gone, safe_path

POLL_S = 0.1  # how often the server's pid is checked


def run(database_url: str, owner: str, lease_s: float, server_pid: int) -> None:
    """Process entry point: renew `owner`'s leases every lease_s / 3 while `server_pid`
    lives; then release them and exit."""
    store = Store(database_url)
    renewed = 0.0
    try:
        while not process_gone(server_pid):
            if time.monotonic() - renewed >= lease_s / 3:
                try:
                    store.extend(owner, lease_s)
                    renewed = time.monotonic()
                except Exception as err:  # the database may be briefly unreachable
                    print(f"heartbeat: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            time.sleep(POLL_S)
        store.release(owner)
    finally:
        store.close()


class Heartbeat:
    """The heartbeat process of one replica; `ensure` (re)starts it."""

    def __init__(self, database_url: str, owner: str, lease_s: float, server_pid: int):
        self.args = (database_url, owner, lease_s, server_pid)
        self._proc: multiprocessing.process.BaseProcess | None = None

    def ensure(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        proc = multiprocessing.get_context("spawn").Process(
            target=run, args=self.args, name="autopar-heartbeat", daemon=True
        )
        with safe_path():
            proc.start()
        self._proc = proc

    def stop(self) -> None:
        """Service shutdown: the supervisor hands the jobs back itself."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
            self._proc = None
