"""Context parallelism's sequence exchanges side by side: Llama-3-8B (32 query heads, 8 kv
heads) at 128K, 512K and 1M tokens on 64 H100 (dgx-h100, 8 nodes), global batch 16
sequences. Per sequence length: the best plan the search finds with the exchange pinned
(all_gather: each layer's keys and values all-gathered, Llama 3's; ulysses: all-to-all from
sequence to heads and back, DeepSpeed-Ulysses), without context parallelism (cp pinned to
1), and unpinned (what `autopar plan` returns); then the same with activation
checkpointing pinned off, where what each exchange keeps for backward decides whether a
plan fits. Search seconds: each case is searched once untimed first, so every search finds
its traces and tables cached.

Run: python bench/sequence_exchanges.py   (writes bench/results/sequence_exchanges.md)
"""

from __future__ import annotations

import time

from common import header, write

from api.compare import describe
from planner.cluster.profile import load_cluster
from planner.request import resolve_request
from planner.search.search import NoFeasiblePlan, search
from planner.search.space import SearchOptions

SEQS = (131072, 524288, 1048576)
BATCH = 16
OPTIONS = (
    ("no cp", {"cp": 1}),
    ("all_gather", {"cp_comm": "all_gather"}),
    ("ulysses", {"cp_comm": "ulysses"}),
    ("searched", {}),
)


def _row(inputs, label: str, pins: dict, checkpointing) -> str:
    extra = {"checkpointing": checkpointing} if checkpointing else {}
    options = SearchOptions(**pins, **extra)
    t0 = time.perf_counter()
    try:
        plan = search(inputs, options).plan
    except NoFeasiblePlan:
        return f"| {label} | does not fit | - | - | {time.perf_counter() - t0:.1f} |"
    took = time.perf_counter() - t0
    step, gib = plan.predicted.step_time_s, plan.predicted.peak_memory_bytes / 2**30
    return f"| {label} | {step:.2f} | {gib:.1f} | {describe(plan)} | {took:.1f} |"


def main() -> None:
    profile = load_cluster("dgx-h100").with_nodes(8)
    sections = []
    for checkpointing, title in ((None, "checkpointing searched"), ((False,), "no checkpointing")):
        for seq in SEQS:
            training = {"global_batch_size": BATCH, "seq_len": seq, "dtype": "bf16"}
            inputs = resolve_request({"name": "llama3-8b"}, profile, training).trace()
            search(inputs, SearchOptions())  # untimed: traces and tables cached
            rows = [_row(inputs, label, pins, checkpointing) for label, pins in OPTIONS]
            print(*rows, sep="\n", flush=True)
            sections += [
                f"### {seq // 1024}K tokens, {title}",
                "",
                "| exchange | step s | peak GiB | plan | search s |",
                "| --- | --- | --- | --- | --- |",
                *rows,
                "",
            ]
    text = header("Context parallelism's sequence exchanges", "python bench/sequence_exchanges.py")
    text += "\n".join(
        [
            "",
            "Llama-3-8B on 64 H100 (dgx-h100), global batch 16 sequences, bf16 (fp8 searched), "
            "executable plans only; the same cost model for all rows.",
            "",
            *sections,
        ]
    )
    write("sequence_exchanges.md", text)


if __name__ == "__main__":
    main()
