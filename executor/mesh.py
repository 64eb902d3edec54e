"""The ("pp", "dp", "tp") DeviceMesh of a plan (ranks in the plan's mesh order). Under HSDP
(the plan's mesh.dp_shard) dp is two dims, ("dp_replicate", "dp_shard"), flattened into "dp"
for everything but FSDP2, which shards on the inner one and replicates across the outer.
Under context parallelism (mesh.cp) dp is ("dp_replicas", "cp"), flattened into "dp" too: the
"cp" groups split each sample's sequence (executor.context_parallel). Under expert parallelism
(mesh.ep) dp is ("edp", "ep"): the "ep" groups split the experts (executor.expert_parallel),
"edp" holds the ranks with the same experts."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from executor.errors import ExecutionError
from planner.plan import Plan

HYBRID_DIMS = ("dp_replicate", "dp_shard")
CONTEXT_DIMS = ("dp_replicas", "cp")  # dp under context parallelism: replicas x cp
EXPERT_DIMS = ("edp", "ep")  # dp under expert parallelism: expert-data-parallel x ep


def build_mesh(plan: Plan, device_type: str = "cpu") -> DeviceMesh:
    dims = plan.mesh.dims  # planner.parallel_dims: the degrees, world = pp x dp x cp x tp
    pp, tp = dims.pp, dims.tp
    world = dist.get_world_size()
    if dims.world != world:
        raise ExecutionError(
            f"mesh: the plan needs pp x dp x cp x tp = {dims.world} processes, {world} were started"
        )
    if dims.cp > 1:  # context parallelism: groups of cp neighbouring ranks, flattened into dp
        shape = (pp, dims.dp, dims.cp, tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", *CONTEXT_DIMS, "tp"))
        mesh[CONTEXT_DIMS]._flatten("dp")
        return mesh
    if dims.ep > 1:  # expert parallelism: groups of ep neighbouring ranks, flattened into dp
        shape = (pp, dims.dp // dims.ep, dims.ep, tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", *EXPERT_DIMS, "tp"))
        mesh[EXPERT_DIMS]._flatten("dp")
        return mesh
    if dims.dp_shard is None:
        return init_device_mesh(device_type, dims.grid, mesh_dim_names=("pp", "dp", "tp"))
    shape = (pp, dims.dp_replicate, dims.dp_shard, tp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", *HYBRID_DIMS, "tp"))
    mesh[HYBRID_DIMS]._flatten("dp")
    return mesh


def sharding_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards a stage over: dp, or HSDP's 2-D (replicate, shard) mesh."""
    if HYBRID_DIMS[1] in (mesh.mesh_dim_names or ()):
        return mesh[HYBRID_DIMS]
    return mesh["dp"]
