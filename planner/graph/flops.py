"""FLOP formulas torch's FlopCounterMode lacks: the grouped GEMM that MoE layers run their
experts with (`aten._grouped_mm`; transformers' `grouped_mm_fallback` on CPU). Without them a
Mixtral trace counts its expert matmuls as 0 FLOPs."""

from __future__ import annotations

from math import prod

import torch


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """2 x (rows of the output) x (contracted dim) x (output columns), summed over groups:
    2-D a (tokens sorted by expert) x 3-D b (experts) is one row block per expert, so the total
    is 2 * M * K * N whatever the split; 3-D x 3-D is a batch of GEMMs; 2-D x 2-D with offsets
    (the weight gradient) splits the contracted dim."""
    k = a_shape[-1]
    n = b_shape[-1]
    rows = prod(a_shape[:-1])
    return 2 * rows * k * n


def custom_flop_formulas() -> dict:
    """op packet -> formula (shapes in), for FlopCounterMode(custom_mapping=...), which
    looks ops up by overload packet."""
    ops = {torch.ops.aten._grouped_mm: grouped_mm_flops}
    namespace = getattr(torch.ops, "transformers", None)
    if namespace is not None and hasattr(namespace, "grouped_mm_fallback"):
        ops[namespace.grouped_mm_fallback] = grouped_mm_flops
    return ops
