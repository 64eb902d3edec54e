"""Where a sharded tensor dim goes through a shape-changing op (reshape, view, transpose,
permute, ...), the dims an op works along (its `dim`, a norm's): shared by Megatron's layout
and the sharding rules."""

from __future__ import annotations

from planner.graph.opgraph import OpNode
from planner.placements import REPLICATE, shard


def map_reshape(src: list[int], dst: list[int], d: int, tp: int) -> int | None:
    """Where dim d of `src` lands in `dst` when only the shape changes (view/reshape/flatten):
    the dst dim that starts at the same element offset and can still be split tp ways."""
    prefix = 1
    for s in src[:d]:
        prefix *= s
    acc = 1
    for j, s in enumerate(dst):
        if acc == prefix and s % tp == 0 and s > 1:
            return j
        acc *= s
        if acc > prefix:
            break
    return None


def _int_args(node: OpNode) -> list[int]:
    return [a for a in node.attrs.get("args", []) if isinstance(a, int) and not isinstance(a, bool)]


def _op_dim(node: OpNode, ndim: int) -> int | None:
    """The `dim` argument of ops like cat/slice/chunk/softmax, normalised to >= 0."""
    dim = node.attrs.get("dim")
    if dim is None:
        ints = _int_args(node)
        base = node.op.split(".")[1] if node.op.count(".") >= 2 else node.op
        if base in ("cat",) and ints:
            dim = ints[0]
        elif (
            base
            in (
                "slice",
                "select",
                "narrow",
                "softmax",
                "_softmax",
                "log_softmax",
                "chunk",
                "split",
                "split_with_sizes",
                "cumsum",
                "repeat_interleave",
            )
            and ints
        ):
            dim = (
                ints[1]
                if base in ("chunk", "split", "split_with_sizes") and len(ints) > 1
                else ints[0]
            )
            if base == "repeat_interleave":
                dim = node.attrs.get("dim", ints[-1] if len(ints) > 1 else None)
    if isinstance(dim, int):
        return dim % ndim if ndim else 0
    return None


def moved_dim(node: OpNode, d: int, src_shape: list[int], out_shape: list[int], tp: int):
    """Where sharded dim d of the input goes through this op, or None if it cannot stay."""
    base = node.op.split(".")[1] if node.op.count(".") >= 2 else node.op
    ints = _int_args(node)
    ndim = len(src_shape)
    if base == "transpose" and len(ints) >= 2:
        a, b = ints[0] % ndim, ints[1] % ndim
        return b if d == a else a if d == b else d
    if base == "t":
        return 1 - d if ndim == 2 else d
    if base == "permute":
        dims = node.attrs["args"][1] if len(node.attrs.get("args", [])) > 1 else []
        dims = [x % ndim for x in dims] if isinstance(dims, list) else []
        return dims.index(d) if d in dims else None
    op_dim = _op_dim(node, ndim)
    if (
        base
        in (
            "softmax",
            "_softmax",
            "log_softmax",
            "cumsum",
            "cat",
            "slice",
            "narrow",
            "chunk",
            "split",
            "split_with_sizes",
        )
        or node.kind == "concat"
    ):
        if op_dim == d:
            return None
        return d if len(out_shape) == ndim else None
    if base == "select":
        if op_dim == d:
            return None
        return d - 1 if op_dim is not None and op_dim < d else d
    if len(out_shape) == ndim and out_shape[d] % tp == 0:
        return d  # element-wise, expand, repeat_interleave over the (local) head dim
    return map_reshape(src_shape, out_shape, d, tp)


def norm_dims(node: OpNode) -> set[int]:
    """Dims a norm reduces over (which must stay whole)."""
    shape = node.inputs[0].shape
    if "batch_norm" in node.op:
        return {d for d in range(len(shape)) if d not in (0, 1)}
    args = node.attrs.get("args", [])
    normalized = args[1] if len(args) > 1 and isinstance(args[1], list) else [shape[-1]]
    return set(range(len(shape) - len(normalized), len(shape)))


def follows_first(meta, first_shape: list[int], target: int) -> str:
    """A further output (chunk's and split's pieces, a norm's statistics) is split like the
    first where it has the same rank and the same size on the split dim, as DTensor
    propagates it; replicated otherwise."""
    shape = meta.shape
    same = len(shape) == len(first_shape) and shape[target] == first_shape[target]
    return shard(target) if same else REPLICATE


def dim_arg(node: OpNode) -> int | None:
    """The op's `dim` (softmax, a reduction), normalised to >= 0, or None."""
    args = node.attrs.get("args", [])
    dim = args[1] if len(args) > 1 and isinstance(args[1], int) else node.attrs.get("dim")
    if isinstance(dim, int) and node.inputs:
        return dim % max(len(node.inputs[0].shape), 1)
    return None
