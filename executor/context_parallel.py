"""Context parallelism (the plan's mesh.cp; planner.parallel.context says what it is and how
it is priced): groups of cp neighbouring dp ranks split each sample's sequence into 2 x cp
chunks, rank r of a group keeping chunks r and 2 cp - 1 - r (every rank then holds an equal
share of the causal score matrix). Each attention layer rotates its queries and keys at their
global positions and hands them to the plan's sequence exchange (mesh.cp_comm): this
module's gathers keys and values on the cp group (their gradients are summed back in
backward) and attends each local chunk to the keys up to its end, causally aligned to the
lower right; executor.ulysses and executor.ring_attention hold the others. Parameters are
dp's: FSDP2 shards and reduces gradients over all of dp, and every rank's loss is the mean
over its own tokens, so the mean over dp is the batch's.

The all-gather is the form Llama 3 trained its long-context stage with (Dubey et al. 2024,
section 3.3.2). torch's experimental `context_parallel` dispatches CUDA attention kernels
only; these run wherever SDPA (or plain matmuls, the ring) does, gloo and CPU included.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from executor.errors import ExecutionError
from planner.models.llama import GQAttention
from planner.parallel.registry import exchange_of


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two of 2 x cp sequence chunks that rank `rank` of a cp group keeps."""
    return rank, 2 * cp - 1 - rank


def positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the tokens a cp rank keeps, in its local order."""
    size = seq // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunk_ids(cp, rank)])


def local_batch(tokens: torch.Tensor, labels: torch.Tensor, plan, dp_rank: int):
    """This dp rank's share of a global batch: its replica's samples (the batch is split over
    dp / cp replicas) and, under context parallelism, its two chunks of their sequence."""
    dp, cp = plan.mesh.shape[1], plan.mesh.cp or 1
    replica, per = dp_rank // cp, tokens.shape[0] // (dp // cp)
    x, y = tokens[replica * per : (replica + 1) * per], labels[replica * per : (replica + 1) * per]
    if cp == 1:
        return x, y
    keep = positions(tokens.shape[1], cp, dp_rank % cp)
    return x[:, keep], y[:, keep]


def gathered_order(seq: int, cp: int) -> torch.Tensor:
    """The permutation from the cp ranks' chunks laid end to end (rank 0's, then rank 1's,
    ...) to sequence order."""
    return torch.argsort(torch.cat([positions(seq, cp, r) for r in range(cp)]))


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 ([batch, heads, seq, head_dim]) on a group; backward sums the
    gathered gradient over the group and keeps this rank's part (a reduce-scatter: NCCL's,
    or gloo's all-reduce, which has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, world: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.world, ctx.rank = group, world, rank
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        chunks = [c.contiguous() for c in grad.chunk(ctx.world, dim=2)]
        if grad.is_cuda:
            out = torch.empty_like(chunks[ctx.rank])
            dist.reduce_scatter(out, chunks, group=ctx.group)
        else:
            whole = torch.cat(chunks, dim=2)
            dist.all_reduce(whole, group=ctx.group)
            out = whole.chunk(ctx.world, dim=2)[ctx.rank].contiguous()
        return out, None, None, None


class ContextShard:
    """What one cp rank's attention layers do in place of whole-sequence attention
    (GQAttention.context). Not a module: it holds no state a checkpoint would save."""

    def __init__(self, group, cp: int, rank: int, seq: int, device: torch.device):
        self.group, self.cp, self.rank, self.seq = group, cp, rank, seq
        self.positions = positions(seq, cp, rank).to(device)
        self.order = gathered_order(seq, cp).to(device)
        # The masks are made here, once: a CausalBias (a tensor subclass) cannot be created
        # under the selective checkpointing policies' dispatch mode.
        size = seq // (2 * cp)
        self.masks = [causal_lower_right(size, (c + 1) * size) for c in chunk_ids(cp, rank)]

    def __call__(self, q, k, v, rope=None, scale=None, window=None, softcap=None):
        plain_causal(self, "all_gather", window, softcap)
        if rope is not None:  # (transformers' models rotate q and k themselves)
            q, k = rope.at(q, self.positions), rope.at(k, self.positions)
        k = _GatherSequence.apply(k, self.group, self.cp, self.rank)[:, :, self.order]
        v = _GatherSequence.apply(v, self.group, self.cp, self.rank)[:, :, self.order]
        # Grouped-query attention in the kernel (flash on CUDA): the whole sequence's keys and
        # values are kept for backward at their kv heads, not repeated to the query heads.
        gqa = q.shape[1] != k.shape[1]
        size = self.seq // (2 * self.cp)
        out = []
        for j, c in enumerate(chunk_ids(self.cp, self.rank)):
            end, mask = (c + 1) * size, self.masks[j]
            qj = q[:, :, j * size : (j + 1) * size]
            kj, vj = k[:, :, :end], v[:, :, :end]
            out.append(
                F.scaled_dot_product_attention(qj, kj, vj, mask, scale=scale, enable_gqa=gqa)
            )
        return torch.cat(out, dim=2)


def apply_context_parallel(
    stage: nn.Module, mesh, cp: int, seq: int, device, comm: str | None = None
) -> int:
    """Give every attention layer of `stage` this rank's shard of the sequence exchange
    `comm` (None: this module's all-gather, ContextShard) on the mesh's "cp" group (nothing
    for cp = 1); the number of layers changed. A transformers model's attention layers
    call the shard through its attention interface (hf_attention), the model rotating
    queries and keys at the rank's positions (HFStage.position_ids)."""
    if cp == 1:
        return 0
    group, rank = mesh["cp"].get_group(), mesh["cp"].get_local_rank()
    shard = exchange_of(comm).shard_for(group, cp, rank, seq, device)
    layers = [m for m in stage.modules() if isinstance(m, GQAttention)]
    lm = getattr(stage, "_lm", None)  # executor.hf_stage.HFStage's model
    if lm is not None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(HF_ATTENTION, hf_attention)
        AttentionMaskInterface.register(HF_ATTENTION, lambda *args, **kwargs: None)
        lm.config._attn_implementation = HF_ATTENTION
        layers = [m for m in stage.modules() if type(m).__name__.endswith("Attention")]
        stage.position_ids = shard.positions
    for module in layers:
        module.context = shard
    return len(layers)


HF_ATTENTION = "autopar_context_parallel"


def hf_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention interface under context parallelism: the layer's shard
    attends the rank's queries (rotated at their global positions by the model) to the
    whole sequence's keys, causally by those positions, with the layer's own scale,
    sliding window and score cap (Gemma 2's and 3's; the exchanges that cannot apply the
    last two refuse them); the model's mask is not used."""
    del attention_mask
    out = module.context(
        query,
        key,
        value,
        scale=kwargs.get("scaling"),
        window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
    )
    return out.transpose(1, 2).contiguous(), None


def plain_causal(shard, exchange: str, window: int | None, softcap: float | None) -> None:
    """An exchange whose attention is the kernel's causal one refuses a sliding window
    shorter than the sequence and soft-capped scores by name (the plan should not have
    chosen it: planner.parallel.context.masked_attention_refusal)."""
    if window and window < shard.seq:
        raise ExecutionError(
            f"a sliding window of {window} tokens, which the {exchange} exchange's attention "
            f"does not apply (it attends to all {shard.seq} tokens); ring attention does"
        )
    if softcap:
        raise ExecutionError(
            f"soft-capped attention scores, which the {exchange} exchange's attention does "
            "not apply; ring attention does"
        )
