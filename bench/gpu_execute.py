"""Plans executed on one H100: predicted vs measured step time and peak memory (issue 16).

The plans come from `autopar plan` on bench/profiles/h100-sxm-1gpu.yaml (dgx-h100's device,
efficiencies and measured tables, one GPU); each ran on the device tool's H100 as

    torchrun --standalone --nproc_per_node 1 -m executor.worker PLAN --steps 8 --out DIR

and DIR/rank0.json (or rank0.error.json) is kept under bench/results/h100_execute/. "v1" are
the plans of commit d222d79's memory model, "v2" those after it counted the loss's workspace
and the autocast weight copies (planner.cost.model.workspace_bytes,
planner.cost.memory.compute_copy_bytes). Measured step: median of steps 1-7 (step 0 warms
up); peak: torch.cuda.max_memory_allocated.

    python bench/gpu_execute.py   (writes bench/results/h100_execute.md)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import header, write

RESULTS = Path(__file__).resolve().parent / "results"
CLUSTER = "bench/profiles/h100-sxm-1gpu.yaml"
LLAMA = f"--model llama3-8b --config layers=4 --cluster {CLUSTER} --global-batch 8 --seq 4096"
GPT = f"--model gpt-1.3b --cluster {CLUSTER} --global-batch 16 --seq 2048"
COMMON = "--dtype bf16 --no-baselines --executable-only"
# name: (plan command, predicted step s, predicted peak GiB, configuration), as planned
RUNS = {
    "v1-plan-llama3-8b-l4": (f"{LLAMA} {COMMON}", 0.5427, 67.85, "mbs 8 x 1, no ckpt"),
    "v1-plan-llama3-8b-l4-sel": (
        f"{LLAMA} {COMMON} --microbatch-size 2 --checkpointing selective",
        0.5713,
        37.27,
        "mbs 2 x 4, selective",
    ),
    "v1-plan-gpt-1.3b": (f"{GPT} {COMMON}", 0.5358, 77.24, "mbs 16 x 1, no ckpt"),
    "v2-llama": (f"{LLAMA} {COMMON}", 0.5496, 67.50, "mbs 4 x 2, no ckpt"),
    "v2-gpt": (f"{GPT} {COMMON}", 0.5469, 57.14, "mbs 8 x 2, no ckpt"),
    "v2-llama-expandable": (
        f"{LLAMA} {COMMON}",
        0.5496,
        67.50,
        "mbs 4 x 2, no ckpt; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    ),
}


def main() -> int:
    rows = []
    for name, (command, step, peak, config) in RUNS.items():
        got = json.loads((RESULTS / "h100_execute" / f"{name}.json").read_text())
        if "steps" in got:
            times = [s["time_s"] for s in got["steps"][1:]]
            t = statistics.median(times)
            gib = max(s["peak_device_bytes"] for s in got["steps"]) / 2**30
            outcome = (
                f"ran | {t:.3f} ({t / step - 1:+.0%}) | {gib:.1f} ({peak / gib - 1:+.0%} predicted)"
            )
        else:
            outcome = f"**{got['error'].split('.')[0]}** | - | -"
        rows.append(
            f"| {name} | `autopar plan {command}` | {config} | {step:.3f} | {peak:.1f} | "
            f"{outcome} |"
        )
    lines = header(
        "Plans executed on one H100 (torch 2.11.0+cu130, NCCL, 1 rank)",
        "python bench/gpu_execute.py",
    ).split("\n")
    lines += [
        "Run on the device tool's H100 80GB HBM3 SXM (2026-11-24); see the script's docstring "
        "for the commands. Predicted: the plan's step time and peak; measured: median step "
        "(steps 1-7) and torch.cuda.max_memory_allocated.",
        "",
        "| run | plan | configuration | predicted s | predicted GiB | outcome | measured s | "
        "measured GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        "Reading: v1 (the committed memory model before this run) sent two of three plans out "
        "of memory; the failed allocations were exactly one fp32 logits-sized buffer (15.66 "
        "GiB = 32,768 tokens x 128,256 x 4 B; 6.25 GiB = 32,768 x 51,200 x 4 B) during the "
        "loss, and the plan that ran peaked 11.3 GiB above its prediction: the loss's two "
        "transient buffers (7.8 GiB) and autocast's bf16 copy of every fp32 weight (3.6 GiB). "
        "v2 counts both: the selective plan is predicted at 48.7 GiB (measured 48.6), the new "
        "gpt plan runs (63.3 GiB measured, 57.1 predicted), but the new Llama plan (67.5 GiB "
        "predicted) still failed: 64.8 GiB allocated plus 7.8 GiB asked, with 10.2 GiB "
        "reserved by the caching allocator and unused (fragmentation from the loss's large "
        "buffers). With the allocator's expandable segments it ran, peaking at 72.7 GiB "
        "(7% over the prediction): the executor now sets that (executor/worker.py) unless "
        "the user configured the allocator. Step time is 20-28% over the prediction on the "
        "three plans that ran, while the same layers measured "
        "alone are within 7% (h100_layers.md): the loss measured 2.4x its roofline "
        "(h100_measure.json op_times: 25.6 vs 10.8 ms at 16,384 x 128,256) and the rest "
        "(optimizer step, clipping, casts, per-micro-batch executor work on a GPU) is not "
        "yet measured.",
        "",
        "Profiled (`bench/gpu_step_profile.py` on the selective plan, "
        "`results/h100_step_profile.txt`, 4 steps of 0.74-0.80 s under the profiler): AdamW "
        "(torch's foreach implementation) 61 ms a step where the model prices 23 ms (28 B "
        "per parameter at the memory rate; it moves about 75); gradient accumulation of each "
        "micro-batch's bf16 weight gradients into the fp32 .grad (casts and adds, ~100 ms a "
        "step over 4 micro-batches) is not priced at all; log-softmax forward and backward "
        "5.6-5.7 ms each a micro-batch against the loss node's roofline. Those three cover "
        "the 0.15 s gap. Also seen: the worker built the model on the CPU (28 s of random "
        "initialisation) and copied every parameter to the host as float64 lists for its "
        "fingerprints (11.8 s; now only the 64 values it reports).",
    ]
    write("h100_execute.md", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
