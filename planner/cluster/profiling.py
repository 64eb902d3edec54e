"""Operator profiling: time a traced graph's operators on the local device and keep the times
in a profile database the cost model reads.

The database is SQLite, one row per (device, dtype, op, shape signature) with forward and
backward seconds and the op's work (FLOPs, or bytes moved for ops without FLOPs). The cost
model uses a row when a node's op and shapes match exactly; otherwise it interpolates linearly
in work between the two nearest measured shapes of the same op (so a tensor-parallel shard or
another micro-batch size is covered by measurements at other sizes); outside the measured range
it falls back to the roofline.

Each operator is rebuilt from the trace (its aten overload and the arguments recorded in
`attrs["args"]`, tensors replaced by random ones of the traced shapes) and timed forward, then
backward through autograd, as the median over repeats after a warm-up.
"""

from __future__ import annotations

import bisect
import datetime
import sqlite3
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.graph.opgraph import OpGraph, OpNode

SKIP_KINDS = frozenset({"input", "constant"})
SCHEMA = """
CREATE TABLE IF NOT EXISTS op_times (
    device TEXT NOT NULL,
    dtype TEXT NOT NULL,
    op TEXT NOT NULL,
    signature TEXT NOT NULL,
    work REAL NOT NULL,
    fwd_s REAL NOT NULL,
    bwd_s REAL NOT NULL,
    measured_at TEXT NOT NULL,
    PRIMARY KEY (device, dtype, op, signature)
)
"""


def signature(node: OpNode) -> str:
    """Shape signature keying measured op times (inputs, then parameters)."""
    shapes = [tuple(t.shape) for t in node.inputs] + [tuple(m.shape) for m in node.params.values()]
    return ";".join("x".join(map(str, s)) for s in shapes)


def work(node: OpNode) -> float:
    """The size measure times are interpolated in: FLOPs, or bytes moved for other ops."""
    return float(node.fwd_flops or (node.bytes_read + node.bytes_written))


@dataclass
class OpTimes:
    """Measured times for one device and dtype."""

    exact: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    by_op: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)

    def add(self, op: str, sig: str, w: float, fwd: float, bwd: float) -> None:
        self.exact[(op, sig)] = (fwd, bwd)
        points = self.by_op.setdefault(op, [])
        points.append((w, fwd, bwd))
        points.sort()

    def lookup(self, node: OpNode, shards: int = 1) -> tuple[float, float] | None:
        if shards == 1:
            hit = self.exact.get((node.op, signature(node)))
            if hit is not None:
                return hit
        points = self.by_op.get(node.op)
        if not points or len(points) < 2:
            return None
        w = work(node) / shards
        ws = [p[0] for p in points]
        if w < ws[0] or w > ws[-1]:
            return None
        i = min(max(bisect.bisect_left(ws, w), 1), len(points) - 1)
        (w0, f0, b0), (w1, f1, b1) = points[i - 1], points[i]
        frac = 0.0 if w1 == w0 else (w - w0) / (w1 - w0)
        return f0 + frac * (f1 - f0), b0 + frac * (b1 - b0)

    def __len__(self) -> int:
        return len(self.exact)


class OpProfileDB:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.execute(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30)

    def put(self, device: str, dtype: str, rows: list[dict[str, Any]]) -> None:
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        with self._connect() as db:
            db.executemany(
                "INSERT OR REPLACE INTO op_times VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (device, dtype, r["op"], r["signature"], r["work"], r["fwd_s"], r["bwd_s"], now)
                    for r in rows
                ],
            )

    def load(self, device: str, dtype: str) -> OpTimes:
        times = OpTimes()
        for op, sig, w, fwd, bwd in self.rows(device, dtype):
            times.add(op, sig, w, fwd, bwd)
        return times

    def rows(self, device: str, dtype: str) -> list[tuple[str, str, float, float, float]]:
        """(op, signature, work, fwd_s, bwd_s) rows measured on `device` in `dtype`."""
        with self._connect() as db:
            return db.execute(
                "SELECT op, signature, work, fwd_s, bwd_s FROM op_times "
                "WHERE device = ? AND dtype = ?",
                (device, dtype),
            ).fetchall()


def inline_op_db(cluster: Any, path: str | Path, field: str = "--op-db") -> Any:
    """`cluster` with the rows that the database at `path` holds for its device copied into
    `measured.op_times` (a profile carries measurements, never a path to open later)."""
    from planner.cluster.profile import Measured, OpTimeRow
    from planner.errors import InputError

    if not Path(path).is_file():
        raise InputError(field, f"no file {path}", "a database written by autopar profile-ops")
    try:
        with sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True) as db:
            found = db.execute(
                "SELECT dtype, op, signature, work, fwd_s, bwd_s FROM op_times WHERE device = ?",
                (cluster.device.name,),
            ).fetchall()
    except sqlite3.Error as err:
        raise InputError(field, f"{path} is not an operator database: {err}") from None
    keys = ("dtype", "op", "signature", "work", "fwd_s", "bwd_s")
    rows = [OpTimeRow(**dict(zip(keys, r, strict=True))) for r in found]
    measured = (cluster.measured or Measured()).model_copy(update={"op_times": rows})
    return cluster.model_copy(update={"measured": measured})


