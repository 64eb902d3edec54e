"""Data parallelism on the dp axis with FSDP2, for every ZeRO level.

ZeRO-3 reshards parameters after forward; levels 0-2 keep them unsharded between forward and
backward (numerically the same step; the memory of ZeRO-0/1 is what the plan predicts, not
what this run uses)."""

from __future__ import annotations

from torch import nn


def apply_data_parallel(stage: nn.Module, dp_mesh, zero: int) -> None:
    if dp_mesh.size() == 1:
        return
    from torch.distributed.fsdp import fully_shard

    reshard = zero == 3
    for block in getattr(stage, stage.block_attr).values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard)
