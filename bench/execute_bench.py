"""Predicted vs measured step time of the planner's top plans, executed on this machine
(cpu-local profile: 4 gloo processes). Does the predicted ranking hold?

The top configurations of one `autopar plan` search are re-evaluated into full plans and run
for 6 steps each (the first step, with one-off setup, is left out of the median).

Run: python bench/execute_bench.py   (writes bench/results/execute.md)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from common import header, write

from executor.launch import execute
from planner.cluster.profile import load_cluster
from planner.evaluate.estimate import evaluate
from planner.graph.batch import graph_at
from planner.request import resolve_request
from planner.search.search import search

CONFIG = {"layers": 4, "hidden": 256, "heads": 4, "vocab": 1024}
SEQ, BATCH, TOP = 128, 16, 3


def top_configurations(cluster, top: int = TOP):
    """(traces at batch 1 and 2, training, model ref, the `top` best distinct candidates)."""
    fields = {"global_batch_size": BATCH, "seq_len": SEQ, "dtype": "fp32"}
    inputs = resolve_request({"name": "gpt-350m", "config": CONFIG}, cluster, fields).trace()
    result = search(inputs)
    g1, g2, training, model = inputs.graph, inputs.second, inputs.training, inputs.model
    picked, seen = [], set()
    for c in result.candidates:  # the best distinct meshes/schedules, Megatron-pattern layouts
        key = (c.config.pp, c.config.dp, c.config.tp, c.config.schedule)
        if key in seen or (c.config.tp > 1 and c.layout != "megatron"):
            continue
        seen.add(key)
        picked.append(c)
        if len(picked) == top:
            break
    return (g1, g2), training, model, picked


def plan_for(candidate, traces, cluster, training, model):
    """The full plan of a search candidate, evaluated under `cluster`."""
    return evaluate(
        graph_at(*traces, candidate.mbs),
        cluster,
        training,
        candidate.config,
        model,
        tokens_per_sample=SEQ,
        ranges=list(candidate.ranges) if candidate.ranges else None,
    )


def main() -> None:
    cluster = load_cluster("cpu-local")
    (g1, g2), training, model, picked = top_configurations(cluster)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, c in enumerate(picked):
            plan = plan_for(c, (g1, g2), cluster, training, model)
            path = Path(tmp) / f"plan{i}.json"
            path.write_text(plan.to_json())
            run = execute(path, Path(tmp) / f"run{i}", steps=6, timeout_s=600)
            cfg = c.config
            rows.append(
                (
                    plan.predicted.step_time_s,
                    run.measured_step_s,
                    f"pp{cfg.pp} dp{cfg.dp} tp{cfg.tp} m{cfg.microbatches} "
                    f"{cfg.schedule} z{cfg.zero}",
                    run.status,
                )
            )
            print(rows[-1], file=sys.stderr, flush=True)
    pred_rank = sorted(range(len(rows)), key=lambda i: rows[i][0])
    meas_rank = sorted(range(len(rows)), key=lambda i: rows[i][1] or float("inf"))
    text = header(
        "Executed plans on cpu-local: predicted vs measured", "python bench/execute_bench.py"
    )
    text += (
        f"Model: gpt-350m with {CONFIG}, seq {SEQ}, global batch {BATCH}, fp32, SGD; 4 gloo "
        "processes on 2 cores.\nThe cpu-local profile's figures are datasheet guesses, not "
        "measurements (issue 7 measures them).\n\n"
        "| plan | predicted s | measured s | measured / predicted | status |\n"
        "|---|---|---|---|---|\n"
    )
    for pred, meas, name, status in rows:
        ratio = f"{meas / pred:.2f}" if meas else "-"
        text += f"| {name} | {pred:.4f} | {meas:.4f} | {ratio} | {status} |\n"
    text += (
        f"\nPredicted order {pred_rank}, measured order {meas_rank}: "
        f"{'the same' if pred_rank == meas_rank else 'different'}.\n"
    )
    write("execute.md", text)


if __name__ == "__main__":
    main()
