"""Sharded checkpoints with torch.distributed.checkpoint: every rank writes its own shards of
its stages' parameters and optimizer state; `latest` names the newest complete step."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from executor.zero1 import ShardedOptimizer, checkpoint_state


def _optim_key(container: nn.Module) -> str:
    """Optimizer state is keyed by the stages a rank holds: the stages' parameter groups
    differ, and DCP keeps one copy per key (replicas of a stage share theirs)."""
    return "optim_" + "_".join(sorted(container.keys()))


def _state(container: nn.Module, optimizer) -> dict:
    if isinstance(optimizer, ShardedOptimizer):  # ZeRO-1: its master shards, rank by rank
        model_sd = get_model_state_dict(container)
        return {"model": model_sd, _optim_key(container): checkpoint_state(optimizer)}
    model_sd, optim_sd = get_state_dict(container, optimizer)
    return {"model": model_sd, _optim_key(container): optim_sd}


def save(directory: str | Path, step: int, container: nn.Module, optimizer) -> Path:
    """Collective: every rank calls it after `step` steps."""
    path = Path(directory) / f"step_{step}"
    dcp.save(_state(container, optimizer), checkpoint_id=str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(directory) / "latest").write_text(str(step))
    dist.barrier()
    return path


def latest_step(directory: str | Path) -> int | None:
    marker = Path(directory) / "latest"
    return int(marker.read_text()) if marker.exists() else None


def load(directory: str | Path, step: int, container: nn.Module, optimizer) -> None:
    """Collective: restore parameters and optimizer state saved after `step` steps."""
    state = _state(container, optimizer)
    dcp.load(state, checkpoint_id=str(Path(directory) / f"step_{step}"))
    if isinstance(optimizer, ShardedOptimizer):  # its shards were loaded in place
        set_model_state_dict(container, state["model"])
        return
    set_state_dict(
        container,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state[_optim_key(container)],
    )
