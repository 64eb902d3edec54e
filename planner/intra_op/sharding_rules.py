"""Per-axis sharding choices for each node kind (one mesh axis at a time).

Matmul-like ops are written as einsum equations over letters: linear `...i,oi,o->...o`,
embedding `vh,bt->bth`, conv2d `bcHW,ocxy,o->bohw`, attention `bhtd,bhsd,bhsd->bhtd`. Sharding
one letter L on an axis shards every operand that has L; the output is sharded on L if it has
it, otherwise it is a partial sum ("P"). This single rule gives, for a linear, batch- and
sequence-parallel (a batch letter), column-parallel (the output-feature letter) and
row-parallel (the contracted letter); for an embedding, vocab-parallel (P out) and
hidden-parallel; for attention, batch and head parallel; for the MoE expert einsums,
expert-parallel (the token exchange shows up as an all-to-all reshard on the edge; grouped
expert matmuls, as transformers' MoE, give a partial sum instead). Backward: an operand
without L, when L is in the output, gets a partial gradient to all-reduce on the axis
(activations per micro-batch; parameters once per step, or reduce-scattered under ZeRO-3).

Follower ops (element-wise, reshapes, norms, softmax, reductions) keep one sharded dim
through the op where the op allows it. Every node can also run replicated. Each choice maps
to DTensor placements (Replicate, Shard(d), Partial) the executor applies."""

from __future__ import annotations

from dataclasses import dataclass

from planner.graph.opgraph import OpNode
from planner.intra_op.dims import dim_arg, follows_first, moved_dim, norm_dims
from planner.placements import PARTIAL, REPLICATE, shard

R, P = REPLICATE, PARTIAL
_LETTERS = "abcdefgjklmnpqruwz"  # batch-like letters for leading dims


S = shard


