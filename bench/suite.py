"""Alpa's benchmark suites planned on aws-p3.16xlarge (Zheng et al., OSDI'22, Table 4 and
section 8): search time, predicted throughput, and the ratio to the best Megatron-grid
configuration, pure data parallelism and FSDP, all under the same cost model.

GPT and MoE: global batch 1024, seq 1024, fp16. Wide-ResNet: global batch 1536, 224 x 224,
fp32 (as in Alpa). Fewer than 8 GPUs: one node with that many V100s.
Targets (issue 4): planner >= best Megatron grid everywhere, ahead on MoE and Wide-ResNet;
GPT-39B on 64 GPUs planned in under 60 s on the 2-core dev machine.

"trace s" is both traces (micro-batch 1 and 2) on the meta device; "search s" the search.
Run: python bench/suite.py [gpt|moe|wresnet ...]   (writes bench/results/suite.md and
suite.json; `python bench/plot_suite.py` draws the PNGs from the JSON)
"""

from __future__ import annotations

import json
import sys
import time

from common import RESULTS, header, write

from planner.cluster.profile import load_cluster
from planner.request import resolve_request
from planner.search.baselines import baseline
from planner.search.search import NoFeasiblePlan, search

SUITES = {
    "gpt": (
        "fp16",
        1024,
        [
            ("gpt-350m", 1),
            ("gpt-760m", 2),
            ("gpt-1.3b", 4),
            ("gpt-2.6b", 8),
            ("gpt-6.7b", 16),
            ("gpt-15b", 32),
            ("gpt-39b", 64),
        ],
    ),
    "moe": (
        "fp16",
        1024,
        [
            ("moe-380m", 1),
            ("moe-690m", 2),
            ("moe-1.3b", 4),
            ("moe-2.4b", 8),
            ("moe-10b", 16),
            ("moe-27b", 32),
            ("moe-70b", 64),
        ],
    ),
    "wresnet": (
        "fp32",
        1536,
        [
            ("wresnet-250m", 1),
            ("wresnet-500m", 2),
            ("wresnet-1b", 4),
            ("wresnet-2b", 8),
            ("wresnet-4b", 16),
            ("wresnet-6.8b", 32),
            ("wresnet-13b", 64),
        ],
    ),
}


def cluster_for(gpus: int):
    p3 = load_cluster("aws-p3.16xlarge")
    if gpus < p3.devices_per_node:
        return p3.model_copy(update={"nodes": 1, "devices_per_node": gpus})
    return p3.with_nodes(gpus // p3.devices_per_node)


def suite_inputs(name: str, gpus: int, dtype: str, batch: int):
    """The case as a request (planner.request), traced at micro-batch 1 and 2."""
    fields = {"global_batch_size": batch, "dtype": dtype}
    return resolve_request({"name": name}, cluster_for(gpus), fields).trace()


def run_case(name: str, gpus: int, dtype: str, batch: int) -> dict:
    t0 = time.perf_counter()
    inputs = suite_inputs(name, gpus, dtype, batch)
    trace_s = time.perf_counter() - t0
    row = {"model": name, "gpus": gpus, "params": inputs.model.params, "trace_s": trace_s}
    t0 = time.perf_counter()
    try:
        plan = search(inputs).plan
    except NoFeasiblePlan as err:
        row.update(search_s=time.perf_counter() - t0, plan=None, reason=str(err))
        return row
    row["search_s"] = time.perf_counter() - t0
    row["plan"] = _summary(plan)
    for kind in ("megatron", "dp", "fsdp"):
        b = baseline(kind, inputs).plan
        row[kind] = _summary(b) if b else None
    return row


def _summary(plan) -> dict:
    pp, dp, tp = plan.mesh.shape
    st = plan.stages[0]
    return {
        "step_s": plan.predicted.step_time_s,
        "samples_per_s": plan.predicted.samples_per_s,
        "tflops_per_gpu": plan.predicted.tflops_per_device,
        "mesh": [pp, dp, tp],
        "microbatches": plan.schedule.microbatches,
        "schedule": plan.schedule.name,
        "zero": st.zero,
        "ckpt": st.activation_checkpointing,
        "tp_layout": plan.tp_layout,
        "executable": plan.executable,
        "why_not": plan.not_executable_reason,
    }


def _ratio(row: dict, kind: str) -> str:
    base = row.get(kind)
    if not row.get("plan"):
        return "-"
    if not base:
        return "OOM"
    return f"{row['plan']['samples_per_s'] / base['samples_per_s']:.2f}x"


def _config(s: dict | None) -> str:
    if not s:
        return "-"
    pp, dp, tp = s["mesh"]
    extra = f" z{s['zero']}" + (" ckpt" if s["ckpt"] else "")
    if s.get("tp_layout") == "per_node" and tp > 1:
        extra += " per-node tp"
    return f"pp{pp} dp{dp} tp{tp} m{s['microbatches']}{extra}"


def _executable(s: dict | None) -> str:
    if not s or "executable" not in s:
        return "-"
    if s["executable"]:
        return "yes"
    why = s.get("why_not") or ""
    short = (
        "per-node tp, pp > 1"
        if "single-stage" in why
        else "model family"
        if "executor builds" in why
        else why[:40]
    )
    return f"no ({short})"


def main() -> None:
    names = [a for a in sys.argv[1:] if a in SUITES] or list(SUITES)
    path = RESULTS / "suite.json"
    rows = json.loads(path.read_text()) if path.exists() else {}
    for suite in names:
        dtype, batch, cases = SUITES[suite]
        rows[suite] = []
        for name, gpus in cases:
            row = run_case(name, gpus, dtype, batch)
            rows[suite].append(row)
            print(
                json.dumps({k: row.get(k) for k in ("model", "gpus", "search_s")}),
                _ratio(row, "megatron"),
                file=sys.stderr,
                flush=True,
            )
            RESULTS.mkdir(exist_ok=True)
            path.write_text(json.dumps(rows, indent=1))
    text = header("Alpa's suites planned on aws-p3.16xlarge", "python bench/suite.py")
    text += (
        "Predicted throughput under one cost model. Ratios are planner samples/s over the\n"
        "baseline's best configuration (OOM: no configuration of that kind fits).\n"
    )
    for suite, data in rows.items():
        dtype, batch, _ = SUITES[suite]
        text += (
            f"\n## {suite} (global batch {batch}, {dtype})\n\n"
            "| model | GPUs | trace s | search s | planner PFLOP/s | planner config | "
            "executable | Megatron best | vs Megatron | vs DP | vs FSDP |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n"
        )
        for r in data:
            plan = r.get("plan")
            pf = f"{plan['tflops_per_gpu'] * r['gpus'] / 1000:.3f}" if plan else "does not fit"
            text += (
                f"| {r['model']} | {r['gpus']} | {r['trace_s']:.1f} | {r['search_s']:.1f} | "
                f"{pf} | {_config(plan)} | {_executable(plan)} | "
                f"{_config(r.get('megatron'))} | {_ratio(r, 'megatron')} | {_ratio(r, 'dp')} | "
                f"{_ratio(r, 'fsdp')} |\n"
            )
    write("suite.md", text)


if __name__ == "__main__":
    main()
