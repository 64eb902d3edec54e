"""Plots of bench/results/suite.json: search time against model size, and predicted
throughput of the planner against the baselines. Needs the `bench` extra (matplotlib).

Run: python bench/plot_suite.py   (writes bench/results/search_time.png, throughput.png)
"""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from common import RESULTS

KINDS = ("plan", "megatron", "dp", "fsdp")
LABELS = {"plan": "autopar plan", "megatron": "Megatron grid (best)", "dp": "DP", "fsdp": "FSDP"}


def main() -> None:
    rows = json.loads((RESULTS / "suite.json").read_text())
    fig, ax = plt.subplots(figsize=(6, 4))
    for suite, data in rows.items():
        pts = [(r["params"] / 1e9, r["search_s"]) for r in data]
        ax.plot(*zip(*pts, strict=True), marker="o", label=suite)
        for r in data:
            ax.annotate(
                f"{r['gpus']}",
                (r["params"] / 1e9, r["search_s"]),
                fontsize=7,
                textcoords="offset points",
                xytext=(3, 3),
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters (billions); labels: GPUs")
    ax.set_ylabel("search time (s), 2-core machine")
    ax.set_title("autopar plan: search time vs model size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "search_time.png", dpi=120)

    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for ax, (suite, data) in zip(axes[0], rows.items(), strict=True):
        names = [f"{r['model'].split('-', 1)[1]}\n{r['gpus']} GPU" for r in data]
        width = 0.2
        for k, kind in enumerate(KINDS):
            values = []
            for r in data:
                s = r.get(kind)
                values.append(s["tflops_per_gpu"] * r["gpus"] / 1000 if s else 0.0)
            xs = [i + (k - 1.5) * width for i in range(len(data))]
            ax.bar(xs, values, width, label=LABELS[kind])
        ax.set_xticks(range(len(data)), names, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("predicted PFLOP/s (0 = does not fit)")
        ax.set_title(suite)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Predicted throughput on aws-p3.16xlarge: planner vs baselines")
    fig.tight_layout()
    fig.savefig(RESULTS / "throughput.png", dpi=120)
    print("wrote", RESULTS / "search_time.png", RESULTS / "throughput.png")


if __name__ == "__main__":
    main()
