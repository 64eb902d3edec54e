"""Half-precision matmul on this CPU beside fp32, one thread, square shapes: the source of
cpu-local's bf16 and fp16 peaks (cluster_profiles/cpu-local.yaml: fp32's peak times the
measured ratio), so the gloo tests can plan in the dtype they run.

Run: python bench/cpu_dtype_rates.py (writes bench/results/cpu_dtype_rates.md)
"""

from __future__ import annotations

import torch
from common import header, write
from cpu_fp8_rate import SHAPES, rate

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    torch.set_num_threads(1)
    rows = ["| n | fp32 FLOP/s | bf16 FLOP/s | fp16 FLOP/s | bf16 / fp32 | fp16 / fp32 |"]
    rows.append("|---|---|---|---|---|---|")
    for n in SHAPES:
        x, y = torch.randn(n, n), torch.randn(n, n)
        fp32 = rate(lambda x=x, y=y: x @ y, 2 * n**3)
        half = {}
        for name, dtype in DTYPES.items():
            a, b = x.to(dtype), y.to(dtype)
            half[name] = rate(lambda a=a, b=b: a @ b, 2 * n**3)
        rows.append(
            f"| {n} | {fp32:.3g} | {half['bf16']:.3g} | {half['fp16']:.3g} | "
            f"{half['bf16'] / fp32:.2f} | {half['fp16'] / fp32:.2f} |"
        )
    text = header("CPU half-precision matmul rates", "python bench/cpu_dtype_rates.py")
    write("cpu_dtype_rates.md", text + "\n\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
