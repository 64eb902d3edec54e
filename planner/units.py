"""Numbers as people read them, by magnitude: bytes, counts, FLOP rates, plurals. One place
for the CLI, the plan's explanation and error messages."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def human_flops(per_s: float) -> str:
    """A FLOP rate in the largest unit that keeps it at 1 or more: "312.0 TFLOP/s",
    "48.2 GFLOP/s"."""
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if per_s >= scale:
            return f"{per_s / scale:.1f} {unit}"
    return f"{per_s:.0f} FLOP/s"


def plural(n: int, word: str, many: str | None = None) -> str:
    """ "1 node", "2 nodes", "1 micro-batch", "8 micro-batches"."""
    return f"{n} {word if n == 1 else (many or word + ('es' if word.endswith('h') else 's'))}"