def op_times_from_rows(rows: list[Any], dtype: str) -> OpTimes | None:
    """OpTimes from a profile's inline `measured.op_times` rows of `dtype` (None without)."""
    times = OpTimes()
    for r in rows:
        if r.dtype == dtype:
            times.add(r.op, r.signature, r.work, r.fwd_s, r.bwd_s)
    return times if len(times) else None


# --- measuring -------------------------------------------------------------------------------
def distinct_ops(graphs: list[OpGraph]) -> list[OpNode]:
    """One node per (op, signature) over `graphs`, skipping views and inputs."""
    seen: dict[tuple[str, str], OpNode] = {}
    for graph in graphs:
        for node in graph.nodes:
            if node.is_view or node.kind in SKIP_KINDS or "args" not in node.attrs:
                continue
            seen.setdefault((node.op, signature(node)), node)
    return list(seen.values())


def _resolve_op(name: str):
    import torch

    ns, op, overload = [*name.split("."), "default"][:3]
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def build_call(node: OpNode, device: str):
    """(callable, float tensors needing grad) reproducing `node` with random inputs."""
    import torch

    tensors = []
    for kind, ref in node.attrs.get("operands", []):
        meta = node.inputs[ref] if kind == "input" else node.params[ref]
        dtype = getattr(torch, meta.dtype)
        if dtype.is_floating_point:
            t = torch.randn(meta.shape, dtype=dtype, device=device, requires_grad=True)
        else:
            t = torch.zeros(meta.shape, dtype=dtype, device=device)
        tensors.append(t)
    queue = list(tensors)

    def fill(arg):
        if isinstance(arg, dict) and "node" in arg:
            return queue.pop(0) if queue else None
        if isinstance(arg, list):
            return [fill(a) for a in arg]
        if isinstance(arg, str) and arg.startswith("torch."):
            return getattr(torch, arg.removeprefix("torch."), arg)
        return arg

    args = [fill(a) for a in node.attrs["args"]]
    op = _resolve_op(node.op)
    grads = [t for t in tensors if t.requires_grad]
    return (lambda: op(*args)), grads


def _median(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def time_node(node: OpNode, device: str = "cpu", repeats: int = 5) -> dict[str, Any] | None:
    """Forward and backward seconds of `node` on `device`; None if it cannot be rebuilt."""
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    try:
        call, grads = build_call(node, device)
        fwd = _median(call, repeats, sync)
        bwd = 0.0
        out = call()
        out = out[0] if isinstance(out, tuple | list) else out
        if grads and isinstance(out, torch.Tensor) and out.requires_grad:
            grad = torch.ones_like(out)
            bwd = _median(
                lambda: torch.autograd.grad(out, grads, grad, retain_graph=True, allow_unused=True),
                repeats,
                sync,
            )
    except (RuntimeError, TypeError, ValueError, AttributeError, IndexError):
        return None
    return {
        "op": node.op,
        "signature": signature(node),
        "work": work(node),
        "fwd_s": fwd,
        "bwd_s": bwd,
    }


def profile_nodes(
    nodes: list[OpNode],
    device: str = "cpu",
    repeats: int = 5,
    threads: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[dict[str, Any]]:
    import torch

    if threads:
        torch.set_num_threads(threads)
    rows = []
    for i, node in enumerate(nodes):
        row = time_node(node, device, repeats)
        if row is not None:
            rows.append(row)
        if progress:
            progress(node.op, i + 1, len(nodes))
    return rows


def _profile_worker(args: tuple) -> list[dict[str, Any]]:
    nodes, device, repeats, threads = args
    return profile_nodes(nodes, device, repeats, threads)


def profile_concurrently(
    nodes: list[OpNode], concurrency: int, device: str, repeats: int, threads: int
) -> list[dict[str, Any]]:
    """The same op list timed by `concurrency` processes at once (as ranks sharing a host
    compute at the same time); per op the median over processes."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(concurrency) as pool:
        results = pool.map(_profile_worker, [(nodes, device, repeats, threads)] * concurrency)
    merged: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rows in results:
        for r in rows:
            merged.setdefault((r["op"], r["signature"]), []).append(r)
    return [
        {
            **rs[0],
            "fwd_s": statistics.median(r["fwd_s"] for r in rs),
            "bwd_s": statistics.median(r["bwd_s"] for r in rs),
        }
        for rs in merged.values()
    ]
