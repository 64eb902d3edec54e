"""Measure what the executor itself costs beyond operators and collectives.

Operator times (profile-ops) and collective fits (profile-cluster) predict plain forward and
backward well, but FSDP2's hooks and copies, DTensor dispatch under tensor parallelism and the
pipeline schedule's per-micro-batch work add time of their own, large on CPUs. Four small
calibration runs on this node isolate each (a model unlike the ones users plan, so nothing is
fitted to a user's runs):

- data parallel (FSDP2) on every local rank, with 1 and with 4 micro-batches: the part that
  grows with micro-batches (FSDP's hooks run for each) per layer and micro-batch, the rest per
  layer and step;
- tp 2 x dp: what remains after the FSDP share, per layer and micro-batch;
- pp 2 x dp, 1F1B: what remains, per micro-batch and stage, with the pipeline's (m + p - 1)
  micro-batch slots.

Predictions come from the cost model with the profile's measured operators (the calibration
model's operators are timed first, with as many processes at once as the runs use).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from executor.launch import execute
from planner.cluster.profile import ClusterProfile, ExecutorOverhead, Measured
from planner.cluster.profiling import OpProfileDB, distinct_ops, inline_op_db, profile_concurrently
from planner.evaluate.config import ParallelConfig
from planner.evaluate.estimate import evaluate
from planner.graph.batch import graph_at
from planner.graph.tracing import trace_model
from planner.models import ModelSpec, resolve
from planner.plan import TrainingSettings
from planner.request import model_ref

MODEL = ModelSpec(name="gpt-350m", config={"layers": 2, "hidden": 128, "heads": 4, "vocab": 512})
SEQ, GLOBAL_BATCH, STEPS = 64, 16, 6


def _runs(nproc: int) -> dict[str, ParallelConfig]:
    half = max(nproc // 2, 1)
    return {
        "fsdp": ParallelConfig(dp=nproc, tp=1, pp=1, microbatches=1, zero=1),
        "fsdp_mb": ParallelConfig(dp=nproc, tp=1, pp=1, microbatches=4, zero=1),
        "tp": ParallelConfig(dp=half, tp=2, pp=1, microbatches=1, zero=1),
        "pp": ParallelConfig(dp=half, tp=1, pp=2, microbatches=4, zero=1),
    }


def calibrate(
    profile: ClusterProfile,
    op_db: str | Path,
    work_dir: str | Path | None = None,
    say: Callable[[str], None] = print,
) -> ClusterProfile:
    """`profile` with `measured.executor_overhead` (and `op_db`) set from calibration runs on
    `profile.devices_per_node` local processes."""
    nproc = profile.devices_per_node
    if nproc < 4 or nproc % 2:
        raise ValueError("calibration needs an even number >= 4 of local devices")
    resolved = resolve(MODEL).with_seq(SEQ)
    training = TrainingSettings(
        global_batch_size=GLOBAL_BATCH, seq_len=SEQ, dtype="fp32", optimizer="sgd"
    )
    model = model_ref(resolved, SEQ)
    g1, g2 = (trace_model(resolved, b, SEQ, "fp32") for b in (1, 2))
    runs = _runs(nproc)
    sizes = sorted({GLOBAL_BATCH // (c.dp * c.microbatches) for c in runs.values()})
    say(f"timing the calibration model's operators (batches {sizes}, {nproc} processes)")
    graphs = [trace_model(resolved, b, SEQ, "fp32") for b in sizes]
    rows = profile_concurrently(distinct_ops(graphs), nproc, "cpu", repeats=10, threads=1)
    OpProfileDB(op_db).put(profile.device.name, "fp32", rows)
    profile = inline_op_db(profile, op_db)
    measured = (profile.measured or Measured()).model_copy(update={"executor_overhead": None})
    base = profile.model_copy(update={"nodes": 1, "measured": measured})
    layers = resolved.config.layers
    results: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        for name, cfg in runs.items():
            mbs = GLOBAL_BATCH // (cfg.dp * cfg.microbatches)
            plan = evaluate(
                graph_at(g1, g2, mbs), base, training, cfg, model, tokens_per_sample=SEQ
            )
            path = Path(tmp) / f"{name}.json"
            path.write_text(plan.to_json())
            run = execute(path, Path(tmp) / name, steps=STEPS, timeout_s=600)
            if run.measured_step_s is None:
                raise RuntimeError(f"calibration run {name} failed: {run.errors}")
            results[name] = (run.measured_step_s, plan.predicted.step_time_s)
            say(
                f"  {name}: measured {run.measured_step_s:.4f} s, operators and collectives "
                f"predict {plan.predicted.step_time_s:.4f} s"
            )
    residual = {name: max(meas - pred, 0.0) for name, (meas, pred) in results.items()}
    extra_mb = runs["fsdp_mb"].microbatches - 1
    fsdp_mb = max(residual["fsdp_mb"] - residual["fsdp"], 0.0) / (layers * extra_mb)
    fsdp = max(residual["fsdp"] / layers - fsdp_mb, 0.0)
    tp_cfg = runs["tp"]
    fsdp_share = layers * (fsdp + fsdp_mb * tp_cfg.microbatches)
    tp = max(residual["tp"] - fsdp_share, 0.0) / (layers * tp_cfg.microbatches)
    pp_cfg = runs["pp"]
    slots = pp_cfg.microbatches + pp_cfg.pp - 1
    per_stage = layers / pp_cfg.pp
    fsdp_share = per_stage * (fsdp + fsdp_mb * slots)
    pp = max(residual["pp"] - fsdp_share, 0.0) / slots
    overhead = ExecutorOverhead(
        fsdp_layer_step_s=fsdp,
        fsdp_layer_microbatch_s=fsdp_mb,
        tp_layer_microbatch_s=tp,
        pp_microbatch_s=pp,
        calibrated_with=f"{MODEL.name} {MODEL.config}, seq {SEQ}, global batch {GLOBAL_BATCH}, "
        f"{nproc} processes",
    )
    return profile.model_copy(
        update={"measured": measured.model_copy(update={"executor_overhead": overhead})}
    )
