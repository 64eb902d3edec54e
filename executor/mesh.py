"""The ("pp", "dp", "tp") DeviceMesh of a plan (ranks in the plan's mesh order). Under HSDP
(the plan's mesh.dp_shard) dp is two dims, ("dp_replicate", "dp_shard"), flattened into "dp"
for everything but FSDP2, which shards on the inner one and replicates across the outer.
Under context parallelism (mesh.cp) dp is ("dp_replicas", "cp"), flattened into "dp" too: the
"cp" groups split each sample's sequence (executor.context_parallel). Under expert parallelism
(mesh.ep) dp is ("edp", "ep"): the "ep" groups split the experts (executor.expert_parallel),
"edp" holds the ranks with the same experts; with both, dp x cp is split both ways
(_context_and_expert_mesh)."""

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
    if dims.cp > 1 and dims.ep > 1:
        return _context_and_expert_mesh(dims, device_type)
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


def _context_and_expert_mesh(dims, device_type: str) -> DeviceMesh:
    """Context and expert parallelism together: the dp x cp ranks (cp innermost) split two
    ways, into ("dp_replicas", "cp") and into ("edp", "ep"), ep groups being whole cp groups
    or parts of one (planner.parallel.expert.mesh_refusal). One mesh holds both: the middle
    axis as three dims, the outer, the one both share, and the inner, flattened in pairs."""
    pp, tp, dp, cp, ep = dims.pp, dims.tp, dims.dp, dims.cp, dims.ep
    if ep <= cp:  # ep groups inside a cp group: (dp_replicas, cp / ep, ep)
        names = ("dp_replicas", "cp_groups", "ep")
        shape = (pp, dp, cp // ep, ep, tp)
        pairs = {"cp": ("cp_groups", "ep"), "edp": ("dp_replicas", "cp_groups")}
    else:  # whole cp groups in each ep group: (edp, ep / cp, cp)
        names = ("edp", "ep_groups", "cp")
        shape = (pp, dp * cp // ep, ep // cp, cp, tp)
        pairs = {"ep": ("ep_groups", "cp"), "dp_replicas": ("edp", "ep_groups")}
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", *names, "tp"))
    for name, dims_ in pairs.items():
        mesh[dims_]._flatten(name)
    mesh[names]._flatten("dp")
    return mesh


def sharding_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards a stage over: dp, or HSDP's 2-D (replicate, shard) mesh."""
    if HYBRID_DIMS[1] in (mesh.mesh_dim_names or ()):
        return mesh[HYBRID_DIMS]
    return mesh["dp"]
