"""An on-disk cache of what planning computes again and again for the same inputs: traces (by
model, config, sequence, dtype and micro-batch) and the intra-op ILP's layouts (by model,
micro-batch, tp, cluster and solver), shared by the CLI, the service and the benches.

Entries are gzipped JSON named by the SHA-256 of their key (the key includes autopar's and
torch's versions, so an upgrade misses rather than reuses). Each entry stores its key and the
SHA-256 of its payload; an entry that does not parse, names another key or fails its checksum
is treated as missing, removed, and rebuilt by the caller. Writes go to a temporary file and
are renamed into place, so a reader never sees half an entry and concurrent writers of the
same key leave one whole entry.

Location: $AUTOPAR_CACHE_DIR, else $XDG_CACHE_HOME/autopar, else ~/.cache/autopar;
AUTOPAR_CACHE_DIR=off disables it. Nothing a request sends names a path here.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from planner import __version__


def cache_dir() -> Path | None:
    configured = os.environ.get("AUTOPAR_CACHE_DIR")
    if configured is not None:
        return None if configured.strip().lower() in ("", "off", "none", "0") else Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autopar"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def key_of(kind: str, material: Any) -> str:
    """A stable key for JSON-able material, versioned with autopar and torch."""
    import torch

    text = json.dumps(
        {"kind": kind, "autopar": __version__, "torch": torch.__version__, "key": material},
        sort_keys=True,
        default=str,
    )
    return _digest(text)


def _path(kind: str, key: str) -> Path | None:
    root = cache_dir()
    return None if root is None else root / kind / f"{key}.json.gz"


def load(kind: str, key: str) -> Any | None:
    """The payload stored under `key`, or None (missing, unreadable or corrupt: removed)."""
    path = _path(kind, key)
    if path is None or not path.exists():
        return None
    try:
        entry = json.loads(gzip.decompress(path.read_bytes()))
        payload = entry["payload"]
        ok = entry["key"] == key and entry["sha256"] == _digest(json.dumps(payload))
    except (OSError, ValueError, KeyError, TypeError, EOFError, gzip.BadGzipFile):
        ok = False
    if not ok:
        path.unlink(missing_ok=True)
        return None
    return payload


def store(kind: str, key: str, payload: Any) -> None:
    """Write an entry (best effort: a read-only or full disk only costs the next run time)."""
    path = _path(kind, key)
    if path is None:
        return
    entry = {"key": key, "sha256": _digest(json.dumps(payload)), "payload": payload}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(gzip.compress(json.dumps(entry).encode(), compresslevel=1))
            tmp = f.name
        os.replace(tmp, path)
    except OSError:
        pass
