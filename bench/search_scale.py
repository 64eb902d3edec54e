"""Search time at the scale of frontier training (issue 15): each case planned in a fresh
process, first with an empty disk cache (cold: traces and ILP solves computed), then again
with the cache it left (warm). Reports in-process planning time (request -> Plan: tracing and
search, what the service's planning process spends) and the process's wall time including
Python start-up and `import torch` (~2 s on this machine), the peak RSS, and the plan.

Also: the 405B case's plan beside Meta's published configuration for that run (Llama 3 paper,
Dubey et al. 2024, Table 4: 16,384 H100, tp 8, cp 1, pp 16, dp 128, seq 8192, 16M tokens per
batch) evaluated under the same cost model, and search time against devices and layers
(plotted to results/search_scale.png, with the pre-issue figures from the issue's table).

Run: python bench/search_scale.py [--quick]   (writes bench/results/search_scale.md)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from common import RESULTS, header, write

L405 = {
    "layers": 126,
    "hidden": 16384,
    "heads": 128,
    "kv_heads": 8,
    "ffn_hidden": 53248,
    "vocab": 128256,
}
# name, model, config, cluster, nodes, global batch (samples), seq, dtype
ACCEPTANCE = [
    ("gpt-1.3b, 8 A100", "gpt-1.3b", {}, "dgx-a100-80g", 1, 64, 1024, "bf16"),
    ("gpt-39b, 64 V100", "gpt-39b", {}, "aws-p3.16xlarge", 8, 1024, 1024, "fp16"),
    ("llama3-70b, 64 H100", "llama3-70b", {}, "dgx-h100", 8, 1024, 4096, "bf16"),
    ("llama3-70b, 256 H100", "llama3-70b", {}, "dgx-h100", 32, 1024, 4096, "bf16"),
    ("llama3-70b, 1,024 H100", "llama3-70b", {}, "dgx-h100", 128, 1024, 4096, "bf16"),
    ("405B, 16,384 H100", "llama3-70b", L405, "dgx-h100", 2048, 2048, 8192, "bf16"),
]
LAYER_SWEEP = [20, 40, 80, 126]  # llama3-70b-shaped, 64 H100
# Before this issue (the issue's own table: CPU s, one process, this machine).
BEFORE_DEVICES = {64: 254, 256: 601, 1024: 1405}
BEFORE_GPT = {8: 19, 64: 66, 128: 111}  # gpt-1.3b / -39b / -76b (issue's table)
# Earlier passes of this issue (cold plan s): first (commit fb32ccd), second (8349661).
FIRST_PASS_LAYERS = {20: 24.2, 40: 31.5, 80: 48.6, 126: 53.5}
SECOND_PASS_LAYERS = {20: 9.1, 40: 11.5, 80: 18.3, 126: 24.9}

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from planner.cluster.profile import load_cluster
from planner.request import resolve_request
from planner.search.search import search
from planner.search.space import SearchOptions, default_workers
import planner.models  # imports torch (~2 s), as a service's planning process has it loaded
import torch._dynamo  # torch.export's (~2 s), which the service's fork server preloads too
model, config, cluster, nodes, batch, seq, dtype = json.loads(sys.argv[1])
workers = default_workers()  # the CLI's default: one process per core
t1 = time.perf_counter()
profile = load_cluster(cluster).with_nodes(nodes)
request = resolve_request({"name": model, "config": config}, profile,
                          {"global_batch_size": batch, "seq_len": seq, "dtype": dtype})
inputs = request.trace(workers=workers)
t2 = time.perf_counter()
plan = search(inputs, SearchOptions(workers=workers)).plan
t3 = time.perf_counter()
print(json.dumps({
    "imports_s": t1 - t0, "trace_s": t2 - t1, "search_s": t3 - t2, "plan_s": t3 - t1,
    "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "mesh": plan.mesh.shape, "schedule": plan.schedule.name,
    "microbatches": plan.schedule.microbatches, "zero": plan.stages[0].zero,
    "ckpt": plan.stages[0].activation_checkpointing,
    "step_s": plan.predicted.step_time_s, "mfu": plan.predicted.mfu,
    "ilp_calls": plan.search.ilp_calls, "evaluated": plan.search.candidates_evaluated,
    "pruned": plan.search.candidates_pruned, "workers": workers,
}))
"""


def run(case: tuple, cache: str) -> dict:
    _, model, config, cluster, nodes, batch, seq, dtype = case
    args = json.dumps([model, config, cluster, nodes, batch, seq, dtype])
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "AUTOPAR_CACHE_DIR": cache},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - t0
    return result


def meta_405b() -> list[str]:
    """Meta's configuration under the cost model, next to nothing else."""
    from planner.cluster.profile import load_cluster
    from planner.evaluate.config import ParallelConfig
    from planner.evaluate.estimate import evaluate
    from planner.request import resolve_request

    cluster = load_cluster("dgx-h100").with_nodes(2048)
    request = resolve_request(
        {"name": "llama3-70b", "config": L405},
        cluster,
        {"global_batch_size": 2048, "seq_len": 8192, "dtype": "bf16"},
    )
    inputs = request.trace(batches=(1, 2))
    rows = []
    variants = [("1f1b", 1, 1, False), ("interleaved_1f1b", 2, 1, False)]
    variants += [(s, v, z, True) for s, v in (("1f1b", 1), ("interleaved_1f1b", 2)) for z in (1, 3)]
    for schedule, v, zero, ckpt in variants:
        cfg = ParallelConfig(128, 8, 16, 16, schedule, v, zero, ckpt)  # 16 micro-batches of 1
        plan = evaluate(inputs.at(1), cluster, inputs.training, cfg, inputs.model, detail=False)
        p = plan.predicted
        rows.append(
            f"| pp16 dp128 tp8, mbs 1 x 16, {schedule}, zero{zero}{', ckpt' if ckpt else ''} | "
            f"{p.step_time_s:.2f} | "
            f"{p.mfu:.1%} | {p.peak_memory_bytes / 2**30:.1f} | {p.fits_in_memory} |"
        )
    return rows


