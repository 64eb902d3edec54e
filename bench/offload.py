"""Issue 17's CPU offload: where the search takes it and what it costs. Llama-3-70B with AdamW
holds 16 B/param of state, 1.05 TiB: on one DGX H100 (8 x 80 GB) nothing fits on the
devices, and with the shards in host memory (2 TiB per DGX H100) it does, at the price of the
shard copies over PCIe and the optimizer step in host memory; on two nodes it fits without,
and the search leaves offload out. Alpa's MoE-70B on 64 V100 16 GB (the suite's case) fits
only with offload; GPT-39B there fits without. Search seconds: each case's search is run
once untimed first (traces and layout tables cached), then both timed.

Run: python bench/offload.py   (writes bench/results/offload.md)
"""

from __future__ import annotations

import time

from common import header, write

from api.compare import describe
from planner.cluster.profile import load_cluster
from planner.request import resolve_request
from planner.search.search import NoFeasiblePlan, search
from planner.search.space import SearchOptions

CASES = [
    # (model, cluster, nodes, global batch, seq, dtype)
    ("llama3-70b", "dgx-h100", 1, 16, 4096, "bf16"),
    ("llama3-70b", "dgx-h100", 2, 16, 4096, "bf16"),
    ("moe-70b", "aws-p3.16xlarge", 8, 1024, 1024, "fp16"),
    ("gpt-39b", "aws-p3.16xlarge", 8, 1024, 1024, "fp16"),
]


def _row(label: str, who: str, inputs, offload: bool | None) -> str:
    t0 = time.perf_counter()
    try:
        plan = search(inputs, SearchOptions(offload=offload)).plan
    except NoFeasiblePlan:
        return f"| {label} | {who} | does not fit | - | - | - | {time.perf_counter() - t0:.1f} |"
    took = time.perf_counter() - t0
    b = plan.predicted.breakdown
    return (
        f"| {label} | {who} | {plan.predicted.step_time_s:.2f} | {b['optimizer_s']:.2f} | "
        f"{plan.predicted.peak_memory_bytes / 2**30:.1f} | {describe(plan)} | {took:.1f} |"
    )


def main() -> None:
    rows = []
    for model, cluster, nodes, batch, seq, dtype in CASES:
        profile = load_cluster(cluster).with_nodes(nodes)
        label = f"{model}, {profile.num_devices} x {profile.device.name}"
        training = {"global_batch_size": batch, "seq_len": seq, "dtype": dtype}
        inputs = resolve_request({"name": model}, profile, training).trace()
        _row(label, "warm-up", inputs, None)
        rows.append(_row(label, "plan (offload searched)", inputs, None))
        rows.append(_row(label, "plan without offload", inputs, False))
    text = header("CPU offload (issue 17)", "python bench/offload.py")
    text += "\n".join(
        [
            "Host link and host memory bandwidth per device from the profiles (datasheets).",
            "",
            "| case | who | step s | optimizer s | peak GiB | configuration | search s |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )
    write("offload.md", text)


if __name__ == "__main__":
    main()
