"""Megatron-LM (Megatron-Core; api/export/megatron.py): bf16/fp16 weights with fp32 main
gradients in one contiguous buffer (bf16 training accumulates and all-reduces gradients in
fp32 by default), and its distributed optimizer (--use-distributed-optimizer, the plan's
ZeRO-1) sharding the fp32 master weights and Adam's states over dp, not the gradient buffer.

Megatron Core's distributed optimizer guide gives the bytes per parameter for "float16
param, fp32 grads": 18 without the distributed optimizer, 6 + 12/d with it (d the data
parallel size): 2 (weights) + 4 (main gradients) + 12 (master, momentum, variance), the
12 split. fp32 training: 16, 8 + 8/d. ZeRO-3 (--use-torch-fsdp2) is torch's FSDP2: the ZeRO
paper's 16/d.

Megatron-LM forces fp32 gradient accumulation for bf16 (its arguments.py), which is what
`autopar export --to megatron` runs. NVIDIA's Megatron-Bridge performance recipes set
ddp.grad_reduce_in_fp32 = False instead (scripts/performance/utils/helpers.py,
set_basic_perf_overrides, in the version read) (bf16 gradient buffer: the guide's "float16 param,
float16 grads" row, 4 + 16/d): not this runtime (bench/results/runtime_memory.md).

Activations: what Megatron-Core with Transformer Engine keeps where the traced model keeps
more (saved_bytes below; a column-parallel linear's sequence-sharded input). Its backward
all-gathers that input again, overlapped with the input-gradient GEMM: not priced.

Tensor-parallel communication overlap (--tp-comm-overlap, Transformer Engine's userbuffers):
with sequence parallelism each all-gather and reduce-scatter of a layer is split into
chunks that run beside the GEMM consuming or producing them, so what the layer's compute
covers is hidden (tp_comm_overlap). NVIDIA runs its H100 recipes with it (NeMo's
llama3_70b pretraining recipe: MegatronCommOverlapCallback(tp_comm_overlap=True,
tp_comm_overlap_cfg=llama3_70b_bf16_tp_overlap_config()); Megatron-Bridge's performance
configs: CommOverlapConfig(tp_comm_overlap=True)), and `autopar export --to megatron` turns it
on with sequence parallelism. The SMs the chunked collectives take from the GEMMs are not
priced."""

from __future__ import annotations

from collections.abc import Mapping

from planner.runtime.declaration import Runtime, StateBytes, adam_states, low_precision, zero_paper


def state_bytes(dtype: str, optimizer: str, zero: int) -> StateBytes:
    if zero == 3:
        return zero_paper(dtype, optimizer, zero)
    weights = 2 if low_precision(dtype) else 4
    opt = (4 if low_precision(dtype) else 0) + 4 * adam_states(optimizer)
    optimizer_part = (0, opt) if zero == 1 else (opt, 0)
    return StateBytes(weights=(weights, 0), grads=(4, 0), optimizer=optimizer_part)


def _producer(node, i: int, nodes: Mapping):
    """The node whose output is `node`'s i-th argument, where the trace names one."""
    args = node.attrs.get("args") or []
    arg = args[i] if i < len(args) else None
    return nodes.get(arg["node"]) if isinstance(arg, dict) and "node" in arg else None


def saved_bytes(node, saved: int, nodes: Mapping) -> int:
    """What Megatron-Core with Transformer Engine keeps where the traced model keeps more:
    - attention over grouped key/value heads: TE's DotProductAttention takes the
      num_gqa_groups heads as they are; the traced model repeats them to every query head
      first (repeat_interleave) and the kernel keeps the repeated copies: K and V are kept
      at 1/r of the traced size;
    - SwiGLU: Megatron-Core's fused bias-SwiGLU keeps its input (the gate and the up
      projection) and recomputes silu in backward; the traced product keeps silu's output
      besides: not kept;
    - linears reading an input an earlier linear keeps (q, k and v; gate and up) are one
      fused GEMM in Megatron-Core (linear_qkv, linear_fc1): one copy of the input, also
      under fp8 (one cast), where torchao's Float8Linear casts it once per linear."""
    if node.kind == "linear" and node.saved_bytes == 0 and node.inputs:
        return 0
    if node.kind == "attention" and len(node.inputs) >= 3:
        for i in (1, 2):
            src = _producer(node, i, nodes)
            if src is not None and src.op.startswith("aten.repeat_interleave"):
                repeats = src.attrs["args"][1]
                if isinstance(repeats, int) and repeats > 1:
                    saved -= node.inputs[i].nbytes - node.inputs[i].nbytes // repeats
        return saved
    if node.op == "aten.mul.Tensor":
        for i, tensor in enumerate(node.inputs[:2]):
            src = _producer(node, i, nodes)
            if src is not None and src.op == "aten.silu.default":
                saved -= tensor.nbytes
    return max(saved, 0)


RUNTIME = Runtime(
    "megatron",
    summary="Megatron-LM: fp32 main gradients in a contiguous buffer, distributed optimizer",
    sources=(
        "megatron/core/tensor_parallel/layers.py, LinearWithGradAccumulationAndAsync"
        "Communication: saves the input it is given; with sequence_parallel it all-gathers "
        "that (sharded) input again in backward",
        "Transformer Engine DotProductAttention(num_gqa_groups=...): K/V not repeated",
        "megatron/core/fusions/fused_bias_swiglu.py: the fused SwiGLU saves its input",
        "Megatron Core developer guide, Distributed Optimizer: bytes per parameter, "
        "float16 param with fp32 grads 18 (non-distributed), 6 + 12/d (distributed); "
        "fp32 param and grads 16, 8 + 8/d "
        "(https://docs.nvidia.com/megatron-core/developer-guide/latest/distrib_optimizer.html)",
    ),
    zero_levels=(0, 1, 3),
    tp_comm_overlap=True,
    zero_names="DDP, its distributed optimizer (ZeRO-1) or torch FSDP2 (ZeRO-3)",
    state_bytes=state_bytes,
    saved_bytes=saved_bytes,
    keeps_sharded_linear_input=True,
)
