"""The ledger the run measures: every collective a rank issues in one training step (kind, mesh
axis, calls, bytes) and the bytes it holds (parameters, gradients, optimizer state: its local
shards, exactly). The plan predicts the same ledger (planner.evaluate.ledger); tests compare
the two, so a technique the executor skips or runs differently from the plan shows up even
where losses cannot tell (tensor parallelism, ZeRO 0/1/2 and sequence parallelism give the
same numbers as a single process).

Collectives are recorded below every library that issues them: a TorchDispatchMode sees the
c10d ops (FSDP2, pipelining's send/recv, plain torch.distributed calls) and the functional
collectives (DTensor, parallel styles, loss_parallel) as they reach the dispatcher, with their
tensors and process group. Bytes follow the cost model's convention (planner.cost.model): the
logical size of the collective: an all-reduce's tensor, an all-gather's gathered output, a
reduce-scatter's unreduced input, an all-to-all's input, a point-to-point message.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from executor.optim import state_bytes
from executor.zero1 import local_of

# op name -> (ledger kind, the argument whose bytes are the collective's size)
C10D = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_": ("all_gather", "output_tensors"),
    "allgather_coalesced_": ("all_gather", "output_lists"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "alltoall_base_": ("all_to_all", "input"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "send": ("send", "tensors"),
    "recv_": ("recv", "tensors"),
    "recv_any_source_": ("recv", "tensors"),
    "broadcast_": ("broadcast", "tensors"),
    "reduce_": ("reduce", "tensors"),
    "gather_": ("gather", "output_tensors"),
    "scatter_": ("scatter", "input_tensors"),
    "barrier": ("barrier", None),
}
FUNCTIONAL = {
    "all_reduce": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce", "inputs"),
    "all_gather_into_tensor": ("all_gather", "input"),  # x group_size
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs"),  # x group_size
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "all_to_all_single": ("all_to_all", "input"),
    "broadcast": ("broadcast", "input"),
}


AXIS_PRIORITY = ("tp", "cp", "dp_shard", "dp_replicate", "dp_replicas", "dp", "pp")


def _tensors(value) -> list[torch.Tensor]:
    """The tensors of an op argument (a tensor, or lists of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def group_axes(mesh, tied_group=None) -> dict[str, str]:
    """Process-group name -> the mesh axis it is (pp, dp, tp, and where the mesh has them
    dp_replicate, dp_shard, dp_replicas, cp); the default group is "world"."""
    out: dict[str, str] = {}
    names = set(mesh.mesh_dim_names or ()) | {"dp"}
    # One group can be two axes (dp is cp when each replica is one cp group); the first
    # named here wins, and the plan's ledger names it the same way (planner.evaluate.ledger).
    for name in AXIS_PRIORITY:
        if name not in names:
            continue
        sub = mesh[name]
        if sub.size() > 1:
            out.setdefault(sub.get_group().group_name, name)
    if tied_group is not None:  # first and last stage's copies of tied embeddings
        out.setdefault(tied_group.group_name, "tied")
    out.setdefault(dist.group.WORLD.group_name, "world")
    return out


class CollectiveRecorder(TorchDispatchMode):
    """Counts the collectives issued while active: {(kind, axis): [calls, bytes]}. Groups
    `axes` does not name are recorded as "group:<name>"."""

    def __init__(self, axes: dict[str, str]):
        super().__init__()
        self.axes = axes
        self.entries: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        # AUTOPAR_LEDGER_TRACE=1: every call in order, in the step's record (for debugging
        # a ledger that does not match)
        self.trace: list | None = [] if os.environ.get("AUTOPAR_LEDGER_TRACE") else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            # a wrapper subclass (DTensor, torchao's float8): let it run and desugar into the
            # collectives it issues, which then come here (modes otherwise run before it).
            # FakeTensor (DTensor's sharding propagation) is no wrapper: it runs here.
            return NotImplemented
        kwargs = kwargs or {}
        ns = func.namespace
        table = C10D if ns == "c10d" else FUNCTIONAL if ns == "_c10d_functional" else None
        if table is not None:
            name = func._schema.name.split("::", 1)[1]
            if name in table:
                self._record(func, table[name], args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func, spec, args, kwargs) -> None:
        kind, field = spec
        bound = {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)}
        bound.update(kwargs)
        nbytes = _nbytes(bound.get(field)) if field else 0
        if "group_size" in bound and kind == "all_gather":
            nbytes *= int(bound["group_size"])
        group = bound.get("process_group", bound.get("group_name"))
        axis = self._axis(group)
        self.entries[(kind, axis)][0] += 1
        self.entries[(kind, axis)][1] += nbytes
        if self.trace is not None:
            shapes = [tuple(t.shape) for t in _tensors(bound.get(field))]
            self.trace.append((kind, axis, nbytes, func._schema.name, str(shapes)))

    def _axis(self, group) -> str:
        name = group if isinstance(group, str) else dist.ProcessGroup.unbox(group).group_name
        return self.axes.get(name, f"group:{name}")

    def comm(self) -> list[dict]:
        return [
            {"kind": kind, "axis": axis, "calls": calls, "bytes": nbytes}
            for (kind, axis), (calls, nbytes) in sorted(self.entries.items())
        ]


def held_bytes(parameters: list[torch.nn.Parameter], optimizer) -> dict[str, int]:
    """The bytes this rank holds of parameters, their gradients and the optimizer's state:
    local shards of DTensors, each tensor counted once (tied parameters are one)."""
    seen: set[int] = set()
    params = grads = 0
    for p in parameters:
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = local_of(p)
        params += local.numel() * local.element_size()
        if p.grad is not None:
            g = local_of(p.grad)
            grads += g.numel() * g.element_size()
    return {"params": params, "grads": grads, "optimizer": state_bytes(optimizer)}
