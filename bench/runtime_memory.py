"""Peak memory per GPU of published Megatron-Core runs on DGX H100 that ran, predicted for
autopar's executor and for Megatron-LM (--runtime megatron: its fp32 main gradients and
distributed optimizer, planner/runtime/megatron.py), with the model state and the
activations apart; and what one Llama-3-70B layer saves for backward under the cost model,
op by op, beside what Transformer Engine's fused kernels keep.

The runs: NVIDIA Megatron-Bridge's performance recipes for DGX H100
(scripts/performance/configs/llama/llama3_workload_base_configs.py, its published
performance summary): Llama3 70B pretraining on 64 H100, BF16 with TP 4, PP 4, CP 2, VP 5
and FP8 (current scaling) with TP 4, PP 8, VP 5, micro-batch 1, GBS 256, sequence 8,192;
Llama3 8B on 8 H100, BF16 with CP 2, GBS 128; Llama3.1 405B on 1,024 H100, BF16 and FP8
with TP 8, PP 8, CP 2, VP 8, GBS 512. Sequence parallelism and the distributed
optimizer on, as Megatron-Bridge's Llama recipes set them; no recomputation. The version of
their helper read (scripts/performance/utils/helpers.py, set_basic_perf_overrides) also sets
ddp.grad_reduce_in_fp32 = False (a bf16 gradient buffer, 2 bytes per parameter
less than the megatron runtime's fp32 one, which is Megatron-LM's default for bf16 and what
`autopar export --to megatron` runs).

Run: python bench/runtime_memory.py   (writes bench/results/runtime_memory.md)
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

from common import header, write

from api.cli.main import main as cli

GIB = 2**30
# Llama 3.1 405B (Meta's model card): 126 layers, hidden 16,384, 128 heads, 8 key/value heads,
# FFN 53,248, on the zoo's Llama
LLAMA_405B = (
    "--model llama3-70b --config layers=126 hidden=16384 heads=128 kv_heads=8 ffn_hidden=53248"
)
RUNS = [
    (
        "Llama3 70B, 64 H100, BF16, TP4 PP4 CP2 VP5",
        "--model llama3-70b --nodes 8 --dp 2 --tp 4 --pp 4 --cp 2 --virtual-stages 5 "
        "--global-batch 256 --microbatches 128 --sequence-parallel "
        "--schedule interleaved_1f1b",
    ),
    (
        "Llama3 70B, 64 H100, FP8-CS, TP4 PP8 VP5",
        "--model llama3-70b --nodes 8 --dp 2 --tp 4 --pp 8 --virtual-stages 5 "
        "--global-batch 256 --microbatches 128 --sequence-parallel "
        "--schedule interleaved_1f1b --fp8 tensorwise",
    ),
    (
        "Llama3.1 405B, 1,024 H100, BF16, TP8 PP8 CP2 VP8",
        f"{LLAMA_405B} --nodes 128 --dp 8 --tp 8 --pp 8 --cp 2 --virtual-stages 8 "
        "--global-batch 512 --microbatches 64 --sequence-parallel --schedule interleaved_1f1b",
    ),
    (
        "Llama3.1 405B, 1,024 H100, FP8-CS, TP8 PP8 CP2 VP8",
        f"{LLAMA_405B} --nodes 128 --dp 8 --tp 8 --pp 8 --cp 2 --virtual-stages 8 "
        "--global-batch 512 --microbatches 64 --sequence-parallel --schedule interleaved_1f1b "
        "--fp8 tensorwise",
    ),
    (
        "Llama3 8B, 8 H100, BF16, CP2",
        "--model llama3-8b --nodes 1 --dp 4 --cp 2 --global-batch 128 --microbatches 32",
    ),
]
COMMON = "--cluster dgx-h100 --seq 8192 --zero 1"


def _estimate(args: str, runtime: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        argv = ["estimate", *args.split(), *COMMON.split(), "--runtime", runtime]
        with contextlib.redirect_stdout(io.StringIO()):  # the estimate's own report
            cli([*argv, "-o", str(out)])
        return json.loads(out.read_text())


def _row(label: str, runtime: str, plan: dict, usable: float) -> str:
    stage = max(plan["stages"], key=lambda s: s["predicted"]["memory"]["total"])
    m = stage["predicted"]["memory"]
    state = (m["params"] + m["grads"] + m["optimizer"]) / GIB
    fits = "yes" if m["total"] <= usable else "**no**"
    return (
        f"| {label} | {runtime} | {m['params'] / GIB:.1f} | {m['grads'] / GIB:.1f} | "
        f"{m['optimizer'] / GIB:.1f} | {state:.1f} | {m['activations'] / GIB:.1f} | "
        f"{m['total'] / GIB:.1f} | {fits} |"
    )


def _layer_rows() -> list[str]:
    """One Llama-3-70B layer's saved bytes per op (micro-batch 1, 8,192 tokens, unsharded)
    under the cost model on an H100, beside what Transformer Engine keeps."""
    from planner.cluster.profile import load_cluster
    from planner.cost.model import CostModel
    from planner.request import resolve_request

    cluster = load_cluster("dgx-h100", 8)
    training = {"global_batch_size": 128, "seq_len": 8192, "dtype": "bf16"}
    inputs = resolve_request({"name": "llama3-70b"}, cluster, training).trace(batches=(1,))
    cm = CostModel(cluster, "bf16")
    layer = [n for n in inputs.at(1).nodes if n.layer == 3 and cm.saved_bytes(n)]
    # Transformer Engine / Megatron-Core: fused RMSNorm keeps its input and an fp32 rstd per
    # row; TE's attention keeps q, the k and v of the 8 key/value heads (not repeated to 64),
    # its output and the log-sum-exp; the fused SwiGLU keeps its input (gate and up), not
    # silu's output; each linear keeps its input (bf16 here; fp8 under FP8 recipes).
    te = {
        "norm": lambda n: n.inputs[0].nbytes + 4 * 8192,
        "attention": lambda n: n.outputs[0].nbytes * (1 + 2 / 8 + 1) + 4 * 64 * 8192,
        "silu": lambda n: 0,  # the fused SwiGLU's input is counted at the product
    }
    rows, ours, theirs = [], 0, 0
    for n in layer:
        got = cm.saved_bytes(n)
        key = "silu" if n.name.startswith("silu") else n.kind
        keep = te.get(key, lambda n, got=got: got)(n)
        ours, theirs = ours + got, theirs + keep
        rows.append(f"| {n.name} | {n.kind} | {got / 2**20:.0f} | {keep / 2**20:.0f} |")
    rows.append(f"| **layer** | | **{ours / 2**20:.0f}** | **{theirs / 2**20:.0f}** |")
    return rows


def main() -> None:
    from planner.cluster.headroom import with_headroom
    from planner.cluster.profile import load_cluster

    usable = with_headroom(load_cluster("dgx-h100"), None).usable_memory_bytes  # as the CLI
    rows = []
    for label, args in RUNS:
        for runtime in ("autopar", "megatron"):
            rows.append(_row(label, runtime, _estimate(args, runtime), usable))
    text = header(
        "Memory of published Megatron-Core runs on H100", "python bench/runtime_memory.py"
    )
    text += (
        f"\nPeak GiB per GPU on the fullest stage; usable {usable / GIB:.1f} GiB of 80 (the "
        "CLI's default headroom). Each run ran (Megatron-Bridge's H100 performance recipes, "
        "cited in the script).\n\n"
        "| run | runtime | weights | grads | optimizer | state | activations | peak | fits |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n"
    )
    text += (
        "\nOne Llama-3-70B layer's saved tensors (micro-batch 1, 8,192 tokens, MiB before tp "
        "and sequence-parallel sharding): the cost model (the traced model on an H100's "
        "kernels) beside Transformer Engine's fused kernels.\n\n"
        "| op | kind | cost model | TE keeps |\n| --- | --- | --- | --- |\n"
        + "\n".join(_layer_rows())
        + "\n"
    )
    write("runtime_memory.md", text)


if __name__ == "__main__":
    main()
