"""Prediction error on cpu-local, with and without the measured profile.

1. `profile-cluster` on 4 gloo processes (collectives, matmul, memory, overlap) -> a measured
   profile;
2. `profile-ops` of the bench model's operators, 4 processes at once with one thread each (as
   torchrun runs the ranks) -> an operator database the measured profile points to;
   `profile-executor`: the executor's own overhead from three calibration runs of a different,
   smaller model (executor/overhead.py);
3. the top-3 configurations of a search (as in execute_bench.py) are executed for 6 steps;
   each one's step time is predicted with the datasheet profile and with the measured one.

Run: python bench/prediction_error.py   (writes bench/results/prediction_error.md and
bench/results/cpu-local-measured.yaml)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import yaml
from common import RESULTS, header, write
from execute_bench import BATCH, CONFIG, SEQ, plan_for, top_configurations

from executor.launch import execute
from executor.overhead import calibrate
from executor.profile_cluster import profile_cluster
from planner.cluster.profile import ClusterProfile, load_cluster
from planner.cluster.profiling import OpProfileDB, distinct_ops, profile_concurrently
from planner.graph.tracing import trace_model
from planner.models import ModelSpec, resolve


def measure_profile(tmp: Path) -> ClusterProfile:
    base = load_cluster("cpu-local")
    op_db = tmp / "ops.db"
    resolved = resolve(ModelSpec(name="gpt-350m", config=CONFIG))
    graphs = [trace_model(resolved, b, SEQ, "fp32") for b in (1, 2, 4, 8, 16)]
    rows = profile_concurrently(distinct_ops(graphs), 4, "cpu", repeats=10, threads=1)
    OpProfileDB(op_db).put(base.device.name, "fp32", rows)
    print(f"timed {len(rows)} operators", file=sys.stderr)
    path = tmp / "measured.yaml"
    profile = profile_cluster(
        base, path, nproc_per_node=4, repeats=5, max_bytes=2**24, op_db=str(op_db)
    )
    assert profile is not None
    profile = calibrate(profile, op_db, say=lambda line: print(line, file=sys.stderr))
    doc = profile.model_dump(mode="json", exclude_none=True)
    doc["measured"].pop("op_db", None)  # a temporary file; not part of the committed profile
    (RESULTS / "cpu-local-measured.yaml").write_text(
        "# Measured on the bench machine by bench/prediction_error.py (operator times were\n"
        "# in a temporary database, not committed).\n" + yaml.safe_dump(doc, sort_keys=False)
    )
    return profile


def main() -> None:
    datasheet = load_cluster("cpu-local")
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        measured = measure_profile(tmp)
        traces, training, model, picked = top_configurations(datasheet)
        for i, c in enumerate(picked):
            plan = plan_for(c, traces, datasheet, training, model)
            with_profile = plan_for(c, traces, measured, training, model)
            path = tmp / f"plan{i}.json"
            path.write_text(plan.to_json())
            run = execute(path, tmp / f"run{i}", steps=6, timeout_s=600)
            cfg = c.config
            rows.append(
                {
                    "plan": f"pp{cfg.pp} dp{cfg.dp} tp{cfg.tp} m{cfg.microbatches} "
                    f"{cfg.schedule} z{cfg.zero}",
                    "datasheet": plan.predicted.step_time_s,
                    "measured_profile": with_profile.predicted.step_time_s,
                    "measured": run.measured_step_s,
                    "status": run.status,
                }
            )
            print(rows[-1], file=sys.stderr, flush=True)
    text = header(
        "Prediction error on cpu-local: datasheet vs measured profile",
        "python bench/prediction_error.py",
    )
    text += (
        f"\nModel: gpt-350m with {CONFIG}, seq {SEQ}, global batch {BATCH}, fp32, SGD; 4 gloo "
        "processes on 2 cores, 6 steps each (median of steps 2-6).\n"
        "Measured profile: `profile-cluster` (4 ranks) + `profile-ops` (4 processes at once, "
        "1 thread each) + `profile-executor` (calibration runs of a 2-layer, 128-wide GPT), "
        "committed as `cpu-local-measured.yaml`.\n\n"
        "| plan | measured s | predicted, datasheet | error | predicted, measured profile "
        "| error |\n|---|---|---|---|---|---|\n"
    )
    errs = {"datasheet": [], "measured_profile": []}
    for r in rows:
        cells = [r["plan"], f"{r['measured']:.4f}" if r["measured"] else r["status"]]
        for key in ("datasheet", "measured_profile"):
            err = (r[key] - r["measured"]) / r["measured"] if r["measured"] else None
            if err is not None:
                errs[key].append(abs(err))
            cells += [f"{r[key]:.4f}", f"{err:+.0%}" if err is not None else "-"]
        text += "| " + " | ".join(cells) + " |\n"
    for key, label in (("datasheet", "datasheet"), ("measured_profile", "measured profile")):
        if errs[key]:
            text += (
                f"\nMean absolute error, {label}: {sum(errs[key]) / len(errs[key]):.0%} "
                f"(max {max(errs[key]):.0%})."
            )
    text += "\nTarget: within 25% with the measured profile.\n"
    write("prediction_error.md", text)


if __name__ == "__main__":
    main()
