"""A throw-away PostgreSQL server for the store tests: a new cluster in a temporary folder,
listening on a free loopback port, stopped and removed at the end.

It uses Debian's `postgresql` binaries (`make test` installs the package). PostgreSQL refuses
to run as root, so as root the cluster belongs to the package's `postgres` user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise RuntimeError(
            f"PostgreSQL's {name} is not installed: `make test` installs Debian's postgresql"
        )
    return found[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Yields a SQLAlchemy URL (postgresql+psycopg) of an empty database `autopar`."""
    root = Path(tempfile.mkdtemp(prefix="autopar-pg-"))
    data, sockets = root / "data", root / "run"
    sockets.mkdir()
    as_user: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        for path in (root, sockets):
            os.chown(path, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = _free_port()

    def run(*cmd: str) -> None:
        subprocess.run([*as_user, *cmd], check=True, capture_output=True, text=True, timeout=120)

    run(_bin("initdb"), "-D", str(data), "-U", "autopar", "--auth=trust", "-E", "UTF8")
    options = (
        f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off "
        "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
    )
    log = root / "server.log"
    run(_bin("pg_ctl"), "-D", str(data), "-o", options, "-l", str(log), "-w", "start")
    try:
        run(_bin("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "autopar", "autopar")
        yield f"postgresql+psycopg://autopar@127.0.0.1:{port}/autopar"
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            run(_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)
