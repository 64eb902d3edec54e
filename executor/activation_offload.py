"""Activation offload (planner.parallel.activation_offload): each block's forward runs under
torch's saved-tensor hooks that copy what autograd saves to host memory and bring it back
when backward unpacks it, as torch.autograd.graph.save_on_cpu does; parameters (FSDP2's
unsharded ones too) are left where they are, so only activations travel. Pinned host
buffers where CUDA is present (the copies then run without a host sync). On a CPU the copy
back is a copy too, as on a GPU, so the run holds what the plan prices."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from executor.ledger import mark_host


class _ToHost(torch.autograd.graph.saved_tensors_hooks):
    """Pack: a host copy of a saved activation (parameters as they are); unpack: back on
    the device it came from. Counts what it moved (the executor reports it)."""

    def __init__(self, counter: list[int], pin: bool):
        def to_host(t: torch.Tensor) -> torch.Tensor:
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            mark_host(host)
            counter[0] += t.numel() * t.element_size()
            return host

        def pack(t: torch.Tensor):
            base = t if t._base is None else t._base  # a matmul saves its weight's transpose
            if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
                return ("keep", t)
            if isinstance(t, DTensor):  # tensor parallelism: this rank's shard travels
                with torch.no_grad():
                    local = t.to_local()
                where = (local.device, t.device_mesh, t.placements, t.shape, t.stride())
                return ("dtensor", (where, to_host(local)))
            return ("tensor", (t.device, to_host(t)))

        def unpack(packed) -> torch.Tensor:
            kind, value = packed
            if kind == "keep":
                return value
            if kind == "tensor":
                device, host = value
                return host.to(device, non_blocking=pin, copy=True)
            (device, mesh, placements, shape, stride), host = value
            local = host.to(device, non_blocking=pin, copy=True)
            with torch.no_grad():
                return DTensor.from_local(
                    local, mesh, placements, run_check=False, shape=shape, stride=stride
                )

        super().__init__(pack, unpack)


def apply_activation_offload(stage: nn.Module) -> list[int]:
    """Offload the activations of every block the stage owns; returns a one-element counter
    of the bytes copied to the host so far."""
    counter = [0]
    pin = torch.cuda.is_available()
    for block in stage.owned_blocks().values():
        active: list[_ToHost] = []

        def enter(_module, _args, active=active) -> None:
            hooks = _ToHost(counter, pin)
            hooks.__enter__()
            active.append(hooks)

        def leave(_module, _args, _output, active=active) -> None:
            active.pop().__exit__(None, None, None)

        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
    return counter
