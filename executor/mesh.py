"""The ("pp", "dp", "tp") DeviceMesh of a plan (ranks in the plan's mesh order). Under HSDP
(the plan's mesh.dp_shard) dp is two dims, ("dp_replicate", "dp_shard"), flattened into "dp"
for everything but FSDP2, which shards on the inner one and replicates across the outer.
Under context parallelism (mesh.cp) dp is ("dp_replicas", "cp"), flattened into "dp" too: the
"cp" groups split each sample's sequence (executor.context_parallel). Under expert parallelism
(mesh.ep) dp is ("edp", "ep"): the "ep" groups split the experts (executor.expert_parallel),
"edp" holds the ranks with the same experts; with both, dp x cp is split both ways
(_context_and_expert_mesh). With expert tp 1 (mesh.etp, ParallelDims.folded) the ep groups
are whole tp groups of ep / tp neighbouring dp ranks: ("edp", "ep_groups", "tp"), "ep"
flattened from the inner two, "dp" from the outer two.
Where a stage runs ZeRO-1 over dp > 1 in bf16/fp16, the mesh ends in a one-rank dim, "own":
FSDP2 on it casts the stage's parameters for compute, as on every other stage
(executor.data_parallel), and FSDP2 over tp-split parameters needs its mesh and theirs cut
from one root mesh."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from executor.errors import ExecutionError
from planner.plan import Plan

HYBRID_DIMS = ("dp_replicate", "dp_shard")
CONTEXT_DIMS = ("dp_replicas", "cp")  # dp under context parallelism: replicas x cp
EXPERT_DIMS = ("edp", "ep")  # dp under expert parallelism: expert-data-parallel x ep
OWN = "own"  # the one-rank dim (the module docstring)


def needs_own_dim(plan: Plan) -> bool:
    """Whether a stage casts its parameters by FSDP2 on a one-rank mesh while executor.zero1
    shards its optimizer over dp (executor.data_parallel.apply_data_parallel)."""
    from executor.precision import cast_parameters_dtype

    if cast_parameters_dtype(plan) is None:  # fp32, or graph mode (autocast)
        return False
    return any(st.zero == 1 and plan.mesh.stage_shape(st.index)[0] > 1 for st in plan.stages)


def _init(device_type: str, shape: tuple, names: tuple, own: bool) -> DeviceMesh:
    if own:
        shape, names = (*shape, 1), (*names, OWN)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def build_mesh(plan: Plan, device_type: str = "cpu") -> DeviceMesh:
    dims = plan.mesh.dims  # planner.parallel_dims: the degrees, world = pp x dp x cp x tp
    pp, tp = dims.pp, dims.tp
    world = dist.get_world_size()
    if dims.world != world:
        raise ExecutionError(
            f"mesh: the plan needs pp x dp x cp x tp = {dims.world} processes, {world} were started"
        )
    own = needs_own_dim(plan)
    if dims.cp > 1 and dims.folded:
        return _context_and_folded_expert_mesh(dims, device_type, own)
    if dims.cp > 1 and dims.ep > 1:
        return _context_and_expert_mesh(dims, device_type, own)
    if dims.cp > 1:  # context parallelism: groups of cp neighbouring ranks, flattened into dp
        shape = (pp, dims.dp, dims.cp, tp)
        mesh = _init(device_type, shape, ("pp", *CONTEXT_DIMS, "tp"), own)
        mesh[CONTEXT_DIMS]._flatten("dp")
        return mesh
    if dims.folded:  # ep groups of whole tp groups: ep / tp neighbouring dp ranks' each
        shape = (pp, dims.dp * tp // dims.ep, dims.ep // tp, tp)
        mesh = _init(device_type, shape, ("pp", "edp", "ep_groups", "tp"), own)
        mesh[("ep_groups", "tp")]._flatten("ep")
        mesh[("edp", "ep_groups")]._flatten("dp")
        return mesh
    if dims.ep > 1:  # expert parallelism: groups of ep neighbouring ranks, flattened into dp
        shape = (pp, dims.dp // dims.ep, dims.ep, tp)
        mesh = _init(device_type, shape, ("pp", *EXPERT_DIMS, "tp"), own)
        mesh[EXPERT_DIMS]._flatten("dp")
        return mesh
    if dims.dp_shard is None:
        return _init(device_type, dims.grid, ("pp", "dp", "tp"), own)
    shape = (pp, dims.dp_replicate, dims.dp_shard, tp)
    mesh = _init(device_type, shape, ("pp", *HYBRID_DIMS, "tp"), own)
    mesh[HYBRID_DIMS]._flatten("dp")
    return mesh


def _context_and_expert_mesh(dims, device_type: str, own: bool) -> DeviceMesh:
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
    mesh = _init(device_type, shape, ("pp", *names, "tp"), own)
    for name, dims_ in pairs.items():
        mesh[dims_]._flatten(name)
    mesh[names]._flatten("dp")
    return mesh


def _context_and_folded_expert_mesh(dims, device_type: str, own: bool) -> DeviceMesh:
    """Context parallelism with expert tp 1: the ep groups, whole tp groups, drawn from the
    dp x cp x tp ranks (tp innermost, then cp), g = ep / tp of them nested with the cp
    groups as _context_and_expert_mesh nests ep's."""
    pp, tp, dp, cp, g = dims.pp, dims.tp, dims.dp, dims.cp, dims.ep // dims.tp
    if g <= cp:  # ep groups inside a cp group: (dp_replicas, cp / g, g, tp)
        names = ("dp_replicas", "cp_groups", "ep_cp", "tp")
        shape = (pp, dp, cp // g, g, tp)
        pairs = {
            "ep": ("ep_cp", "tp"),
            "cp": ("cp_groups", "ep_cp"),
            "edp": ("dp_replicas", "cp_groups"),
            "dp": ("dp_replicas", "cp_groups", "ep_cp"),
        }
    else:  # whole cp groups in each ep group: (edp, g / cp, cp, tp)
        names = ("edp", "ep_groups", "cp", "tp")
        shape = (pp, dp * cp // g, g // cp, cp, tp)
        pairs = {
            "ep": ("ep_groups", "cp", "tp"),
            "dp_replicas": ("edp", "ep_groups"),
            "dp": ("edp", "ep_groups", "cp"),
        }
    mesh = _init(device_type, shape, ("pp", *names), own)
    for name, dims_ in pairs.items():
        mesh[dims_]._flatten(name)
    return mesh


def sharding_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards a stage over: dp, or HSDP's 2-D (replicate, shard) mesh."""
    if HYBRID_DIMS[1] in (mesh.mesh_dim_names or ()):
        return mesh[HYBRID_DIMS]
    return mesh["dp"]


def own_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh's one-rank dim, where it has one (needs_own_dim)."""
    return mesh[OWN] if OWN in (mesh.mesh_dim_names or ()) else None
