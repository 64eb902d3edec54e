"""Ulysses context parallelism (planner.parallel.ulysses says what it is and how it is
priced): a cp rank's attention exchanges its share of the sequence for 1/cp of the heads
with one all-to-all per tensor, attends those heads over the whole sequence, and exchanges
the output back. The tokens a rank holds are context parallelism's two load-balanced chunks
(executor.context_parallel.positions), so the whole sequence arrives in chunk order and is
put in sequence order for causal attention, and back after it."""

from __future__ import annotations

from math import gcd

import torch
import torch.distributed as dist
import torch.nn.functional as F

from executor.context_parallel import gathered_order, plain_causal, positions


def _exchange(x: torch.Tensor, group, cp: int, to_heads: bool) -> torch.Tensor:
    """[batch, heads, tokens, dim] -> the whole sequence's tokens (in the ranks' order) for
    this rank's 1/cp of the heads (`to_heads`), or the inverse."""
    b, h, s, d = x.shape
    if to_heads:  # send head group j to rank j; receive rank j's tokens of our heads
        send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)
    else:  # send our heads of rank j's tokens back to rank j
        send = x.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4)
    send = send.contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    if to_heads:  # [rank, b, h/cp, s, d] -> [b, h/cp, rank x s, d]
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)
    return recv.transpose(0, 1).reshape(b, cp * h, s // cp, d)


class _Exchange(torch.autograd.Function):
    """The all-to-all before attention (`to_heads`) or after it; its gradient is the
    inverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, cp: int, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.cp, ctx.to_heads = group, cp, to_heads
        return _exchange(x, group, cp, to_heads)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group, ctx.cp, not ctx.to_heads), None, None, None


class UlyssesShard:
    """What one cp rank's attention layers do in place of whole-sequence attention
    (GQAttention.context). Not a module: it holds no state a checkpoint would save."""

    def __init__(self, group, cp: int, rank: int, seq: int, device: torch.device):
        self.group, self.cp = group, cp
        self.positions = positions(seq, cp, rank).to(device)
        self.seq = seq  # the whole sequence's length
        self.order = gathered_order(seq, cp).to(device)
        self.back = torch.argsort(self.order)  # and back

    def __call__(self, q, k, v, rope=None, scale=None, window=None, softcap=None):
        plain_causal(self, "ulysses", window, softcap)
        if rope is not None:  # (transformers' models rotate q and k themselves)
            q, k = rope.at(q, self.positions), rope.at(k, self.positions)
        repeats = self.cp // gcd(k.shape[1], self.cp)  # so that cp divides the kv heads
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        q, k, v = (
            _Exchange.apply(t, self.group, self.cp, True)[:, :, self.order] for t in (q, k, v)
        )
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return _Exchange.apply(out[:, :, self.back].contiguous(), self.group, self.cp, False)
