"""Issue 17's long sequences: Llama-3-8B and -70B at 32K and 128K tokens on 64 to 1,024 H100
(dgx-h100), planned with context parallelism in the search space, against the best plan the
same search finds without it (cp pinned to 1) and against Megatron-LM's and torchtitan's
grids (both with context parallelism, planner/search/baselines.py). Global batches of about
4M tokens (128 x 32K, 32 x 128K), as Llama 3's long-context stage used a few million tokens
per step. Ratio = the other's step time / the plan's (>= 1: the plan is as fast or faster).

Run: python bench/long_context.py [--quick]   (writes bench/results/long_context.md)
"""

from __future__ import annotations

import sys
import time

from common import header, write

from api.compare import describe
from planner.cluster.profile import load_cluster
from planner.request import resolve_request
from planner.search.baselines import baseline
from planner.search.search import NoFeasiblePlan, search
from planner.search.space import SearchOptions

CASES = [
    # (model, nodes of 8 H100, sequence, global batch in sequences)
    ("llama3-8b", 8, 32768, 128),
    ("llama3-8b", 8, 131072, 32),
    ("llama3-70b", 8, 32768, 128),
    ("llama3-70b", 32, 131072, 32),
    ("llama3-70b", 128, 131072, 32),
]
KINDS = ("megatron", "fsdp_tp")


def _plan(inputs, cp: int | None):
    t0 = time.perf_counter()
    try:
        plan = search(inputs, SearchOptions(cp=cp, executable_only=True)).plan
    except NoFeasiblePlan:
        plan = None
    return plan, time.perf_counter() - t0


def _cell(plan, ours) -> tuple[str, str, str]:
    if plan is None:
        return "does not fit", "-", "-"
    step = plan.predicted.step_time_s
    ratio = f"{step / ours:.3f}" if ours else "-"
    return (
        f"{step:.2f}",
        ratio,
        f"{describe(plan)}, {plan.predicted.peak_memory_bytes / 2**30:.1f} GiB",
    )


def main() -> None:
    cases = CASES[:2] if "--quick" in sys.argv else CASES
    rows = []
    for model, nodes, seq, batch in cases:
        label = f"{model}, {seq // 1024}K, {nodes * 8} H100, batch {batch}"
        profile = load_cluster("dgx-h100").with_nodes(nodes)
        training = {"global_batch_size": batch, "seq_len": seq, "dtype": "bf16"}
        inputs = resolve_request({"name": model}, profile, training).trace()
        plan, took = _plan(inputs, None)
        ours = plan.predicted.step_time_s if plan else None
        step, _, what = _cell(plan, ours)
        rows.append(f"| {label} | plan | {step} | 1.000 | {what} | {took:.1f} |")
        no_cp, took = _plan(inputs, 1)
        step, ratio, what = _cell(no_cp, ours)
        rows.append(f"| {label} | plan without cp | {step} | {ratio} | {what} | {took:.1f} |")
        for kind in KINDS:
            t0 = time.perf_counter()
            found = baseline(kind, inputs)
            took = time.perf_counter() - t0
            step, ratio, what = _cell(found.plan, ours)
            rows.append(f"| {label} | {kind} grid | {step} | {ratio} | {what} | {took:.1f} |")
    text = header(
        "Long sequences with context parallelism (issue 17)", "python bench/long_context.py"
    )
    text += "\n".join(
        [
            "Same cost model (dgx-h100 with its measured GEMM and attention tables) for all; "
            "executable plans only; ratio = the row's step time / the plan's.",
            "",
            "| case | who | step s | ratio | configuration, peak memory | s to find |",
            "| --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )
    write("long_context.md" if "--quick" not in sys.argv else "long_context_quick.md", text)


if __name__ == "__main__":
    main()
