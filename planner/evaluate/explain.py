"""The plan's explanation: what the predicted figures mean, in sentences."""

from __future__ import annotations

from planner.plan import Predicted, Stage
from planner.units import human_bytes as _gib
from planner.units import human_flops, plural


def explain(pred: Predicted, stages: list[Stage], cfg, cluster, slowest: int) -> list[str]:
    lines = [
        f"Predicted step {pred.step_time_s:.3f} s: {human_flops(pred.tflops_per_device * 1e12)} "
        f"per device ({pred.mfu:.0%} of peak).",
        f"Pipeline bubble: {pred.bubble_fraction:.1%} of the pipeline time with "
        f"{plural(cfg.microbatches, 'micro-batch')} over {plural(cfg.pp, 'stage')} "
        f"({cfg.schedule}).",
        f"Stage {slowest} is the slowest; communication not hidden by compute is "
        f"{pred.comm_s:.3f} s per step.",
    ]
    worst = max(stages, key=lambda st: st.predicted.memory.total)
    mem = worst.predicted.memory
    cap = cluster.usable_memory_bytes
    verdict = "fits" if mem.total <= cap else "does NOT fit"
    kept = cluster.memory_headroom_bytes
    room = f" ({_gib(cluster.device.memory_bytes)} less {_gib(kept)} headroom)" if kept else ""
    lines.append(
        f"Peak memory {_gib(mem.total)} on stage {worst.index} {verdict} in {_gib(cap)}{room}: "
        f"params {_gib(mem.params)}, grads {_gib(mem.grads)}, optimizer {_gib(mem.optimizer)}, "
        f"activations {_gib(mem.activations)}."
    )
    return lines
