"""Write the measured GEMM and attention tables of `bench/gpu_measure.py` into the bundled
profiles of the device they were measured on (issue 16, item 5).

    python bench/gpu_profile_tables.py bench/results/h100_measure.json

dgx-h100 gets the H100 SXM's own table. h200 gets the same one: the H200 is the same GH100 chip
at the same clocks (132 SMs, 989 TFLOP/s bf16 on both datasheets) with faster, larger HBM3e,
so its compute-bound GEMM rates are the H100's; small memory-bound shapes may run a little
faster there (not measured). The YAML's `measured:` block is replaced; the rest of the file
is kept as written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROFILES = Path(__file__).resolve().parent.parent / "cluster_profiles"
TARGETS = ("dgx-h100", "h200")
GEMMS = {"bf16": "bf16", "fp8": "fp8_tensorwise"}  # profile dtype -> measured column


def measured_block(data: dict, source: str) -> list[str]:
    where = f"measured on {data['device']}, torch {data['torch']}, {source}"
    lines = [
        "measured:",
        f"  when: {data['when']!r}",
        f"  where: {where!r}",
        "  matmuls:  # F.linear(x[m,k], w[n,k]); fp8: torch._scaled_mm, tensorwise scales",
    ]
    for dtype, column in GEMMS.items():
        for r in data["gemm"]:
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
    path = Path(sys.argv[1])
    data = json.loads(path.read_text())
    for name in TARGETS:
        target = PROFILES / f"{name}.yaml"
        kept = target.read_text().split("\nmeasured:")[0].rstrip("\n").split("\n")
        block = measured_block(data, f"bench/gpu_measure.py -> {path.as_posix()}")
        target.write_text("\n".join(kept + block) + "\n")
        print(f"wrote {target} ({len(block)} lines of measurements)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
