"""An on-disk cache of what planning computes again and again for the same inputs: traces (by
model, config, sequence, dtype and micro-batch), the intra-op ILP's layouts (by model,
micro-batch, tp, cluster and solver) and whole answers (planner.planning: by everything the
request and the search options say), shared by the CLI, the service and the benches.

Entries are gzipped, named by the SHA-256 of their key (the key includes autopar's and
torch's versions, a digest of the planner's own source files and the entry format, so an
upgrade or an edited cost model misses rather than reuses): a JSON header
line (the key, the SHA-256 of the payload's text) and the payload's JSON text. The checksum is
taken over the stored text, so a load hashes bytes instead of re-serialising the payload. An
entry that does not parse, names another key or fails its checksum is treated as missing,
removed, and rebuilt by the caller. Writes go to a temporary file and
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
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from planner import __version__

FORMAT = 2  # 2: header line + payload text (1 was one JSON object with the payload inside)


def cache_dir(configured: str | None = None) -> Path | None:
    """The cache's directory: `configured` (a service's setting), else AUTOPAR_CACHE_DIR,
    else the user's cache directory; None when set to "off"."""
    if configured is None:
        configured = os.environ.get("AUTOPAR_CACHE_DIR")
    if configured is not None:
        return None if configured.strip().lower() in ("", "off", "none", "0") else Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autopar"


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@cache
def _torch_version() -> str:
    # The installed distribution's version: the same string as torch.__version__, without
    # importing torch (a warm-cache plan need not pay its import).
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


@cache
def _planner_digest() -> str:
    """SHA-256 over the planner package's source files: what it caches (traces, layouts,
    cost tables) is computed by that code."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def key_of(kind: str, material: Any) -> str:
    """A stable key for JSON-able material, versioned with autopar's code, torch and the
    format."""
    text = json.dumps(
        {
            "kind": kind,
            "autopar": __version__,
            "code": _planner_digest(),
            "torch": _torch_version(),
            "format": FORMAT,
            "key": material,
        },
        sort_keys=True,
        default=str,
    )
    return _digest(text.encode())


def _path(kind: str, key: str, configured: str | None = None) -> Path | None:
    root = cache_dir(configured)
    return None if root is None else root / kind / f"{key}.json.gz"


def load(kind: str, key: str, configured: str | None = None) -> Any | None:
    """The payload stored under `key`, or None (missing, unreadable or corrupt: removed);
    `configured`: the directory, as for cache_dir."""
    path = _path(kind, key, configured)
    if path is None or not path.exists():
        return None
    try:
        header, _, text = gzip.decompress(path.read_bytes()).partition(b"\n")
        entry = json.loads(header)
        ok = entry["key"] == key and entry["sha256"] == _digest(text)
        payload = json.loads(text) if ok else None
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
    text = json.dumps(payload, separators=(",", ":")).encode()
    header = json.dumps({"key": key, "sha256": _digest(text)}).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(gzip.compress(header + b"\n" + text, compresslevel=1))
            tmp = f.name
        os.replace(tmp, path)
    except OSError:
        pass
