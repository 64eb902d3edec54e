"""Expert parallelism (planner.parallel.expert says what it is and how it is priced): each of
the ep ranks of a group keeps E / ep of every MoE layer's experts; a layer's dispatch buffer
[E, groups, capacity, hidden] (capacity-padded, so its size does not depend on the router) is
cut by destination rank and exchanged with one all-to-all, the rank's experts compute every
group member's tokens for them, and a second all-to-all sends the outputs back to the ranks
that combine them. Both all-to-alls are their own gradient's inverse.

The expert weights are then different on each rank of the group, alike across groups: their
gradients are summed over the expert-data-parallel group (the dp / ep ranks holding the same
experts) by the data-parallel wrapper (executor.data_parallel.apply_expert_data_parallel),
and divided by all of dp, since each holds the sum of the ep group's contributions."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from planner.models.moe import Experts, MoELayer


class _AllToAll(torch.autograd.Function):
    """Chunk j of the input (dim 0) to rank j of the group; chunk j of the output from rank
    j. With equal chunks its gradient is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class ExpertExchange:
    """What a MoE layer does with its dispatch buffer in place of computing all experts
    (MoELayer.exchange). Not a module: it holds no state a checkpoint would save."""

    def __init__(self, group, ep: int):
        self.group, self.ep = group, ep

    def __call__(self, x: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        e, groups, capacity, hidden = x.shape
        ep, local = self.ep, e // self.ep
        # [rank that owns the experts, its experts, ...]: chunk j goes to rank j
        received = _AllToAll.apply(x.reshape(ep, local, groups, capacity, hidden), self.group)
        # [sender, our experts, ...] -> our experts over every sender's groups
        tokens = received.transpose(0, 1).reshape(local, ep * groups, capacity, hidden)
        out = experts(tokens)
        back = out.reshape(local, ep, groups, capacity, hidden).transpose(0, 1)
        return _AllToAll.apply(back, self.group).reshape(e, groups, capacity, hidden)


def expert_modules(stage: nn.Module) -> list[Experts]:
    return [m.experts for m in stage.modules() if isinstance(m, MoELayer)]


def apply_expert_parallel(stage: nn.Module, mesh, ep: int) -> list[Experts]:
    """Keep this rank's E / ep experts of each MoE layer of the stage and exchange tokens
    over the mesh's ep group; returns the stages' expert modules (none where ep is 1)."""
    if ep == 1:
        return []
    group, rank = mesh["ep"].get_group(), mesh["ep"].get_local_rank()
    exchange = ExpertExchange(group, ep)
    found = []
    for layer in (m for m in stage.modules() if isinstance(m, MoELayer)):
        experts = layer.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            local = p.shape[0] // ep
            mine = p.detach()[rank * local : (rank + 1) * local].clone()
            setattr(experts, name, nn.Parameter(mine, requires_grad=p.requires_grad))
        layer.exchange = exchange
        found.append(experts)
    return found


def whole_experts(experts: list[nn.Module], mesh, ep: int) -> dict[int, torch.Tensor]:
    """Each expert weight (by id) with every rank's experts, gathered over the ep group (for
    comparing a run with the single-process reference)."""
    if ep == 1:
        return {}
    group, out = mesh["ep"].get_group(), {}
    for module in experts:
        for p in module.parameters():
            local = p.detach()
            local = local.full_tensor() if hasattr(local, "full_tensor") else local
            parts = [torch.empty_like(local) for _ in range(ep)]
            dist.all_gather(parts, local.contiguous(), group=group)
            out[id(p)] = torch.cat(parts)
    return out