def row(name: str, cold: dict, warm: dict | None) -> str:
    mesh = "x".join(map(str, cold["mesh"]))
    warm_s = f"{warm['plan_s']:.1f} / {warm['wall_s']:.1f}" if warm else "-"
    return (
        f"| {name} | {cold['trace_s']:.1f} | {cold['search_s']:.1f} | "
        f"{cold['plan_s']:.1f} / {cold['wall_s']:.1f} | {warm_s} | {cold['rss_mb']:.0f} | "
        f"{cold['ilp_calls']} | {cold['evaluated']} / {cold['pruned']} | pp x dp x tp {mesh}, "
        f"mbs x {cold['microbatches']}, {cold['schedule']}, zero{cold['zero']}"
        f"{', ckpt' if cold['ckpt'] else ''} | {cold['step_s']:.2f} | {cold['mfu']:.1%} |"
    )


def main() -> None:
    quick = "--quick" in sys.argv
    lines = [
        header("Search at scale (issue 15)", "python bench/search_scale.py"),
        "",
        "Planning time in seconds, each case in a fresh process. `plan s` = request -> Plan "
        "in-process (tracing + search, with the planner, torch and torch._dynamo already "
        "imported, as in the service's planning processes, which fork from a server that "
        "imported them), `wall s` = the whole process: Python start-up, `import torch` "
        "(~2 s), `import torch._dynamo` (~2 s) and the rest. The search runs with the CLI's "
        "default workers (one process per core: traces, ILP solves and cost tables side by "
        "side). Cold: empty disk cache; warm: the cache the cold run left (traces, ILP and "
        "Megatron layouts, cost tables).",
        "",
        "| case | trace s (cold) | search s (cold) | plan / wall s (cold) | plan / wall s (warm) "
        "| peak RSS MB | ILP solves | evaluated / pruned | plan | step s | MFU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    points = []
    for case in ACCEPTANCE[:2] if quick else ACCEPTANCE:
        with tempfile.TemporaryDirectory() as cache:
            cold = run(case, cache)
            warm = run(case, cache)
        lines.append(row(case[0], cold, warm))
        print(lines[-1], flush=True)
        points.append((case, cold))
    lines += ["", "## Search time against layers (llama3-70b shape, 64 H100, cold)", ""]
    lines += ["| layers | plan s | search s | wall s |", "| --- | --- | --- | --- |"]
    layer_points = []
    for layers in [] if quick else LAYER_SWEEP:
        case = ("", "llama3-70b", {"layers": layers}, "dgx-h100", 8, 1024, 4096, "bf16")
        with tempfile.TemporaryDirectory() as cache:
            cold = run(case, cache)
        layer_points.append((layers, cold["plan_s"]))
        lines.append(
            f"| {layers} | {cold['plan_s']:.1f} | {cold['search_s']:.1f} | {cold['wall_s']:.1f} |"
        )
        print(lines[-1], flush=True)
    lines += [
        "",
        "## 405B on 16,384 H100: Meta's configuration under the same cost model",
        "",
        "| configuration | step s | MFU | peak GiB | fits |",
        "| --- | --- | --- | --- | --- |",
        *meta_405b(),
    ]
    write("search_scale.md", "\n".join(lines) + "\n")
    (RESULTS / "search_scale.json").write_text(
        json.dumps(
            {"cases": [(c[0], c[4] * 8, r) for c, r in points], "layers": layer_points},
            indent=1,
        )
    )
    _plot(points, layer_points)


def _plot(points, layer_points) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    llama = [(c[4] * 8, r["wall_s"]) for c, r in points if c[1] == "llama3-70b" and not c[2]]
    if llama:
        a.plot(*zip(*llama, strict=True), "o-", label="llama3-70b, after")
    a.plot(*zip(*sorted(BEFORE_DEVICES.items()), strict=True), "s--", label="llama3-70b, before")
    a.plot(*zip(*sorted(BEFORE_GPT.items()), strict=True), "s:", label="gpt (1.3b/39b/76b), before")
    other = [(c[4] * 8, r["wall_s"], c[0]) for c, r in points if c[1] != "llama3-70b" or c[2]]
    for x, y, name in other:
        a.plot([x], [y], "^", label=name)
    a.set(xscale="log", yscale="log", xlabel="devices", ylabel="s, cold (after: process wall)")
    a.legend(fontsize=7)
    if layer_points:
        b.plot(*zip(*layer_points, strict=True), "o-", label="now")
    second = sorted(SECOND_PASS_LAYERS.items())
    b.plot(*zip(*second, strict=True), "s:", label="second pass (8349661)")
    first = sorted(FIRST_PASS_LAYERS.items())
    b.plot(*zip(*first, strict=True), "s--", label="first pass (fb32ccd)")
    b.set(xlabel="layers (llama3-70b shape, 64 H100)", ylabel="plan s, in-process (cold)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "search_scale.png", dpi=110)


if __name__ == "__main__":
    main()
