"""The ops graph mode runs on local shards, where DTensor has no sharding rule for the plan's
placements: attention (per batch element and head), convolutions split on channels, and the
reduction of a vocab-parallel lookup's masked partial sum. Each returns None when the
placements are not ones it handles (the caller then runs the op replicated)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _MaskPartial

# Per (batch, head) independent: run on local shards (DTensor has no rule for the CPU kernel).
LOCAL_OPS = {torch.ops.aten.scaled_dot_product_attention.default}
# DTensor shards convolutions on the batch only; channel splits run on local shards.
CONV_OPS = {torch.ops.aten.conv2d.default, torch.ops.aten.convolution.default}
# Grouped expert matmuls (x rows grouped by expert, per-expert weights, cumulative offsets):
# torch's, and transformers' CPU fallback (registered when transformers' MoE code loads).
GROUPED_MM_OPS = frozenset({"aten::_grouped_mm", "transformers::grouped_mm_fallback"})


def is_grouped_mm(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.name() in GROUPED_MM_OPS


def is_masked(value: Any) -> bool:
    """A vocab-parallel lookup's output: a masked partial sum on some mesh dim."""
    return isinstance(value, DTensor) and any(isinstance(p, _MaskPartial) for p in value.placements)


def reduce_masked(value: DTensor) -> DTensor:
    """Reduce a masked partial sum. It can be reduced once only (its mask is freed), but its
    users may sit in other pipeline stages or checkpointed blocks that would reduce it again:
    graph mode reduces it where it is made, as its first user would."""
    return _ReduceMasked.apply(value)


class _ReduceMasked(torch.autograd.Function):
    """A vocab-parallel lookup's masked partial sum, reduced. Its gradient goes back whole
    on those mesh dims, as the lookup's backward takes it (DTensor's own redistribute would
    try to turn a partial gradient into a masked partial, which it cannot)."""

    @staticmethod
    def forward(ctx, x: DTensor) -> DTensor:
        ctx.masked = [isinstance(p, _MaskPartial) for p in x.placements]
        whole = [Replicate() if m else p for m, p in zip(ctx.masked, x.placements, strict=True)]
        return x.redistribute(x.device_mesh, whole)

    @staticmethod
    def backward(ctx, grad: DTensor) -> DTensor:
        placements = [
            Replicate() if m else p for m, p in zip(ctx.masked, grad.placements, strict=True)
        ]
        return grad.redistribute(grad.device_mesh, placements)


def _is_shard(p, dim: int) -> bool:
    return isinstance(p, Shard) and p.dim == dim


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous: DTensor infers global strides from local
    ones, and a kernel's oddly strided gradient would make later views fail."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def attention_on_local_shards(op, args, kwargs, mesh: DeviceMesh) -> Any:
    """Ops that are independent per batch element and head (attention): each rank runs
    its shard locally when all tensor inputs share placements on those dims."""
    tensors = [a for a in args if isinstance(a, DTensor)]
    first = list(tensors[0].placements)
    if not all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim in (0, 1)) for p in first
    ):
        return None  # the caller runs it replicated
    args = tuple(_as_shards(a, first, mesh) if isinstance(a, DTensor) else a for a in args)
    if not all(_same_shard(t, first) for t in args if isinstance(t, DTensor)):
        return None
    local_args = [
        _ContiguousGrad.apply(a.to_local()) if isinstance(a, DTensor) else a for a in args
    ]
    # contiguous: DTensor derives global strides from the local ones, and the CPU kernel
    # returns a transposed layout that later views would misread.
    out = op(*local_args, **kwargs).contiguous()
    return DTensor.from_local(out, mesh, first, run_check=False)


def _as_shards(t: DTensor, placements: list, mesh: DeviceMesh) -> DTensor:
    """A replicated operand (an attention mask) cut to the other inputs' batch or head
    shard: a local slice with no communication, as the plan places it (replicated, used by
    each shard). A dim of size 1 broadcasts and stays whole."""
    if not all(isinstance(p, Replicate) for p in t.placements):
        return t
    wanted = [
        Replicate() if isinstance(p, Shard) and t.shape[p.dim] == 1 else p for p in placements
    ]
    return t.redistribute(mesh, wanted)


