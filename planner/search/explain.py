"""What the search tells the user about its choice: a one-line summary per candidate, the
top-k alternatives, and why the winner beats the next best mesh."""

from __future__ import annotations

from planner.parallel.registry import stores
from planner.parallel.tensor import FOLDED_KIND
from planner.plan import Alternative


def summary(c) -> str:
    """One line for a search.Candidate."""
    cfg = c.config
    parts = [
        cfg.dims.summary(),
        f"mbs {c.mbs} x {cfg.microbatches}",
        cfg.schedule,
        f"zero{cfg.zero}"
        + (" on the fewest layers, zero2 on the rest" if cfg.layerwise_zero else "")
        + (f" HSDP over {cfg.dp_shard}" if cfg.hybrid else "")
        + (" CPU offload" if cfg.offload else ""),
    ]
    if cfg.checkpointing:
        names = {
            "selective": "selective ckpt",
            "selective_alternate": "alternating selective ckpt",
            "partial": "ckpt of the fewest layers",
        } | {mode: store.label for mode, store in stores().items()}
        parts.append(names.get(cfg.checkpointing, "ckpt"))
    if cfg.tp > 1 and c.layout == "megatron_sp":
        parts.append("megatron tp layout with sequence parallelism")
    elif cfg.tp > 1 and c.layout == FOLDED_KIND:
        parts.append("megatron tp layout with sequence parallelism, experts whole (etp 1)")
    elif cfg.tp > 1:
        parts.append(f"{c.layout} tp layout")
    if cfg.fp8:
        parts.append(f"fp8 {cfg.fp8}")
    if c.ranges:
        parts.append("DP stages")
    return ", ".join(parts)


def alternatives(candidates: list, k: int, first: bool = False) -> list[Alternative]:
    """The next k candidates with distinct (mesh, schedule, micro-batches); from the first
    (`first`) where the plan is none of them (a per-stage plan)."""
    out, seen = [], set()
    for c in candidates[0 if first else 1 :]:
        cfg = c.config
        shape = (cfg.pp, cfg.dp, cfg.tp, cfg.cp, cfg.schedule, cfg.microbatches)
        if shape in seen:
            continue
        seen.add(shape)
        out.append(
            Alternative(
                summary=summary(c),
                mesh=[cfg.pp, cfg.dp, cfg.tp],
                schedule=cfg.schedule,
                microbatches=cfg.microbatches,
                step_time_s=c.step_time_s,
                peak_memory_bytes=c.peak_memory,
            )
        )
        if len(out) >= k:
            break
    return out


def why(best, candidates: list) -> list[str]:
    """Why `best` beats the best candidate on another mesh."""
    lines = [f"Chosen: {summary(best)}, out of {len(candidates)} fitting candidates."]
    bc = best.config
    other = next(
        (
            c
            for c in candidates[1:]
            if (c.config.pp, c.config.dp, c.config.tp) != (bc.pp, bc.dp, bc.tp)
        ),
        None,
    )
    if other is None:
        return lines
    a, b = best.prediction, other.prediction
    gain = (b.step_time_s - a.step_time_s) / b.step_time_s
    lines.append(
        f"Next best mesh: {summary(other)} at {b.step_time_s:.3f} s per step ({gain:.1%} slower)."
    )

    def clearly_less(x: float, y: float) -> bool:
        """Lower by at least 2% and by at least 1% of the step time."""
        return x < 0.98 * y and y - x > 0.01 * a.step_time_s

    reasons = []
    if a.bubble_fraction + 0.01 < b.bubble_fraction:
        reasons.append(
            f"a smaller pipeline bubble ({a.bubble_fraction:.1%} vs {b.bubble_fraction:.1%})"
        )
    if clearly_less(a.comm_s, b.comm_s):
        reasons.append(f"less exposed communication ({a.comm_s:.3f} s vs {b.comm_s:.3f} s)")
    if clearly_less(a.stage_compute_s, b.stage_compute_s):
        reasons.append("less compute per micro-batch on the slowest stage")
    if clearly_less(a.peak_memory_bytes, b.peak_memory_bytes) and not reasons:
        reasons.append("the same speed class with less memory")
    if reasons:
        lines.append("It wins by " + "; ".join(reasons) + ".")
    else:
        lines.append(
            "The two are within the cost model's noise; the tie is broken by a "
            "fixed order (fewer pipeline stages, then less data parallelism)."
        )
    return lines
