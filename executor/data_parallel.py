"""Data parallelism on the dp axis, as the plan's ZeRO level says.

- ZeRO-0 (DDP): FSDP2's `replicate` — every dp rank holds whole parameters, gradients and
  optimizer state; gradients are all-reduced.
- ZeRO-1: no data-parallel wrapper; whole parameters and gradients, and executor.zero1's
  optimizer reduce-scatters the gradients, steps its shard and all-gathers the parameters.
- ZeRO-2: FSDP2 `fully_shard` keeping parameters unsharded from forward to backward
  (`reshard_after_forward=False`): gradients are reduce-scattered and the optimizer state is
  sharded over dp.
- ZeRO-3: `fully_shard` resharding parameters after forward (gathered again for backward).
- Layer-wise ZeRO (the plan's stages[].resharded_layers k, with ZeRO-3): the stage's first
  k blocks as ZeRO-3, the others as ZeRO-2 (`reshard_after_forward=False`; during gradient
  accumulation executor.training.accumulate keeps them gathered and unreduced until the last
  micro-batch); the stage's other parameters as ZeRO-3.
- CPU offload (the plan's stages[].cpu_offload, ZeRO-3): FSDP2's CPUOffloadPolicy keeps the
  shards of parameters, gradients and optimizer state in host memory; the optimizer steps
  there.
- HSDP (the plan's mesh.dp_shard): `fully_shard` on the 2-D (replicate, shard) mesh
  (executor.mesh.sharding_mesh): sharded within a group, gradients all-reduced across them.

Precision: a bf16/fp16 plan computes with its parameters cast by FSDP2's
MixedPrecisionPolicy (as torchtitan does) and reduces gradients in fp32: `fully_shard` at
ZeRO 2-3, `replicate` at ZeRO-0, and `fully_shard` on the one rank where there is no data
parallelism or where executor.zero1 reduces over dp (ZeRO-1: on the mesh's one-rank dim,
executor.mesh.own_mesh; a cast, no collective, the gradients accumulated in fp32), so the
residual stream, the tp collectives and the pipeline's messages are in the compute dtype, as
the plan prices them from its trace; the fp32 parameters (or shards) are the master weights
(Megatron-LM's distributed optimizer has the same shape: compute-dtype weights, fp32 main
gradients, fp32 master shards).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from executor.errors import ExecutionError
from executor.precision import COMPUTE_DTYPES


def offloaded_modules(stage: nn.Module) -> int:
    """How many of the stage's FSDP2 modules hold their shards under CPUOffloadPolicy, read
    back from FSDP2's own state (torch 2.13 has no public getter): what the run reports."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    count = 0
    for module in stage.modules():
        if isinstance(module, FSDPModule):
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            count += isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy)
    return count


def apply_data_parallel(
    stage: nn.Module,
    dp_mesh,
    zero: int,
    dtype: str,
    cpu_offload: bool = False,
    experts: list[nn.Module] | None = None,
    edp_mesh=None,
    resharded_layers: int | None = None,
    own_mesh=None,
) -> None:
    """`experts`: under expert parallelism the stage's expert modules, whose weights differ
    across the ep ranks: wrapped on their own over `edp_mesh`, the ranks holding the same
    experts (apply_expert_data_parallel), and left out of the dense units.
    `resharded_layers`: layer-wise ZeRO's count of first blocks at ZeRO-3 (None: all).
    `own_mesh`: the mesh's one-rank dim (executor.mesh.own_mesh), needed for ZeRO-1 over
    dp > 1 in bf16/fp16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    compute = COMPUTE_DTYPES[dtype]
    # Only parameters are cast (not module inputs): what the reference does
    # (executor.reference), and the activations are already in the compute dtype.
    policy = MixedPrecisionPolicy(
        param_dtype=compute, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    one = dp_mesh if dp_mesh.size() == 1 else own_mesh if zero == 1 else None
    if one is not None:
        if compute is not None:  # FSDP2 on one rank: the cast alone, no collective
            if one.size() != 1:
                raise ExecutionError(f"mesh: a one-rank dim for the cast, got {one.size()}")
            for block in stage.owned_blocks().values():
                fully_shard(block, mesh=one, reshard_after_forward=False, mp_policy=policy)
            fully_shard(stage, mesh=one, reshard_after_forward=False, mp_policy=policy)
        return
    if zero == 1:
        if compute is not None:
            raise ExecutionError("mesh: ZeRO-1 in bf16/fp16 needs the mesh's one-rank dim")
        return  # ZeRO-1 in fp32: executor.zero1 steps the whole parameters
    if zero == 0:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        wrap = partial(replicate, mp_policy=policy)
        ignored = apply_expert_data_parallel(experts or [], edp_mesh, dp_mesh.size(), wrap)
        for block in stage.owned_blocks().values():
            wrap(block, mesh=dp_mesh, ignored_params=ignored)
        wrap(stage, mesh=dp_mesh, ignored_params=ignored)
        return
    reshard = zero == 3
    options: dict = {"reshard_after_forward": reshard, "mp_policy": policy}
    if cpu_offload:  # ZeRO-3's shards on the host; pinned pages where a GPU copies them
        from torch.distributed.fsdp import CPUOffloadPolicy

        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    wrap = partial(fully_shard, **options)
    ignored = apply_expert_data_parallel(experts or [], edp_mesh, dp_mesh.size(), wrap, True)
    for i, block in enumerate(stage.owned_blocks().values()):
        kept = resharded_layers is not None and i >= resharded_layers
        own = {**options, "reshard_after_forward": False} if kept else options
        fully_shard(block, mesh=dp_mesh, ignored_params=ignored, **own)
    fully_shard(stage, mesh=dp_mesh, ignored_params=ignored, **options)


def kept_blocks(stage: nn.Module, resharded_layers: int | None) -> list[nn.Module]:
    """Layer-wise ZeRO's ZeRO-2 blocks of a stage (apply_data_parallel): those after its
    first `resharded_layers`; none without it."""
    if resharded_layers is None:
        return []
    return list(stage.owned_blocks().values())[resharded_layers:]


def apply_expert_data_parallel(
    experts: list[nn.Module], edp_mesh, dp: int, wrap: Callable, sharded: bool = False
) -> set[nn.Parameter]:
    """Each expert module wrapped by `wrap` (the dense units' FSDP2 `replicate` or
    `fully_shard`, `sharded`) over the expert-data-parallel mesh, its gradients divided by all of dp
    (each rank's are the sum of its ep group's micro-batch means). Where that mesh is one
    rank there is nothing to synchronise: the weights are returned, for the dense units to
    leave out, and executor.training divides their gradients (unsynced_experts)."""
    if not experts:
        return set()
    if edp_mesh is None or edp_mesh.size() == 1:
        return {p for module in experts for p in module.parameters()}
    for module in experts:
        wrap(module, mesh=edp_mesh)
        module.set_gradient_divide_factor(float(dp))
        if sharded:  # a sum, then the division: a reduce-scatter by a factor other than
            # the group's size is otherwise NCCL's PREMUL_SUM, which gloo has not
            module.set_force_sum_reduction_for_comms(True)
    return set()


def unsynced_experts(experts: list[nn.Module], edp_mesh) -> list[nn.Parameter]:
    """The expert weights no data-parallel wrapper synchronises (apply_expert_data_parallel)."""
    if edp_mesh is not None and edp_mesh.size() > 1:
        return []
    return [p for module in experts for p in module.parameters()]
