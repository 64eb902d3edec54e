"""Issue 17's activation offload: where the search takes it. Each case is searched with
every checkpointing mode (offload among them) and with offload left out; the table gives
the mode each picks and the step times. The host links are the profiles' datasheet figures
(PCIe 3 on the V100 nodes, PCIe 4 on A100, PCIe 5 on H100): a layer's activations cross
them twice per micro-batch, against recomputing the layer's forward.

Run: python bench/activation_offload.py   (writes bench/results/activation_offload.md)
"""

from __future__ import annotations

import time

from common import header, write

from api.compare import describe
from planner.cluster.profile import load_cluster
from planner.parallel.activation_offload import MODE as OFFLOAD
from planner.parallel.checkpointing import modes
from planner.request import resolve_request
from planner.search.search import NoFeasiblePlan, search
from planner.search.space import SearchOptions

CASES = [
    # (model, cluster, nodes, global batch, seq, dtype, pinned micro-batch size or None)
    ("gpt-1.3b", "aws-p3.16xlarge", 1, 64, 2048, "fp16", 8),
    ("gpt-1.3b", "aws-p3.16xlarge", 1, 64, 2048, "fp16", None),
    ("llama3-8b", "dgx-a100-80g", 1, 64, 8192, "bf16", None),
    ("llama3-8b", "dgx-h100", 1, 64, 8192, "bf16", 8),
    ("llama3-70b", "dgx-h100", 4, 256, 8192, "bf16", None),
]


def _row(label: str, who: str, inputs, modes, sizes) -> str:
    options = SearchOptions(checkpointing=modes, microbatch_sizes=sizes)
    t0 = time.perf_counter()
    try:
        plan = search(inputs, options).plan
    except NoFeasiblePlan:
        return f"| {label} | {who} | does not fit | - | - | {time.perf_counter() - t0:.1f} |"
    took = time.perf_counter() - t0
    gib = plan.predicted.peak_memory_bytes / 2**30
    return (
        f"| {label} | {who} | {plan.predicted.step_time_s:.3f} | {gib:.1f} | "
        f"{describe(plan)} | {took:.1f} |"
    )


def main() -> None:
    rows = []
    for model, name, nodes, batch, seq, dtype, mbs in CASES:
        cluster = load_cluster(name, nodes=nodes)
        training = {"global_batch_size": batch, "seq_len": seq, "dtype": dtype}
        inputs = resolve_request({"name": model}, cluster, training).trace()
        label = f"{model} seq {seq}, {cluster.num_devices} x {cluster.device.name}"
        label += f", micro-batch {mbs}" if mbs else ""
        sizes = (mbs,) if mbs else None
        search(inputs, SearchOptions(microbatch_sizes=sizes))  # tables cached
        rows.append(_row(label, "plan (offload searched)", inputs, modes(), sizes))
        without = tuple(m for m in modes() if m != OFFLOAD)
        rows.append(_row(label, "plan without offload", inputs, without, sizes))
    text = header("Activation offload (issue 17)", "python bench/activation_offload.py")
    text += (
        "\nHost links from the profiles (datasheets). Search seconds with tables cached.\n\n"
        "| case | who | step s | peak GiB | configuration | search s |\n"
        "| --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n"
    )
    write("activation_offload.md", text)


if __name__ == "__main__":
    main()
