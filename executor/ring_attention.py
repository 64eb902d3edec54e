"""Ring attention (planner.parallel.ring_attention says what it is and how it is priced): a
cp rank attends its queries to one key/value block at a time while the blocks travel round
the cp group, merging the blocks' outputs by their log-sum-exp; backward sends the blocks
round again with their gradients, which end at the block's owner.

Written with matmuls on the block's scores (any device, gloo included); each block is masked
by the global positions of its tokens (context parallelism's two load-balanced chunks per
rank, executor.context_parallel.positions), so causality holds across blocks. Statistics and
outputs are accumulated in fp32."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from executor.context_parallel import positions


class Ring:
    """A cp group as a ring: each step sends to the next rank and receives from the
    previous one."""

    def __init__(self, group, cp: int, rank: int):
        self.group, self.cp, self.rank = group, cp, rank
        self.next = dist.get_global_rank(group, (rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (rank - 1) % cp)

    def pass_on(self, tensors: tuple[torch.Tensor, ...]):
        """Start sending `tensors` on and receiving the previous rank's; (received, works)."""
        received = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors)
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return received, dist.batch_isend_irecv(ops)


def _repeat(t: torch.Tensor, groups: int) -> torch.Tensor:
    """kv heads repeated to the query heads they serve, in fp32."""
    return t.float().repeat_interleave(groups, dim=1) if groups > 1 else t.float()


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal by global positions and, with a sliding window, only the last `window`
    positions (transformers' rule: q - k < window)."""
    mask = q_pos[:, None] >= k_pos[None, :]
    if window:
        mask &= q_pos[:, None] - k_pos[None, :] < window
    return mask


def _scores(q, k, mask, scale, softcap=None):
    """The block's masked scores and, with a soft cap (Gemma 2's tanh(s / cap) x cap, as
    transformers applies it before the mask), the cap's derivative for backward."""
    s = q @ k.transpose(-1, -2) * scale
    slope = None
    if softcap:
        s = torch.tanh(s / softcap) * softcap
        slope = 1 - (s / softcap) ** 2
    return s.masked_fill(~mask, float("-inf")), slope


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with the rows that saw no key (-inf) at 0, so that exp(-inf - 0) = 0."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, q_pos, block_pos: list, scale: float, window, softcap):
        groups = q.shape[1] // k.shape[1]
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        block = (k, v)
        for step in range(ring.cp):
            owner = (ring.rank - step) % ring.cp
            if step < ring.cp - 1:  # the next block travels while this one is attended
                upcoming, works = ring.pass_on(block)
            kk, vv = _repeat(block[0], groups), _repeat(block[1], groups)
            s, _ = _scores(qf, kk, _mask(q_pos, block_pos[owner], window), scale, softcap)
            block_lse = torch.logsumexp(s, dim=-1)
            o = torch.exp(s - _finite(block_lse)[..., None]) @ vv
            merged = _finite(torch.logaddexp(lse, block_lse))
            out = (
                out * torch.exp(lse - merged)[..., None]
                + o * torch.exp(block_lse - merged)[..., None]
            )
            lse = torch.logaddexp(lse, block_lse)
            if step < ring.cp - 1:
                for work in works:
                    work.wait()
                block = upcoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.q_pos, ctx.block_pos, ctx.scale = ring, q_pos, block_pos, scale
        ctx.window, ctx.softcap = window, softcap
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        groups = q.shape[1] // k.shape[1]
        qf, dout = q.float(), grad_out.float()
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        block = (k, v)
        grads = (torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32))
        for step in range(ring.cp):
            owner = (ring.rank - step) % ring.cp
            if step < ring.cp - 1:
                upcoming, works = ring.pass_on(block)
            kk, vv = _repeat(block[0], groups), _repeat(block[1], groups)
            mask = _mask(ctx.q_pos, ctx.block_pos[owner], ctx.window)
            s, slope = _scores(qf, kk, mask, scale, ctx.softcap)
            p = torch.exp(s - lse[..., None])
            ds = p * (dout @ vv.transpose(-1, -2) - delta)
            if slope is not None:  # through the cap to the raw scores
                ds = ds * slope
            dq += ds @ kk * scale
            dk = (ds.transpose(-1, -2) @ qf * scale).unflatten(1, (-1, groups)).sum(2)
            dv = (p.transpose(-1, -2) @ dout).unflatten(1, (-1, groups)).sum(2)
            # the block's gradients travel with it: after cp passes they reach its owner
            grads, grad_works = ring.pass_on((grads[0] + dk, grads[1] + dv))
            for work in grad_works:
                work.wait()
            if step < ring.cp - 1:
                for work in works:
                    work.wait()
                block = upcoming
        return (
            *(dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype)),
            *(None, None, None, None, None, None),
        )


class RingShard:
    """What one cp rank's attention layers do in place of whole-sequence attention
    (GQAttention.context). Not a module: it holds no state a checkpoint would save."""

    def __init__(self, group, cp: int, rank: int, seq: int, device: torch.device):
        self.ring = Ring(group, cp, rank)
        self.positions = positions(seq, cp, rank).to(device)
        self.seq = seq  # the whole sequence's length
        self.block_positions = [positions(seq, cp, r).to(device) for r in range(cp)]

    def __call__(self, q, k, v, rope=None, scale=None, window=None, softcap=None):
        """Attention of this rank's queries to the whole sequence; `scale` (default
        1/sqrt(head_dim)), a sliding `window` and a score `softcap` as the model's layer has
        them (transformers passes Gemma 2's and 3's)."""
        if rope is not None:  # (transformers' models rotate q and k themselves)
            q, k = rope.at(q, self.positions), rope.at(k, self.positions)
        scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        where = (self.ring, self.positions, self.block_positions)
        return _RingAttention.apply(q, k, v, *where, scale, window, softcap)
