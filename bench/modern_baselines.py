"""Issue 16's plan-quality bar: the planner's plan against today's hand-tuned practice under
the same cost model: the best of Megatron-LM's grid (dp x tp x pp, sequence parallelism on and
off, 1F1B and interleaved 1F1B, the distributed optimizer and the other ZeRO levels, full
recompute off/on, every micro-batch size) and of torchtitan's FSDP2 + TP grid (FSDP2 on dp,
tp within a node with sequence parallelism, pipelining), on GPT-39B / 64 V100 and Llama-3-70B
on 64 and 512 H100. Ratio = baseline step time / plan step time (>= 1: the plan is as fast
or faster).

Run: python bench/modern_baselines.py   (writes bench/results/modern_baselines.md)
"""

from __future__ import annotations

import time

from common import header, write

from api.compare import describe
from planner.cluster.profile import load_cluster
from planner.request import resolve_request
from planner.search.baselines import baseline
from planner.search.search import search

CASES = [
    ("gpt-39b, 64 V100", "gpt-39b", "aws-p3.16xlarge", 8, 1024, 1024, "fp16"),
    ("llama3-70b, 64 H100", "llama3-70b", "dgx-h100", 8, 1024, 4096, "bf16"),
    ("llama3-70b, 512 H100", "llama3-70b", "dgx-h100", 64, 1024, 4096, "bf16"),
]
KINDS = ("megatron", "fsdp_tp")


def _summary(plan) -> str:
    return f"{describe(plan)}, {plan.tp_layout} layout"


def main() -> None:
    rows = []
    for label, model, cluster, nodes, batch, seq, dtype in CASES:
        profile = load_cluster(cluster).with_nodes(nodes)
        training = {"global_batch_size": batch, "seq_len": seq, "dtype": dtype}
        inputs = resolve_request({"name": model}, profile, training).trace()
        t0 = time.perf_counter()
        plan = search(inputs).plan
        search_s = time.perf_counter() - t0
        step = plan.predicted.step_time_s
        rows.append(f"| {label} | plan | {step:.3f} | 1.000 | {_summary(plan)} | {search_s:.1f} |")
        for kind in KINDS:
            t0 = time.perf_counter()
            found = baseline(kind, inputs)
            took = time.perf_counter() - t0
            if found.plan is None:
                rows.append(f"| {label} | {kind} | does not fit | - | - | {took:.1f} |")
                continue
            theirs = found.plan.predicted.step_time_s
            rows.append(
                f"| {label} | {kind} | {theirs:.3f} | {theirs / step:.3f} | "
                f"{_summary(found.plan)} ({found.evaluated} evaluated) | {took:.1f} |"
            )
    text = header(
        "Plan quality against Megatron-LM's and torchtitan's grids (issue 16)",
        "python bench/modern_baselines.py",
    )
    text += "\n".join(
        [
            "Same cost model for all; ratio = the baseline's step time / the plan's.",
            "",
            "| case | who | step s | ratio | configuration | s to find |",
            "| --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )
    write("modern_baselines.md", text)


if __name__ == "__main__":
    main()
