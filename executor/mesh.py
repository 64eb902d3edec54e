"""The ("pp", "dp", "tp") DeviceMesh of a plan (ranks in the plan's mesh order)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from executor.errors import ExecutionError
from planner.plan import Plan


def build_mesh(plan: Plan, device_type: str = "cpu") -> DeviceMesh:
    pp, dp, tp = plan.mesh.shape
    world = dist.get_world_size()
    if pp * dp * tp != world:
        raise ExecutionError(
            f"mesh: the plan needs pp*dp*tp = {pp * dp * tp} processes, {world} were started"
        )
    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