def _same_shard(t: DTensor, placements: list) -> bool:
    """Whether `t`'s local value lines up with a shard placed as `placements` (equal
    placements, or whole where it broadcasts)."""
    return all(
        have == want
        or (isinstance(have, Replicate) and isinstance(want, Shard) and t.shape[want.dim] == 1)
        for have, want in zip(t.placements, placements, strict=True)
    )


def conv_on_local_shards(op, args, kwargs, mesh: DeviceMesh) -> Any:
    """A convolution on local shards, per mesh dim: batch-split input and whole weight
    give a batch-split output; whole input and output-channel-split weight (and bias) an
    output-channel split; input and weight both split on input channels a partial sum.
    Any other combination, or a bias, runs replicated."""
    x, w, bias = args[0], args[1], args[2] if len(args) > 2 else None
    if bias is not None:
        return None  # the zoo's convolutions have none (batch norm follows each)
    out: list = []
    for px, pw in zip(x.placements, w.placements, strict=True):
        if isinstance(px, Shard) and px.dim == 0 and isinstance(pw, Replicate):
            out.append(Shard(0))
        elif isinstance(px, Replicate) and isinstance(pw, Shard) and pw.dim == 0:
            out.append(Shard(1))
        elif isinstance(px, Shard) and px.dim == 1 and isinstance(pw, Shard) and pw.dim == 1:
            out.append(Partial())
        elif isinstance(px, Replicate) and isinstance(pw, Replicate):
            out.append(Replicate())
        else:
            return None  # the caller runs it replicated
    # A replicated operand's gradient is a partial sum where the other operand is split
    # (the input's over output channels, the weight's over the batch).
    x_grad = [Partial() if _is_shard(o, 1) else p for o, p in zip(out, x.placements, strict=True)]
    w_grad = [Partial() if _is_shard(o, 0) else p for o, p in zip(out, w.placements, strict=True)]
    local_x = x.to_local(grad_placements=x_grad)
    local_w = w.to_local(grad_placements=w_grad)
    local = op(local_x, local_w, None, *args[3:], **kwargs)
    return DTensor.from_local(local.contiguous(), mesh, out, run_check=False)


def grouped_mm_on_local_shards(op, args, kwargs, mesh: DeviceMesh) -> Any:
    """x (m, k) @ w (e, k, n) grouped by expert, on local shards, per mesh dim: weights split
    on experts give a partial sum (each rank multiplies its experts' rows, zeros elsewhere);
    x and w split on k a partial sum; w split on n an output split on n; all whole, whole.
    Any other combination runs replicated."""
    x, w = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    if not isinstance(x, DTensor) or not isinstance(w, DTensor) or offs is None:
        return None
    out: list = []
    for px, pw in zip(x.placements, w.placements, strict=True):
        if (isinstance(px, Replicate) and _is_shard(pw, 0)) or (
            _is_shard(px, 1) and _is_shard(pw, 1)
        ):
            out.append(Partial())
        elif isinstance(px, Replicate) and _is_shard(pw, 2):
            out.append(Shard(1))
        elif isinstance(px, Replicate) and isinstance(pw, Replicate):
            out.append(Replicate())
        else:
            return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    # x's gradient is a partial sum where x is whole and w is split (on experts or on n)
    x_grad = [
        Partial() if isinstance(px, Replicate) and not isinstance(o, Replicate) else px
        for o, px in zip(out, x.placements, strict=True)
    ]
    local_x = x.to_local(grad_placements=x_grad)
    local_w = w.to_local()
    ends = offs.full_tensor() if isinstance(offs, DTensor) else offs
    (experts, _, _), (first, _, _) = compute_local_shape_and_global_offset(
        w.shape, mesh, list(w.placements)
    )
    start = int(ends[first - 1]) if first > 0 else 0
    end = int(ends[first + experts - 1]) if experts > 0 else start
    rest = [a for a in args[3:]]
    local_kwargs = {k: v for k, v in kwargs.items() if k != "offs"}
    local_offs = (ends[first : first + experts] - start).to(ends.dtype)
    rows = op(local_x[start:end], local_w, local_offs, *rest, **local_kwargs)
    whole = torch.nn.functional.pad(rows, (0, 0, start, local_x.shape[0] - end))
    return DTensor.from_local(whole.contiguous(), mesh, out, run_check=False)
