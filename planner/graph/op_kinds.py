"""Operator kinds: which aten ops are matmul-like, attention, element-wise, reshapes, ... (the
OpGraph's `kind`, the vocabulary the sharding rules and the cost model work in)."""

from __future__ import annotations

from typing import Any

import torch

ATTENTION_OPS = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention",
}
KIND_BY_OP = {
    **{op: "attention" for op in ATTENTION_OPS},
    "linear": "linear",
    "embedding": "embedding",
    "layer_norm": "norm",
    "native_layer_norm": "norm",
    "rms_norm": "norm",
    "group_norm": "norm",
    "batch_norm": "norm",
    "_native_batch_norm_legit": "norm",
    "_native_batch_norm_legit_functional": "norm",
    "_native_batch_norm_legit_no_training": "norm",
    "native_batch_norm": "norm",
    "conv2d": "conv2d",
    "convolution": "conv2d",
    "max_pool2d": "pool",
    "max_pool2d_with_indices": "pool",
    "avg_pool2d": "pool",
    "adaptive_avg_pool2d": "pool",
    "mean": "reduction",
    "sum": "reduction",
    "amax": "reduction",
    "topk": "reduction",
    "cumsum": "reduction",
    "softmax": "softmax",
    "_softmax": "softmax",
    "log_softmax": "softmax",
    "_log_softmax": "softmax",
    "cross_entropy_loss": "loss",
    "nll_loss": "loss",
    "nll_loss_forward": "loss",
    "mse_loss": "loss",
    "einsum": "einsum",
    "bmm": "matmul",
    "matmul": "matmul",
    "mm": "matmul",
    "addmm": "matmul",
    "baddbmm": "matmul",
    # MoE experts as one grouped GEMM (torch's, and transformers' CPU fallback of it)
    "_grouped_mm": "grouped_mm",
    "grouped_mm": "grouped_mm",
    "grouped_mm_fallback": "grouped_mm",
    "cat": "concat",
    "scatter": "scatter",
    "scatter_add": "scatter",
    "index_select": "scatter",
    "gather": "scatter",
    "zeros": "constant",
    "ones": "constant",
    "full": "constant",
    "arange": "constant",
    "empty": "constant",
    "zeros_like": "constant",
    "ones_like": "constant",
}
RESHAPE_OPS = {
    "view",
    "_unsafe_view",
    "reshape",
    "transpose",
    "permute",
    "flatten",
    "unflatten",
    "unsqueeze",
    "squeeze",
    "expand",
    "slice",
    "select",
    "t",
    "contiguous",
    "clone",
    "chunk",
    "split",
    "split_with_sizes",
    "alias",
    "detach",
    "repeat_interleave",
    "repeat",
    "narrow",
    "unbind",
    "broadcast_tensors",
    "expand_as",
}


def op_name(target: Any) -> str:
    """`aten.linear.default` -> 'linear'."""
    packet = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    return str(packet).split(".")[0]


def classify(target: Any, has_params: bool) -> str:
    name = op_name(target)
    if name in KIND_BY_OP:
        kind = KIND_BY_OP[name]
        if kind == "matmul" and has_params:
            return "linear"
        return kind
    if name in RESHAPE_OPS:
        return "reshape"
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return "elementwise"
    if name in ("dropout", "native_dropout", "to", "_to_copy", "type_as", "where", "clamp"):
        return "elementwise"
    return "other"
