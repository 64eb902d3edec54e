"""Apply a stage's tensor-parallel shardings with DTensor parallel styles. Strategy names are the
sharding rules' (Megatron's layout uses them too): column-parallel linears (`col`) ->
ColwiseParallel; row-parallel (`row`) -> RowwiseParallel; a vocab-parallel embedding (`vocab`)
-> RowwiseParallel with replicated ids. Head-parallel attention and element-wise followers need
nothing: the model code infers local head counts from shapes. Under a vocab-parallel loss (the
plan's loss node `vocab`, Megatron's layout) the last stage's column-parallel head leaves its
logits sharded and the loss runs under torch's `loss_parallel` (three all-reduces of one float
per token, as the plan prices); otherwise the head gathers its logits. Strategies with no
executor support yet raise an ExecutionError that names the node, rather than running
something else.

With sequence parallelism (the plan's `sequence_parallel`; planner.parallel.sequence) the
tensors between tp regions are sequence shards (dim 1): norms run under SequenceParallel
(transformers' RMSNorms, traced op by op, by the module holding the weight they multiply);
the embedding and row-parallel linears reduce-scatter onto the sequence; the module holding
column-parallel linears (attention, MLP) all-gathers its input once, as a DTensor, so its
linears' partial input gradients are summed and reduce-scattered once; a position table
(GPT's) is cut to the rank's part of the sequence; the head gathers its input itself. MoE
blocks and latent attention run whole on the gathered sequence (ReplicatedBlock), or with
expert tp 1 the MoE blocks on the rank's shard (executor.expert_parallel.TokenShardBlock).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from executor.errors import ExecutionError
from executor.expert_parallel import TokenShardBlock
from planner.executable import REPLICATED, executable
from planner.intra_op.expert_layout import moe_blocks
from planner.intra_op.megatron import whole_blocks
from planner.plan import NodeSharding

SEQ = Shard(1)  # the sequence dim of [batch, seq, hidden]


def _strategy(s: NodeSharding) -> str:
    return s.strategy.split("|")[-1].removeprefix("tp:")


def tensor_parallel_plan(
    stage: nn.Module,
    shardings: list[NodeSharding],
    head: str | None,
    sequence_parallel: bool = False,
    share_inputs: bool = False,
    vocab_loss: bool = False,
    fold_experts: bool = False,
):
    """The parallel styles of a stage. `vocab_loss`: the head leaves its logits vocab-sharded
    for torch's loss_parallel (executor.parallelize decides where it runs). `share_inputs`:
    the stage's attention and MLP modules feed their input to column-parallel linears only
    (the zoo's gpt and llama blocks), so each may turn it into one DTensor the linears share
    (always so with sequence parallelism). `fold_experts` (the plan's expert tp 1): the MoE
    blocks run on the rank's sequence shard (TokenShardBlock)."""
    names = dict(stage.named_modules())
    linear_splits = {s.module: _strategy(s) for s in shardings if s.kind == "linear" and s.module}
    # under sequence parallelism, whole blocks (MoE blocks, latent attention) gather their
    # input once (ReplicatedBlock): the tp-split linears inside take and give whole tensors;
    # with expert tp 1 the MoE blocks take the rank's tokens as they come (TokenShardBlock)
    blocks = sorted(whole_blocks(shardings)) if sequence_parallel else []
    folded = sorted(moe_blocks(shardings)) if sequence_parallel and fold_experts else []
    plan: dict = {name: ReplicatedBlock() for name in blocks if name not in folded}
    plan.update({name: TokenShardBlock() for name in folded})
    for s in shardings:
        if _inside(s.module, folded):
            continue  # the block's style runs it (its nodes' strategy: TOKENS)
        sp = sequence_parallel and not _inside(s.module, blocks)
        strategy = _strategy(s)
        if not executable(s.kind, s.strategy):
            raise ExecutionError(
                f"node {s.node} ({s.module or s.kind}): strategy {s.strategy!r} is not "
                "executable yet (supported on tp: column/row-parallel linears, vocab-parallel "
                "embedding and loss, head-parallel attention, followers)"
            )
        if sp and s.kind in ("norm", "embedding"):
            plan.update(_sequence_style(s, strategy, names))
        tp_dim = strategy.removeprefix("dim")
        if s.kind == "elementwise" and tp_dim.isdigit() and s.module not in plan:
            plan.update(_sharded_weight_style(s, int(tp_dim), names))
        if s.kind not in ("linear", "embedding") or strategy in REPLICATED:
            continue  # attention heads, the loss, followers: run on whatever shard they get
        module = names.get(s.module)
        if isinstance(module, nn.Linear) and strategy == "col":
            share = share_inputs or sp or _feeds_split_linears_only(s.module, names, linear_splits)
            plan[s.module] = _column(s.module, head, sp, share, plan, vocab_loss)
        elif isinstance(module, nn.Linear) and strategy == "row":
            plan[s.module] = RowwiseParallel(output_layouts=SEQ if sp else None)
        elif isinstance(module, nn.Embedding) and strategy == "vocab":
            out = SEQ if sp else Replicate()
            plan[s.module] = RowwiseParallel(input_layouts=Replicate(), output_layouts=out)
        else:
            raise ExecutionError(
                f"node {s.node}: strategy {s.strategy!r} needs module {s.module!r} to be a "
                f"{'Linear' if s.kind == 'linear' else 'Embedding'} of this stage; it is "
                f"{type(module).__name__ if module is not None else 'missing'}"
            )
    return plan


def _inside(name: str | None, blocks: list[str]) -> bool:
    return bool(name) and any(name == b or name.startswith(b + ".") for b in blocks)


def _with_input(args: tuple, kwargs: dict, change) -> tuple[tuple, dict]:
    """A module's call with its input changed: transformers passes an attention module its
    input as `hidden_states=`, an MLP positionally, whatever the parameter's name, so the
    first positional argument where there is one, else that keyword."""
    if args:
        return (change(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
    return args, kwargs


class ReplicatedBlock(ParallelStyle):
    """Under sequence parallelism, a block the plan runs whole on every tp rank (a
    mixture-of-experts block, its router and experts replicated; DeepSeek's latent
    attention): its input, a sequence shard, is all-gathered; its output, the same on every
    rank, is cut back to this rank's part of the sequence (and its gradient all-gathered).
    Its replicated weights stay plain tensors: every rank computes the same gradients."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(value):
            if not isinstance(value, torch.Tensor):
                return value
            shard = DTensor.from_local(value, device_mesh, (SEQ,), run_check=False)
            return shard.redistribute(placements=(Replicate(),)).to_local()

        def cut(value):
            if not isinstance(value, torch.Tensor):
                return value
            whole = DTensor.from_local(value, device_mesh, (Replicate(),), run_check=False)
            return whole.redistribute(placements=(SEQ,)).to_local()

        def prepare(mod, args, kwargs):
            return _with_input(args, kwargs, gather)

        def finish(mod, args, kwargs, output):
            if isinstance(output, tuple):
                return (cut(output[0]), *output[1:])
            return cut(output)

        module.register_forward_pre_hook(prepare, with_kwargs=True)
        module.register_forward_hook(finish, with_kwargs=True)
        return module


def vocab_parallel_loss(plan) -> bool:
    """Whether the plan computes the loss on vocab-sharded logits (Megatron's layout: its
    last stage's head split over tp > 1)."""
    last = plan.stages[-1]
    shardings = last.shardings
    return plan.mesh.stage_shape(last.index)[1] > 1 and any(
        s.kind == "loss" and _strategy(s) == "vocab" for s in shardings
    )


def _feeds_split_linears_only(name: str, names: dict, splits: dict[str, str]) -> bool:
    """Whether the module holding linear `name` (e.g. transformers' attention or MLP) has
    only column- and row-parallel linears as children, so its input feeds tp-split linears
    only and may be one DTensor they share (not a MoE block, whose router is replicated)."""
    parent = name.rpartition(".")[0]
    module = names.get(parent)
    if not parent or module is None:
        return False
    linears = [
        f"{parent}.{child}" for child, m in module.named_children() if isinstance(m, nn.Linear)
    ]
    return all(splits.get(n) in ("col", "row") for n in linears)


class SharedInput(ParallelStyle):
    """Makes a module's input one Replicate DTensor (from `layout`: sequence shards are
    gathered) that its column-parallel linears share, passed either way (_with_input;
    PrepareModuleInput binds one way, and a module called the other way would be left as
    it came, its linears each gathering or reducing on their own)."""

    def __init__(self, layout):
        super().__init__()
        self.layout = layout

    def _replicated(self, value, mesh: DeviceMesh):
        if not isinstance(value, torch.Tensor):
            return value
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, mesh, (self.layout,), run_check=False)
        return value.redistribute(placements=(Replicate(),))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def prepare(mod, args, kwargs):
            return _with_input(args, kwargs, lambda x: self._replicated(x, device_mesh))

        module.register_forward_pre_hook(prepare, with_kwargs=True)
        return module


def _column(
    name: str,
    head: str | None,
    sequence_parallel: bool,
    share: bool,
    plan: dict,
    vocab: bool,
):
    """A column-parallel linear's style. With `share`, the module holding it (attention,
    MLP) turns its input into one DTensor (with sequence parallelism, gathered from sequence
    shards) that all its column-parallel linears share: their partial input gradients are
    summed and then all-reduced (or reduce-scattered) once, as the planner's Megatron layout
    counts, instead of once per linear."""
    if name == head:
        seq = SEQ if sequence_parallel else None
        if vocab:  # logits stay vocab-sharded: the loss runs under loss_parallel
            return ColwiseParallel(
                input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
            )
        return ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    parent = name.rpartition(".")[0]
    if parent and share:
        plan[parent] = SharedInput(SEQ if sequence_parallel else Replicate())
    elif sequence_parallel:
        raise ExecutionError(
            f"{name}: sequence parallelism gathers a column-parallel linear's input at "
            "the module holding it; this linear is not inside one"
        )
    return ColwiseParallel()


def _sequence_style(s: NodeSharding, strategy: str, names: dict) -> dict:
    """Sequence parallelism's styles for a norm (on its sequence shard) and for a replicated
    position table (cut to this rank's part of the sequence, its second-to-last dim)."""
    module = names.get(s.module)
    if s.kind == "norm" and strategy.startswith("dim") and module is not None:
        return {s.module: SequenceParallel()}
    if s.kind == "embedding" and strategy in REPLICATED and isinstance(module, nn.Embedding):
        return {
            s.module: PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(0)
            )
        }
    return {}


def _sharded_weight_style(s: NodeSharding, dim: int, names: dict) -> dict:
    """A module without children (not a linear or embedding) that holds weights and whose
    first element-wise op runs on a tp shard: a norm the trace recorded op by op
    (transformers' RMSNorm on the sequence shard; Qwen3's and Gemma 3's q/k norms on each
    rank's heads), its weight broadcast over the shard. Its input is taken as that shard
    and its weights as replicated DTensors, so their gradients, partial sums over the
    shards, are all-reduced as the layout prices them (planner.intra_op.megatron)."""
    module = names.get(s.module)
    if (
        module is None
        or next(module.children(), None) is not None
        or next(module.parameters(recurse=False), None) is None
        or isinstance(module, (nn.Linear, nn.Embedding))
    ):
        return {}
    # local outputs: a residual add takes a post-norm's output (Gemma 2/3, OLMo 2), and the
    # modules after a pre-norm turn its sequence shard into what they need themselves
    return {s.module: SequenceParallel(sequence_dim=dim, use_local_output=True)}


def apply_tensor_parallel(
    stage: nn.Module,
    shardings: list[NodeSharding],
    tp_mesh: DeviceMesh,
    head: str | None,
    sequence_parallel: bool = False,
    share_inputs: bool = False,
    vocab_loss: bool = False,
    fold_experts: bool = False,
) -> None:
    if tp_mesh.size() == 1:
        return
    plan = tensor_parallel_plan(
        stage, shardings, head, sequence_parallel, share_inputs, vocab_loss, fold_experts
    )
    _local_head_counts(stage, plan, tp_mesh.size())
    if plan:
        parallelize_module(stage, tp_mesh, plan)
    if sequence_parallel:
        for name in plan:
            _scale_after_reduce_scatter(stage.get_submodule(name))


# Attributes some transformers attention modules reshape by (StableLM's views its queries
# as (batch, seq, self.num_heads, head_dim)); most infer the head count from the shape.
HEAD_COUNTS = ("num_heads", "num_key_value_heads")


def _local_head_counts(stage: nn.Module, plan: dict, tp: int) -> None:
    """An attention module whose q/k/v projections are column-parallel computes tp's share
    of the heads: head counts it holds as attributes become the rank's (once: a module
    keeps the tp it was divided by)."""
    parents = {
        name.rpartition(".")[0]
        for name, style in plan.items()
        if isinstance(style, ColwiseParallel) and "." in name
    }
    for parent in sorted(parents):
        module = stage.get_submodule(parent)
        counts = {a: getattr(module, a, None) for a in HEAD_COUNTS}
        counts = {a: c for a, c in counts.items() if isinstance(c, int)}
        if not counts or getattr(module, "_tp_heads_divided_by", None):
            continue
        if any(c % tp for c in counts.values()):
            raise ExecutionError(f"{parent}: head counts {counts} are not divisible by tp {tp}")
        for attr, count in counts.items():
            setattr(module, attr, count // tp)
        module._tp_heads_divided_by = tp


def _scale_after_reduce_scatter(module: nn.Module) -> None:
    """transformers' scaled word embeddings (Gemma's: the lookup times `embed_scale`, inside
    the module's forward) multiply the vocab-parallel lookup's partial sums, which DTensor
    all-reduces before the style's output hook could reduce-scatter them. Under sequence
    parallelism the lookup alone runs in the forward and the scale is applied to the
    reduce-scattered shard, by a hook registered after the style's (hooks run in that
    order): the same numbers, since one rank's row is the only non-zero term of each token's sum."""
    scale = getattr(module, "embed_scale", None)
    if not isinstance(module, nn.Embedding) or not isinstance(scale, torch.Tensor):
        return
    module.forward = nn.Embedding.forward.__get__(module)

    def scaled(mod: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        scale = mod.embed_scale  # the style made the module's buffers replicated DTensors
        scale = scale.to_local() if isinstance(scale, DTensor) else scale
        return output * scale.to(mod.weight.dtype)

    module.register_forward_hook(scaled)
