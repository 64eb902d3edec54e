"""Graph mode's ZeRO-0: parameters replicated over dp, so each gradient is a partial sum
over dp (DTensor's Partial) until it is reduced. Reduced one DTensor at a time, that is an
all-reduce per parameter; the plan prices one message per FSDP2 unit (each layer block, and
a stage's other parameters: planner.evaluate.ledger), as DDP's buckets and FSDP2's
`replicate` send. So the gradients of a unit are summed in one flat all-reduce, once a
step, before settle_gradients reduces what is left partial on tp."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


def unit_buckets(stages) -> list[list[nn.Parameter]]:
    """This rank's parameters by unit: per plan stage, each layer block it lists in its
    modules (a name with an index, `blocks.3`), then the rest."""
    out: list[list[nn.Parameter]] = []
    for st, stage in stages:
        blocks = [m for m in st.modules if any(part.isdigit() for part in m.split("."))]
        units: dict[str | None, list[nn.Parameter]] = {}
        for name, param in stage.canonical_parameters():
            unit = next((b for b in blocks if name.startswith(b + ".")), None)
            units.setdefault(unit, []).append(param)
        out.extend(units.values())
    return out


def reduce_unit_gradients(buckets: list[list[nn.Parameter]], axis: str = "dp") -> None:
    """Sum each bucket's gradients that are partial over mesh dim `axis` in one all-reduce
    per (bucket, reduce op, dtype); they are then replicated on that dim. (A stage mesh
    without the dim: it has size 1, nothing to sum.)"""
    for params in buckets:
        groups: dict[tuple, list[nn.Parameter]] = {}
        for p in params:
            g = p.grad
            names = (g.device_mesh.mesh_dim_names or ()) if isinstance(g, DTensor) else ()
            if axis in names and g.placements[names.index(axis)].is_partial():
                dim = names.index(axis)
                key = (g.placements[dim].reduce_op, g.dtype, g.device_mesh, dim)
                groups.setdefault(key, []).append(p)
        for (op, _, mesh, dim), members in groups.items():
            locals_ = [p.grad.to_local() for p in members]
            flat = torch.cat([t.reshape(-1) for t in locals_])
            group = mesh.get_group(dim)
            dist.all_reduce(flat, group=group)
            if op == "avg":  # gloo has no average: the sum over the group's size
                flat /= dist.get_world_size(group)
            offset = 0
            for p, local in zip(members, locals_, strict=True):
                n = local.numel()
                placements = list(p.grad.placements)
                placements[dim] = Replicate()
                p.grad = DTensor.from_local(
                    flat[offset : offset + n].view_as(local).clone(),
                    mesh,
                    placements,
                    shape=p.grad.shape,
                    stride=p.grad.stride(),
                    run_check=False,
                )
                offset += n