@dataclass(frozen=True)
class AxisChoice:
    """How one node runs along one mesh axis."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[tuple[str, str], ...] = ()
    split_compute: bool = False
    partial_input_grads: tuple[int, ...] = ()  # activation inputs whose grads need all-reduce
    partial_param_grads: tuple[str, ...] = ()  # parameters whose grads need reduction
    fwd_comm: tuple[tuple[str, int], ...] = ()  # extra collectives: (name, bytes of full tensor)
    zero3: bool = False  # parameters in partial_param_grads are stored sharded (ZeRO-3)


def replicated(node: OpNode) -> AxisChoice:
    return AxisChoice(
        "replicate",
        tuple(R for _ in node.inputs),
        tuple(R for _ in node.outputs),
        tuple((p, R) for p in node.params),
    )


def _divisible(size: int, n: int) -> bool:
    return size >= n and size % n == 0


# --- einsum-style ops ---------------------------------------------------------------------
@dataclass(frozen=True)
class Equation:
    operands: tuple[tuple[str, str | int], ...]  # (letters, "param name" or input index)
    output: str
    sizes: dict
    shardable: frozenset[str]
    names: dict  # letter -> strategy name


def equation_for(node: OpNode) -> Equation | None:
    ops = node.attrs.get("operands") or []
    ins = node.inputs
    kind = node.kind

    def operand_list(letters: list[str]) -> tuple[tuple[str, str | int], ...]:
        out = []
        for spec, lt in zip(ops, letters, strict=False):
            ref = spec[1] if spec[0] == "param" else spec[1] if spec[0] == "input" else None
            if ref is None or lt is None:
                continue
            out.append((lt, ref))
        return tuple(out)

    if kind == "linear" and "linear" in node.op and ins:
        k = len(ins[0].shape)
        batch = _LETTERS[: k - 1]
        letters = [batch + "i", "oi", "o"]
        eq_out = batch + "o"
        names = {"i": "row", "o": "col"}
        if k >= 2:
            names[batch[0]] = "batch"
        if k >= 3:
            names[batch[1]] = "seq"
        shardable = set(batch) | {"i", "o"}
    elif kind == "embedding" and ins:
        k = len(ins[0].shape)
        batch = _LETTERS[:k]
        letters = ["vh", batch]
        eq_out = batch + "h"
        names = {"v": "vocab", "h": "hidden", batch[0]: "batch"}
        if k >= 2:
            names[batch[1]] = "seq"
        shardable = set(batch) | {"v", "h"}
    elif kind == "attention" and len(ins) >= 3:
        letters = ["bhtd", "bhsd", "bhsd"]
        eq_out = "bhtd"
        names = {"b": "batch", "h": "heads"}
        shardable = {"b", "h"}
    elif kind == "conv2d" and ins and len(ins[0].shape) == 4:
        letters = ["bcHW", "ocxy", "o"]
        eq_out = "bohw"
        names = {"b": "batch", "o": "out_channels", "c": "in_channels"}
        shardable = {"b", "o", "c"}
    elif kind == "grouped_mm" and len(ins) >= 3 and len(ins[1].shape) == 3:
        # rows grouped by expert (m: data-dependent, never split), weights (e, k, n), offsets
        letters, eq_out = ["mk", "ekn", None], "mn"
        names = {"e": "experts", "k": "contract", "n": "cols"}
        shardable = {"e", "k", "n"}
    elif kind in ("einsum", "matmul") and "->" in str(node.attrs.get("equation", "")):
        lhs, eq_out = str(node.attrs["equation"]).split("->")
        letters = lhs.split(",")
        names = {c: f"split_{c}" for c in set("".join(letters))}
        shardable = set("".join(letters))
    elif kind == "matmul" and len(ins) >= 2 and ("bmm" in node.op or ".mm." in node.op):
        letters = ["bmk", "bkn"] if "bmm" in node.op else ["mk", "kn"]
        eq_out = "bmn" if "bmm" in node.op else "mn"
        names = {"b": "batch", "m": "rows", "n": "cols", "k": "contract"}
        shardable = set("bmnk") if "bmm" in node.op else set("mnk")
    else:
        return None
    operands = operand_list(letters)
    if len(operands) < 1:
        return None
    sizes: dict[str, int] = {}
    for letters_i, ref in operands:
        shape = node.params[ref].shape if isinstance(ref, str) else ins[ref].shape
        if len(shape) != len(letters_i):
            return None
        for c, s in zip(letters_i, shape, strict=True):
            sizes.setdefault(c, s)
    for c, s in zip(eq_out, node.outputs[0].shape, strict=False):
        sizes.setdefault(c, s)
    return Equation(operands, eq_out, sizes, frozenset(shardable), names)


def _input_needs_grad(node: OpNode, idx: int) -> bool:
    return node.inputs[idx].dtype.startswith(("float", "bfloat"))


def einsum_choices(node: OpNode, eq: Equation, n: int) -> list[AxisChoice]:
    out: list[AxisChoice] = []
    for letter in sorted(eq.shardable):
        if letter not in eq.sizes or not _divisible(eq.sizes[letter], n):
            continue
        inputs = [R] * len(node.inputs)
        params = {p: R for p in node.params}
        partial_in: list[int] = []
        partial_par: list[str] = []
        for letters, ref in eq.operands:
            if letter in letters:
                place = S(letters.index(letter))
            else:
                place = R
                if letter in eq.output:
                    if isinstance(ref, str):
                        partial_par.append(ref)
                    elif _input_needs_grad(node, ref):
                        partial_in.append(ref)
                elif not isinstance(ref, str) and _input_needs_grad(node, ref):
                    # a summed letter this input lacks (a grouped matmul's tokens under its
                    # experts' split): each rank's part of its gradient comes from its share
                    # of the sum, so it is partial too (a linear's or conv's bias, added
                    # after the sum, is a parameter and is not)
                    partial_in.append(ref)
            if isinstance(ref, str):
                params[ref] = place
            else:
                inputs[ref] = place
        output = S(eq.output.index(letter)) if letter in eq.output else P
        outputs = (output, *(R for _ in node.outputs[1:]))
        out.append(
            AxisChoice(
                eq.names.get(letter, f"split_{letter}"),
                tuple(inputs),
                outputs,
                tuple(params.items()),
                split_compute=True,
                partial_input_grads=tuple(sorted(set(partial_in))),
                partial_param_grads=tuple(dict.fromkeys(partial_par)),
            )
        )
    return out


# --- followers ----------------------------------------------------------------------------
def follower_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """Shard one output dim d; each input follows it (or stays replicated if it broadcasts)."""
    if not node.inputs or not node.outputs:
        return []
    out_shape = node.outputs[0].shape
    src = max(range(len(node.inputs)), key=lambda i: len(node.inputs[i].shape))
    src_shape = node.inputs[src].shape
    choices = []
    blocked = norm_dims(node) if node.kind == "norm" else set()
    for d in range(len(src_shape)):
        if d in blocked or not _divisible(src_shape[d], n):
            continue
        target = moved_dim(node, d, list(src_shape), list(out_shape), n)
        if target is None or not _divisible(out_shape[target], n):
            continue
        if node.kind == "softmax" and dim_arg(node) == d:
            continue
        inputs = []
        for i, meta in enumerate(node.inputs):
            if i == src:
                inputs.append(S(d))
                continue
            offset = len(meta.shape) - len(out_shape)
            aligned = target + offset
            ok = 0 <= aligned < len(meta.shape) and meta.shape[aligned] == out_shape[target]
            same_rank = len(meta.shape) == len(src_shape) and meta.shape[d] == src_shape[d]
            if node.kind in ("reshape", "concat") and same_rank:
                inputs.append(S(d))
            elif node.kind not in ("reshape", "concat") and ok:
                inputs.append(S(aligned))
            else:
                inputs.append(R)
        params: dict[str, str] = {}
        partial: list[str] = []
        for pname in node.params:
            if "batch_norm" in node.op and d == 1:
                params[pname] = S(0)
            else:
                params[pname] = R
                partial.append(pname)
        choices.append(
            AxisChoice(
                f"dim{d}",
                tuple(inputs),
                (S(target), *(follows_first(meta, out_shape, target) for meta in node.outputs[1:])),
                tuple(params.items()),
                split_compute=True,
                partial_param_grads=tuple(partial),
            )
        )
    return choices


def loss_choices(node: OpNode, n: int) -> list[AxisChoice]:
    logits = node.inputs[0]
    out: list[AxisChoice] = []
    rest = tuple(R for _ in node.inputs[1:])
    if _divisible(logits.shape[0], n):
        out.append(
            AxisChoice(
                "batch",
                tuple(S(0) for _ in node.inputs),
                (P, *(R for _ in node.outputs[1:])),
                split_compute=True,
            )
        )
    if "cross_entropy" in node.op and len(logits.shape) == 2 and _divisible(logits.shape[1], n):
        rows = logits.shape[0] * 4  # one float32 per row: max, sum of exp, target logit
        out.append(
            AxisChoice(
                "vocab",
                (S(1), *rest),
                (R, *(R for _ in node.outputs[1:])),
                split_compute=True,
                fwd_comm=(("all_reduce", rows),) * 3,
            )
        )
    return out


def source_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """Graph inputs and constants: any dim may be laid out sharded from the start. A
    constant made in the shape of a tensor (ones_like) reads only its shape: that tensor
    sharded alike where it has the constant's shape, else whole."""
    out = []
    shape = node.outputs[0].shape if node.outputs else []
    for d, size in enumerate(shape):
        if _divisible(size, n):
            inputs = tuple(S(d) if list(t.shape) == list(shape) else "R" for t in node.inputs)
            out.append(AxisChoice(f"dim{d}", inputs, (S(d),), split_compute=True))
    return out


