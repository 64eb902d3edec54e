"""ZeRO-1 on the dp axis as the plan prices it (planner.parallel.data, planner.evaluate.ledger):
every dp rank holds whole parameters and accumulates whole gradients; once a step each unit's
gradients (a layer block, or the stage's other parameters: the units FSDP2 wraps for ZeRO 2-3)
are reduce-scattered in one flat fp32 message and averaged, each rank steps the optimizer on
its shard of the flat parameters (fp32 master shards: the optimizer state is 1/dp of it), and
the updated shards are all-gathered back into the parameters. Megatron-LM's distributed
optimizer has this shape (a whole gradient buffer, reduce-scatter, a shard's step,
all-gather). Parameters are gathered in fp32, so the run follows the single-process
reference to rounding. In bf16/fp16 FSDP2 on a one-rank mesh casts them for compute and
accumulates their gradients in fp32 (executor.data_parallel), as at the other levels.

A unit's parameters go into separate flat buffers by what the gradient-norm needs to know of
them: whether tensor parallelism shards them (tp ranks hold different values) and whether
the norm counts them (tied copies on a stage other than the first are not counted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _tp_sharded(p: nn.Parameter) -> bool:
    """Whether tp ranks hold different values of `p` (a one-rank dim's Shard, FSDP2's cast
    in bf16/fp16 runs, splits nothing)."""
    if not hasattr(p, "placements"):
        return False
    mesh = p.device_mesh.shape
    return any(place.is_shard() and n > 1 for n, place in zip(mesh, p.placements, strict=True))


@dataclass
class Flat:
    params: list[nn.Parameter]
    master: nn.Parameter  # this rank's shard of the flat parameters, fp32
    numel: int  # the flat length before padding to a multiple of dp
    tp_sharded: bool
    counted: bool  # in the gradient norm


class ShardedOptimizer:
    """The plan's optimizer over this rank's master shards, with the gradient reduction
    before it and the parameters' all-gather after it."""

    def __init__(
        self,
        units: list[list[nn.Parameter]],
        group,
        build: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        uncounted: set[int],
    ):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.flats: list[Flat] = []
        for params in units:
            kinds: dict[tuple[bool, bool], list[nn.Parameter]] = {}
            for p in params:
                kinds.setdefault((_tp_sharded(p), id(p) not in uncounted), []).append(p)
            for (sharded, counted), members in kinds.items():
                self.flats.append(self._flat(members, sharded, counted))
        self.inner = build([f.master for f in self.flats])

    def _flat(self, params: list[nn.Parameter], sharded: bool, counted: bool) -> Flat:
        with torch.no_grad():
            flat = torch.cat([local_of(p).detach().reshape(-1).float() for p in params])
        shard = -(-flat.numel() // self.size)
        padded = torch.zeros(shard * self.size, dtype=torch.float32, device=flat.device)
        padded[: flat.numel()] = flat
        master = nn.Parameter(padded[self.rank * shard : (self.rank + 1) * shard].clone())
        return Flat(params, master, flat.numel(), sharded, counted)

    @property
    def state(self):
        return self.inner.state

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        for f in self.flats:
            for p in f.params:
                p.grad = None

    def reduce_gradients(self) -> None:
        """Each flat's gradients reduce-scattered over dp and averaged: this rank's shard of
        the step's mean gradient, on its master."""
        for f in self.flats:
            grads = [_local_grad(p) for p in f.params]
            size = f.master.numel() * self.size
            flat = torch.zeros(size, dtype=torch.float32, device=f.master.device)
            torch.cat([g.reshape(-1).float() for g in grads], out=flat[: f.numel])
            out = torch.empty_like(f.master)
            dist.reduce_scatter_single(out, flat, group=self.group)
            f.master.grad = out.div_(self.size)

    def norm_shards(self) -> dict[int, int]:
        """Per master (by id), into how many distinct pieces the ranks holding its stage
        split the values it holds a share of (executor.optim.clip_grad_norm)."""
        return {id(f.master): self.size * (_tp_of(f) if f.tp_sharded else 1) for f in self.flats}

    def uncounted(self) -> list[nn.Parameter]:
        return [f.master for f in self.flats if not f.counted]

    @property
    def masters(self) -> list[nn.Parameter]:
        return [f.master for f in self.flats]

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        for f in self.flats:
            size = f.master.numel() * self.size
            full = torch.empty(size, dtype=torch.float32, device=f.master.device)
            dist.all_gather_single(full, f.master.detach(), group=self.group)
            offset = 0
            for p in f.params:
                local = local_of(p)
                n = local.numel()
                local.copy_(full[offset : offset + n].view_as(local))
                offset += n


def _local_grad(p: nn.Parameter) -> torch.Tensor:
    """The local values of a parameter's gradient (placed as the parameter is:
    executor.optim.settle_gradients); zeros where it has none."""
    if p.grad is None:
        return torch.zeros_like(local_of(p.detach()))
    return local_of(p.grad)


def _tp_of(f: Flat) -> int:
    """The tp degree of a tp-sharded flat's parameters (their DTensor mesh's shard dims)."""
    p = f.params[0]
    size = 1
    for n, place in zip(p.device_mesh.shape, p.placements, strict=True):
        size *= n if place.is_shard() else 1
    return size


def checkpoint_state(optimizer: ShardedOptimizer) -> dict:
    """This rank's master shards and their optimizer state, under keys of its own (DCP keeps
    every rank's; a resumed run has the same ranks), for save and for load in place. The
    state is created first where the optimizer has not stepped yet (a zero step at lr 0, as
    torch's own optimizer state dicts do)."""
    inner = optimizer.inner
    if not inner.state:
        for f in optimizer.flats:
            f.master.grad = torch.zeros_like(f.master)
        rates = [group["lr"] for group in inner.param_groups]
        for group in inner.param_groups:
            group["lr"] = 0.0
        inner.step()
        for group, lr in zip(inner.param_groups, rates, strict=True):
            group["lr"] = lr
        inner.zero_grad()
    rank = dist.get_rank()
    out = {}
    for i, f in enumerate(optimizer.flats):
        state = inner.state.get(f.master, {})
        entry = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        out[f"rank{rank}_flat{i}"] = {"master": f.master.data, **entry}
    return out
