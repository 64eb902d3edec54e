"""Data parallelism on the dp axis, as the plan's ZeRO level says.

- ZeRO-0 (DDP): FSDP2's `replicate` — every dp rank holds whole parameters, gradients and
  optimizer state; gradients are all-reduced.
- ZeRO-1/2: FSDP2 `fully_shard` keeping parameters unsharded from forward to backward
  (`reshard_after_forward=False`): gradients are reduce-scattered and the optimizer state is
  sharded over dp. ZeRO-1 runs as ZeRO-2 (sharding gradients too costs no extra
  communication: reduce-scatter + all-gather move what an all-reduce moves).
- ZeRO-3: `fully_shard` resharding parameters after forward (gathered again for backward).
"""

from __future__ import annotations

from torch import nn


def apply_data_parallel(stage: nn.Module, dp_mesh, zero: int) -> None:
    if dp_mesh.size() == 1:
        return
    if zero == 0:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for block in stage.owned_blocks().values():
            replicate(block, mesh=dp_mesh)
        replicate(stage, mesh=dp_mesh)
        return
    from torch.distributed.fsdp import fully_shard

    reshard = zero == 3
    for block in stage.owned_blocks().values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard)