def axis_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """Every way `node` can run along one mesh axis of size n (replicated first)."""
    base = [replicated(node)]
    if n == 1:
        return base
    if node.kind in ("input", "constant"):
        return base + source_choices(node, n)
    if node.kind == "loss":
        return base + loss_choices(node, n)
    eq = equation_for(node)
    if eq is not None:
        return base + einsum_choices(node, eq, n)
    if node.kind == "reduction":
        return base + reduction_choices(node, n)
    if node.kind in (
        "elementwise",
        "reshape",
        "concat",
        "norm",
        "softmax",
        "pool",
        "scatter",
        "other",
    ):
        choices = follower_choices(node, n)
        allowed = {
            "pool": {0, 1},  # batch and channels; spatial dims would need halos
            "scatter": {0} if dim_arg(node) not in (0, None) else set(),
            "other": {0},
        }.get(node.kind)
        if allowed is not None:
            choices = [c for c in choices if int(c.name.removeprefix("dim")) in allowed]
        return base + choices
    return base


def reduction_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """sum/mean/amax over dims, topk/cumsum along a dim: kept dims follow; a summed dim gives
    a partial sum."""
    if len(node.inputs) != 1:
        return []
    shape = node.inputs[0].shape
    ndim = len(shape)
    base = node.op.split(".")[1] if node.op.count(".") >= 2 else node.op
    args = node.attrs.get("args", [])
    if base in ("topk", "cumsum"):
        raw = args[2] if base == "topk" and len(args) > 2 else args[1] if len(args) > 1 else -1
        reduced = {raw % ndim} if isinstance(raw, int) else set(range(ndim))
        keep = True
    else:
        raw = args[1] if len(args) > 1 else node.attrs.get("dim")
        dims = raw if isinstance(raw, list) else [raw] if isinstance(raw, int) else None
        reduced = {d % ndim for d in dims} if dims else set(range(ndim))
        keep = (
            bool(args[2])
            if len(args) > 2 and isinstance(args[2], bool)
            else bool(node.attrs.get("keepdim", False))
        )
    choices = []
    for d in range(ndim):
        if not _divisible(shape[d], n):
            continue
        if d in reduced:
            if base == "sum":
                outs = (P, *(R for _ in node.outputs[1:]))
                choices.append(AxisChoice(f"dim{d}", (S(d),), outs, split_compute=True))
            continue
        target = d if keep else d - sum(1 for r in reduced if r < d)
        outs = tuple(S(target) for _ in node.outputs)
        choices.append(AxisChoice(f"dim{d}", (S(d),), outs, split_compute=True))
    return choices


def with_zero(choice: AxisChoice, node: OpNode, n: int) -> AxisChoice | None:
    """The ZeRO-3 variant of a data-parallel choice: replicated parameters whose gradients are
    reduced on this axis are stored sharded on dim 0 and gathered for compute."""
    if not choice.partial_param_grads:
        return None
    if not all(_divisible(node.params[p].shape[0], n) for p in choice.partial_param_grads):
        return None
    params = tuple(
        (p, S(0) if p in choice.partial_param_grads else place) for p, place in choice.params
    )
    return AxisChoice(
        choice.name + "+zero3",
        choice.inputs,
        choice.outputs,
        params,
        choice.split_compute,
        choice.partial_input_grads,
        choice.partial_param_grads,
        choice.fwd_comm,
        zero3=True,
    )
