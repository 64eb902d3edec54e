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


def _state(container: nn.Module, optimizer, slices: dict[str, str] | None = None) -> dict:
    if isinstance(optimizer, ShardedOptimizer):  # ZeRO-1: its master shards, rank by rank
        model_sd = _renamed(get_model_state_dict(container), slices)
        return {"model": model_sd, _optim_key(container): checkpoint_state(optimizer)}
    model_sd, optim_sd = get_state_dict(container, optimizer)
    return {"model": _renamed(model_sd, slices), _optim_key(container): _renamed(optim_sd, slices)}


def expert_slices(container: nn.Module, parallel, ep_rank: int, tp_rank: int) -> dict[str, str]:
    """Each expert weight's state-dict name -> the same with the slice this rank holds
    ("...gate_up_proj@ep1", "@tp0"): under expert parallelism (and expert tensor
    parallelism) ranks hold different values under one name, which DCP would keep once and
    give every rank back (a resumed run silently training other experts' weights)."""
    ep = {id(m) for m in parallel.experts} if parallel.ep > 1 else set()
    split = {id(m) for m in parallel.split_experts}
    out = {}
    for prefix, module in container.named_modules():
        if id(module) not in ep | split:
            continue
        tag = (f"@ep{ep_rank}" if id(module) in ep else "") + (
            f"@tp{tp_rank}" if id(module) in split else ""
        )
        for name, _ in module.named_parameters(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            out[key] = key + tag
    return out


def _renamed(state, names: dict[str, str] | None):
    """`state` (a model or optimizer state dict, nested) with the keys and parameter names in
    `names` replaced."""
    if not names:
        return state
    if isinstance(state, dict):
        return {names.get(k, k): _renamed(v, names) for k, v in state.items()}
    if isinstance(state, list):
        return [_renamed(v, names) for v in state]
    return names.get(state, state) if isinstance(state, str) else state


def save(
    directory: str | Path,
    step: int,
    container: nn.Module,
    optimizer,
    slices: dict[str, str] | None = None,
) -> Path:
    """Collective: every rank calls it after `step` steps. `slices`: expert_slices."""
    path = Path(directory) / f"step_{step}"
    dcp.save(_state(container, optimizer, slices), checkpoint_id=str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(directory) / "latest").write_text(str(step))
    dist.barrier()
    return path


def latest_step(directory: str | Path) -> int | None:
    marker = Path(directory) / "latest"
    return int(marker.read_text()) if marker.exists() else None


def load(
    directory: str | Path,
    step: int,
    container: nn.Module,
    optimizer,
    slices: dict[str, str] | None = None,
) -> None:
    """Collective: restore parameters and optimizer state saved after `step` steps."""
    state = _state(container, optimizer, slices)
    dcp.load(state, checkpoint_id=str(Path(directory) / f"step_{step}"))
    back = {v: k for k, v in (slices or {}).items()}
    model = _renamed(state["model"], back)
    if isinstance(optimizer, ShardedOptimizer):  # its shards were loaded in place
        set_model_state_dict(container, model)
        return
    optim = _renamed(state[_optim_key(container)], back)
    set_state_dict(container, optimizer, model_state_dict=model, optim_state_dict=optim)
