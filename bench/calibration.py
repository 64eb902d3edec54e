"""Calibrate the cost model against published training runs: predicted vs published step time.

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21 (arXiv:2104.04473), Table 1: GPT models, vocab 51200, seq 2048, on
Selene (DGX A100 80 GB, 8 x 200 Gb/s HDR InfiniBand per node), fp16 mixed precision, full
activation recomputation. The paper reports achieved TFLOP/s per GPU counting the recompute
forward: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per step; the published step time is
F / (GPUs x TFLOP/s). We evaluate each run's configuration (tp, pp, dp = GPUs/(tp pp), batch;
micro-batch size 1 and the interleaved schedule are not given per row in the table, so we use
micro-batch 1 with 1F1B) on the `dgx-a100-80g` profile, with the math attention kernel
(2021 Megatron-LM fused softmax, no FlashAttention).

Run: python bench/calibration.py   (writes bench/results/calibration.md)
"""

from __future__ import annotations

import sys
import time

from common import header, write

from planner.cluster.profile import load_cluster
from planner.evaluate.config import ParallelConfig
from planner.evaluate.estimate import evaluate
from planner.request import resolve_request

# name, heads, hidden, layers, tp, pp, gpus, batch, published TFLOP/s per GPU
RUNS = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ, VOCAB = 2048, 51200


def megatron_flops(batch: int, layers: int, hidden: int) -> float:
    h, s, v, b, l = hidden, SEQ, VOCAB, batch, layers  # noqa: E741
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def main() -> None:
    quick = "--quick" in sys.argv
    attention = "flash" if "--flash" in sys.argv else "math"  # sensitivity check
    runs = RUNS[:4] if quick else RUNS
    rows, errors = [], []
    for name, heads, hidden, layers, tp, pp, gpus, batch, published_tflops in runs:
        started = time.perf_counter()
        model = {
            "name": "gpt-1.3b",
            "config": {"hidden": hidden, "layers": layers, "heads": heads, "seq_len": SEQ},
        }
        cluster = load_cluster("dgx-a100-80g", nodes=gpus // 8)
        fields = {"global_batch_size": batch, "seq_len": SEQ, "dtype": "fp16"}
        inputs = resolve_request(model, cluster, {**fields, "attention": attention}).trace((1,))
        dp = gpus // (tp * pp)
        config = ParallelConfig(
            dp=dp, tp=tp, pp=pp, microbatches=batch // dp, schedule="1f1b", checkpointing=True
        )
        plan = evaluate(inputs.at(1), cluster, inputs.training, config, inputs.model)
        published_step = megatron_flops(batch, layers, hidden) / (gpus * published_tflops * 1e12)
        predicted = plan.predicted.step_time_s
        err = (predicted - published_step) / published_step
        peak_gib = plan.predicted.peak_memory_bytes / 2**30
        errors.append(abs(err))
        rows.append(
            f"| {name} | {tp} | {pp} | {dp} | {gpus} | {batch} | {published_tflops} | "
            f"{published_step:.2f} | {predicted:.2f} | {err:+.1%} | "
            f"{plan.predicted.bubble_fraction:.1%} | {peak_gib:.1f} |"
            f" {time.perf_counter() - started:.1f} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    mae = sum(errors) / len(errors)
    text = header(
        "Cost model calibration: predicted vs published (Megatron-LM, SC'21 Table 1)",
        "python bench/calibration.py",
    )
    text += "\n".join(
        [
            "Published step time = F / (GPUs x published TFLOP/s per GPU), F = 96 B s l h^2 "
            "(1 + s/6h + V/16lh).",
            "Predicted: `autopar estimate` of the same configuration on `dgx-a100-80g` "
            "(fp16, full recompute, math attention, micro-batch 1, 1F1B).",
            "",
            "| model | tp | pp | dp | GPUs | batch | published TFLOP/s | published step s | "
            "predicted step s | error | predicted bubble | predicted peak GiB | eval s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Mean absolute error over {len(errors)} runs: **{mae:.1%}** (max {max(errors):.1%}).",
            "",
        ]
    )
    if attention == "flash":
        print(text)  # a sensitivity check, not the recorded calibration
        return
    write("calibration.md" if not quick else "calibration-quick.md", text)


if __name__ == "__main__":
    main()
