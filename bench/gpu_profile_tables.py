"""Write the measured GEMM and attention tables of `bench/gpu_measure.py` into the bundled
profiles of the device they were measured on (issue 16, item 5).

    python bench/gpu_profile_tables.py bench/results/h100_measure.json --targets dgx-h100 \
        --gemm-from bench/results/h100_gemm_pipelined.json
    python bench/gpu_profile_tables.py bench/results/h100_measure.json --targets h200 \
        --gemm-from bench/results/h200_gemm_pipelined.json

Each profile's GEMM table is its own device's grid timed back to back
(`gpu_measure.py --parts gemm_pipelined`, 2026-11-27: H100 SXM and H200), as a training step
enqueues them; the first H100 grid (h100_measure.json) timed each GEMM alone between two
events, so that its points under ~0.3 ms carried 10-15 us of launch latency. Both take the
H100's attention table: the same GH100 chip at the same clocks (132 SMs, 989 TFLOP/s bf16 on
both datasheets), attention being compute-bound (the H200's own 8K-128K points,
bench/results/h200_checks.md, are within 6% of it). The YAML's `measured:` block is
replaced; the rest of the file is kept as written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROFILES = Path(__file__).resolve().parent.parent / "cluster_profiles"
TARGETS = ("dgx-h100", "h200")
GEMMS = {"bf16": "bf16", "fp8": "fp8_tensorwise"}  # profile dtype -> measured column


def measured_block(data: dict, source: str, gemms: dict | None = None) -> list[str]:
    """`gemms`: another run's GEMM grid (its `gemm_pipelined` or `gemm`) in place of `data`'s."""
    where = f"measured on {data['device']}, torch {data['torch']}, {source}"
    grid = data["gemm"]
    if gemms is not None:
        grid = gemms.get("gemm_pipelined") or gemms["gemm"]
        how = "back to back" if "gemm_pipelined" in gemms else "alone"
        where = (
            f"GEMMs ({how}): {gemms['device']} {gemms['when'][:10]}; attention: "
            f"{data['device']} {data['when'][:10]}; torch {data['torch']}, {source}"
        )
    lines = [
        "measured:",
        f"  when: {data['when']!r}",
        f"  where: {where!r}",
        "  matmuls:  # F.linear(x[m,k], w[n,k]); fp8: torch._scaled_mm, tensorwise scales",
    ]
    for dtype, column in GEMMS.items():
        for r in grid:
            if column in r:
                flops = 2 * r["m"] * r["k"] * r["n"] / r[column]
                lines.append(
                    f"    - {{dtype: {dtype}, shape: [{r['m']}, {r['k']}, {r['n']}], "
                    f"flops_per_s: {flops:.4g}}}"
                )
    lines.append("  attention_times:  # causal scaled_dot_product_attention, seconds")
    for a in data["attention"]:
        lines.append(
            f"    - {{dtype: bf16, batch_heads: {a['batch'] * a['heads']}, seq: {a['seq']}, "
            f"head_dim: {a['head_dim']}, fwd_s: {a['fwd']:.4g}, "
            f"bwd_s: {a['fwd_bwd'] - a['fwd']:.4g}}}"
        )
    return lines


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("measured", type=Path, help="gpu_measure.py's JSON (gemm, attention)")
    parser.add_argument("--gemm-from", type=Path, help="another run's GEMM grid")
    parser.add_argument("--targets", default=",".join(TARGETS))
    args = parser.parse_args()
    data = json.loads(args.measured.read_text())
    gemms = json.loads(args.gemm_from.read_text()) if args.gemm_from else None
    source = f"bench/gpu_measure.py -> {args.measured.as_posix()}"
    if args.gemm_from:
        source = f"bench/results/{args.gemm_from.name}, {args.measured.name}"
    for name in args.targets.split(","):
        target = PROFILES / f"{name}.yaml"
        kept = target.read_text().split("\nmeasured:")[0].rstrip("\n").split("\n")
        block = measured_block(data, source, gemms)
        target.write_text("\n".join(kept + block) + "\n")
        print(f"wrote {target} ({len(block)} lines of measurements)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
