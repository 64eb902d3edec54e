"""The plan's optimizer, learning-rate defaults and gradient clipping, shared by every executor
path and by the single-process reference (so both take the same step).

Optimizer state lives wherever the parameters do: with FSDP2 (ZeRO 2-3) each parameter is a
DTensor sharded over dp, so AdamW's moments are sharded with it; ZeRO-1 steps fp32 master
shards of whole parameters (executor.zero1); with ZeRO-0 parameters are replicated and so is
the state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from planner.vocab import OPTIMIZERS

# Learning rates when the run does not set one: SGD's is the tests' historical 0.1; Adam's
# is a common small-model value (GPT-2/3 small used 6e-4).
DEFAULT_LR = {"sgd": 0.1, "sgd_momentum": 0.1, "adam": 6e-4, "adamw": 6e-4}
assert set(DEFAULT_LR) == set(OPTIMIZERS), "every optimizer name needs a default lr"
WEIGHT_DECAY = 0.1  # AdamW, as GPT-3 and Llama trained (Brown et al. 2020; Touvron et al. 2023)
BETAS = (0.9, 0.95)  # ditto


def build_optimizer(
    name: str, params: list[nn.Parameter], lr: float | None, momentum: float = 0.0
) -> torch.optim.Optimizer:
    """The plan's `training.optimizer`. `momentum` only applies to plain "sgd" (a run option
    kept for SGD-with-momentum checkpoint tests); "sgd_momentum" uses 0.9."""
    lr = DEFAULT_LR[name] if lr is None else lr
    # foreach=False: one kernel per parameter, so DTensors of different meshes (tp-only,
    # dp x tp) never meet in one grouped kernel.
    if name == "adamw":
        return torch.optim.AdamW(
            params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY, foreach=False
        )
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=BETAS, foreach=False)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, foreach=False)


def settle_gradients(params: Iterable[nn.Parameter]) -> None:
    """Each DTensor gradient in its parameter's placements, once, before clipping and the
    optimizer read it: a partial sum left by tensor parallelism (sequence-parallel norms'
    weights) is reduced here instead of at every op that reads it (the norm, then the step:
    twice), and a gradient wider than its parameter's shard (a vocab-parallel embedding's
    whole table) is cut to the shard, so no rank holds the whole."""
    for p in params:
        grad = p.grad
        if grad is not None and hasattr(grad, "placements") and grad.placements != p.placements:
            p.grad = grad.redistribute(placements=p.placements)


def _weighted_square_sum(g: torch.Tensor, holders: int, pieces: int = 1) -> torch.Tensor:
    """This rank's share of the squared norm of gradient `g`: the squares of its local shard
    over the number of ranks holding that same shard (`holders`: the ranks that hold the
    parameter at all, of which a DTensor's Shard placements split the values, and `pieces`
    further, for what its placements do not say: executor.zero1's master shards, expert
    parallelism's experts)."""
    placements = getattr(g, "placements", None)
    if placements is None:
        local, copies = g, holders // pieces
    elif any(p.is_partial() for p in placements):  # not summed yet: gather it whole
        local, copies = g.full_tensor(), holders // pieces
    else:
        local = g.to_local()
        shards = 1
        for size, place in zip(g.device_mesh.shape, placements, strict=True):
            # (FSDP2's _StridedShard, under tensor parallelism, is a shard too)
            shards *= 1 if place.is_replicate() else size
        copies = holders // shards // pieces
    sq = local.detach().to(torch.float32).pow(2).sum().to(torch.float64)
    return sq / copies


def clip_grad_norm(
    params: Iterable[nn.Parameter],
    max_norm: float,
    holders: int | None = None,
    skip: Iterable[nn.Parameter] = (),
    pieces: dict[int, int] | None = None,
) -> float:
    """Scale gradients so that the global L2 norm (over every pipeline stage) is at most
    `max_norm`; returns the norm before clipping. `skip`: parameters whose gradient another
    stage also holds (tied embeddings), counted once. max_norm <= 0 or inf: no clipping.

    In a distributed run each rank adds the squares of its local shards, each divided by the
    number of ranks holding the same shard (`holders`: the ranks of this rank's pipeline
    stage, default all), and one all-reduce over every rank sums the shares: one 8-byte
    message a step (a DTensor's own norm would be one all-reduce per parameter)."""
    params = [p for p in params if p.grad is not None]
    skipped = {id(p) for p in skip}
    distributed = dist.is_available() and dist.is_initialized()
    holders = holders or (dist.get_world_size() if distributed else 1)
    device = params[0].grad.device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if id(p) not in skipped:
            share = _weighted_square_sum(p.grad, holders, (pieces or {}).get(id(p), 1))
            total += share.to(device)
    if distributed and dist.get_world_size() > 1:
        dist.all_reduce(total)
    norm = math.sqrt(float(total))
    if max_norm > 0 and math.isfinite(max_norm):
        scale = max_norm / (norm + 1e-6)
        if scale < 1.0:
            for p in params:
                p.grad.mul_(scale)
    return norm


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (its local shards, for DTensor state)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total
