"""The CPU's software float8 GEMM (torch._scaled_mm, tensorwise scales, e4m3 operands, fp32
out) beside fp32 matmul, one thread, square shapes: the source of cpu-local's fp8 peak
(cluster_profiles/cpu-local.yaml), so fp8 plans can be made for the gloo tests that run
them. It is ~2,000x slower than fp32: a CPU plan never picks fp8 for speed, and the
search only offers it on CUDA devices; it is planned when pinned.

Run: python bench/cpu_fp8_rate.py (writes bench/results/cpu_fp8_rate.md)
"""

from __future__ import annotations

import time

import torch
from common import header, write

SHAPES = (256, 512, 1024)
SECONDS = 2.0


def rate(fn, flops: float) -> float:
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < SECONDS:
        fn()
        calls += 1
    return flops * calls / (time.perf_counter() - start)


def main() -> None:
    torch.set_num_threads(1)
    rows = ["| n | fp8 FLOP/s | fp32 FLOP/s | fp32 / fp8 |", "|---|---|---|---|"]
    one = torch.tensor(1.0)
    for n in SHAPES:
        a = torch.randn(n, n).to(torch.float8_e4m3fn)
        b = torch.randn(n, n).to(torch.float8_e4m3fn).t()
        x, y = torch.randn(n, n), torch.randn(n, n)
        fp8 = rate(
            lambda a=a, b=b: torch._scaled_mm(a, b, one, one, out_dtype=torch.float32), 2 * n**3
        )
        fp32 = rate(lambda x=x, y=y: x @ y, 2 * n**3)
        rows.append(f"| {n} | {fp8:.3g} | {fp32:.3g} | {fp32 / fp8:,.0f} |")
    text = header("CPU software fp8 GEMM rate", "python bench/cpu_fp8_rate.py")
    write("cpu_fp8_rate.md", text + "\n\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
