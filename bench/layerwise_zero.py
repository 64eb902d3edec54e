"""Layer-wise ZeRO (issue 40, item 4; Galvatron's per-layer choice): ZeRO-3 on the fewest first
layers that fit, ZeRO-2 on the rest, searched beside plain ZeRO-3 where there is no pipeline.

Per case, the search without it (`--layerwise-zero off`) and the default, both with only
plans the executor runs; once over every mesh and once with the pipeline pinned off (pp 1,
the FSDP-style plans torchtitan and most fine-tuning runs use, where layer-wise ZeRO
applies). Reported: each plan, its predicted step time and peak memory, the margin, and both
search times (the disk cache off; alternating, the least of two runs of each). Tracing is
not included.

Run: AUTOPAR_CACHE_DIR=off python bench/layerwise_zero.py (writes
bench/results/layerwise_zero.md)
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

from common import RESULTS, header, write

from planner.request import resolve_request, search_options
from planner.search.search import NoFeasiblePlan, search

# (model, config overrides, cluster, nodes, global batch, sequence, dtype)
CASES = (
    ("llama3-8b", {}, "dgx-h100", 1, 16, 8192, "bf16"),
    ("llama3-8b", {}, "dgx-a100-80g", 1, 64, 4096, "bf16"),
    ("llama3-70b", {}, "dgx-h100", 8, 64, 8192, "bf16"),
    ("gpt-6.7b", {}, "aws-p3.16xlarge", 2, 256, 1024, "fp16"),
)


def _searched(inputs, layerwise: bool, max_pp: int | None):
    options = search_options({} if layerwise else {"layerwise_zero": False})
    options = replace(options, max_pp=max_pp)
    started = time.perf_counter()
    try:
        plan = search(inputs, options).plan
    except NoFeasiblePlan:
        plan = None
    return plan, time.perf_counter() - started


def _cell(plan) -> str:
    if plan is None:
        return "does not fit | - | -"
    st = plan.stages[0]
    zero = st.zero_label if len(plan.stages) == 1 else f"ZeRO-{st.zero}"
    mem = plan.predicted.peak_memory_bytes / 2**30
    return (
        f"{plan.mesh.summary()}, m{plan.schedule.microbatches}, {zero}, "
        f"ckpt {st.checkpointing_label} | {plan.predicted.step_time_s:.3f} | {mem:.1f}"
    )


def main() -> None:
    if os.environ.get("AUTOPAR_CACHE_DIR", "x").lower() not in ("off", ""):
        sys.exit("run with AUTOPAR_CACHE_DIR=off (both searches must solve their own layouts)")
    from planner.cluster.profile import load_cluster

    lines = [
        header(
            "Layer-wise ZeRO (ZeRO-3 on the fewest layers that fit, ZeRO-2 on the rest)",
            "AUTOPAR_CACHE_DIR=off python bench/layerwise_zero.py",
        ),
        "",
        __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        "| model | GPUs | batch x seq | meshes | without: plan | step s | GiB | with: plan "
        "| step s | GiB | margin | search s without | with | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, config, cluster, nodes, batch, seq, dtype in CASES:
        profile = load_cluster(cluster, nodes=nodes)
        training = {"global_batch_size": batch, "seq_len": seq, "dtype": dtype}
        inputs = resolve_request({"name": model, "config": config}, profile, training).trace()
        for meshes, max_pp in (("all", None), ("pp 1", 1)):
            runs: dict[bool, list] = {False: [], True: []}
            for _ in range(2):  # alternating, the least of two each
                for on in (False, True):
                    runs[on].append(_searched(inputs, on, max_pp))
            without, t_without = runs[False][0][0], min(r[1] for r in runs[False])
            with_, t_with = runs[True][0][0], min(r[1] for r in runs[True])
            margin = "-"
            if without and with_:
                margin = f"{1 - with_.predicted.step_time_s / without.predicted.step_time_s:.2%}"
            gpus = profile.num_devices
            lines.append(
                f"| {model} | {gpus} {cluster} | {batch} x {seq} | {meshes} | {_cell(without)} | "
                f"{_cell(with_)} | {margin} | {t_without:.1f} | {t_with:.1f} | "
                f"{t_with / t_without:.2f}x |"
            )
            print(lines[-1], flush=True)
    write(RESULTS / "layerwise_zero.md", "\n".join([*lines, ""]))


if __name__ == "__main__":
    main()
