"""The ledger the run measures: every collective a rank issues in one training step (kind, mesh
axis, calls, bytes), the bytes it holds (parameters, gradients, optimizer state: its local
shards, exactly) and its activation peak (LiveBytes). The plan predicts the same ledger
(planner.evaluate.ledger); tests compare the two, so a technique the executor skips or runs
differently from the plan shows up even where losses cannot tell (tensor parallelism, ZeRO
0/1/2 and sequence parallelism give the same numbers as a single process).

Collectives are recorded below every library that issues them: a TorchDispatchMode sees the
c10d ops (FSDP2, pipelining's send/recv, plain torch.distributed calls) and the functional
collectives (DTensor, parallel styles, loss_parallel) as they reach the dispatcher, with their
tensors and process group. Bytes follow the cost model's convention (planner.cost.model): the
logical size of the collective: an all-reduce's tensor, an all-gather's gathered output, a
reduce-scatter's unreduced input, an all-to-all's input, a point-to-point message.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)

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


SUMS = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)
# FSDP2's copy of a unit's unsharded gradients into its reduce-scatter buffer
FSDP_GRADIENTS_IN = "chunk_cat"  # fsdp::chunk_cat
# Ops whose output is a weight's gradient whatever follows (under tensor parallelism an
# embedding's is made whole and its shard copied out before it reaches the parameter)
WEIGHT_GRADIENTS = (torch.ops.aten.embedding_dense_backward.default,)
DP_AXES = frozenset({"dp", "dp_shard", "dp_replicate", "dp_replicas", "edp"})
AXIS_PRIORITY = ("tp", "cp", "ep", "dp_shard", "dp_replicate", "dp_replicas", "edp", "dp", "pp")


def _tensors(value) -> list[torch.Tensor]:
    """The tensors of an op argument (a tensor, or lists of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def collective(func, args, kwargs) -> tuple[tuple[str, str | None], dict] | None:
    """A c10d or functional collective's (ledger kind, size argument) and its arguments by
    name; None for any other op."""
    ns = func.namespace
    table = C10D if ns == "c10d" else FUNCTIONAL if ns == "_c10d_functional" else None
    spec = table.get(func._schema.name.split("::", 1)[1]) if table is not None else None
    if spec is None:
        return None
    bound = {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)}
    return spec, {**bound, **kwargs}


def group_name(bound: dict) -> str:
    """The process group a collective's arguments name."""
    group = bound.get("process_group", bound.get("group_name"))
    return group if isinstance(group, str) else dist.ProcessGroup.unbox(group).group_name


def _axes_of(mesh) -> set[str]:
    """The axes the mesh has, its dims and those flattened from them (executor.mesh: "dp",
    and "cp", "ep", "edp" or "dp_replicas" where context and expert parallelism split dp x cp
    both ways)."""
    out = set()
    for name in AXIS_PRIORITY:
        try:
            mesh[name]
        except (KeyError, RuntimeError, ValueError):
            continue
        out.add(name)
    return out


def group_axes(mesh, tied_group=None) -> dict[str, str]:
    """Process-group name -> the mesh axis it is (pp, dp, tp, and where the mesh has them
    dp_replicate, dp_shard, dp_replicas, cp, ep, edp); the default group is "world"."""
    out: dict[str, str] = {}
    names = _axes_of(mesh)
    # One group can be two axes (dp is cp when each replica is one cp group); the first
    # named here wins, and the plan's ledger names it the same way (planner.evaluate.ledger).
    world = dist.get_world_size()
    for name in AXIS_PRIORITY:
        if name not in names:
            continue
        sub = mesh[name]
        if sub.size() > 1:
            out.setdefault(sub.get_group().group_name, name)
        if sub.size() == world > 1:
            # the default group is that axis too: torch 2.13's DeviceMesh reuses it for an
            # axis spanning every rank, 2.11's (seen on the H200) makes a group of its own,
            # and a collective on either is the same exchange (planner.evaluate.ledger's
            # world_axis)
            out.setdefault(dist.group.WORLD.group_name, name)
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
        found = collective(func, args, kwargs)
        if found is not None:
            self._record(func, *found)
        return func(*args, **kwargs)

    def _record(self, func, spec, bound: dict) -> None:
        kind, field = spec
        nbytes = _nbytes(bound.get(field)) if field else 0
        if "group_size" in bound and kind == "all_gather":
            nbytes *= int(bound["group_size"])
        name = group_name(bound)
        axis = self.axes.get(name, f"group:{name}")
        self.entries[(kind, axis)][0] += 1
        self.entries[(kind, axis)][1] += nbytes
        if self.trace is not None:
            shapes = [tuple(t.shape) for t in _tensors(bound.get(field))]
            self.trace.append((kind, axis, nbytes, func._schema.name, str(shapes)))

    def comm(self) -> list[dict]:
        return [
            {"kind": kind, "axis": axis, "calls": calls, "bytes": nbytes}
            for (kind, axis), (calls, nbytes) in sorted(self.entries.items())
        ]


def held_bytes(parameters: list[torch.nn.Parameter], optimizer) -> dict[str, int]:
    """The bytes this rank holds of parameters, their gradients and the optimizer's state
    (with ZeRO-1's fp32 master shards, the copies executor.zero1 steps): local shards of
    DTensors, each tensor counted once (tied parameters are one)."""
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
    masters = sum(m.numel() * m.element_size() for m in getattr(optimizer, "masters", ()))
    return {"params": params, "grads": grads, "optimizer": state_bytes(optimizer) + masters}


def mark_host(t: torch.Tensor) -> None:
    """`t` lives in host memory (activation offload's copies): no device activation, for
    every activation peak being measured (on a CPU host and device memory are one)."""
    for mode in _MEASURING:
        if _key(t) in mode.live:
            mode.host.add(mode.live[_key(t)][0])


class LiveBytes(TorchDispatchMode):
    """The activation peak: the most bytes held at once, while active, by the storages the
    ops it sees allocate (an op's outputs that alias none of its inputs, each counted until
    it is freed, followed by weak reference), less parameter state: gradients (reported by
    post-accumulate hooks on the parameters and on FSDP2's gathered ones, with the tensors
    summed into them: a micro-batch's gradient added to the accumulated one, a tied weight's
    two uses) and what dp's collectives and FSDP2's copies touch (gathered parameters,
    gradient buffers). What is left is what the plan's activation term predicts (bytes saved
    for backward across the in-flight micro-batches, what checkpointing keeps and rebuilds,
    the stage outputs pipelining keeps, the loss's buffers) plus the transients between
    ops. A CPU measure: storages resized in place (FSDP2 frees a gathered parameter so) are
    not followed; on CUDA the caching allocator's peak is the run's memory."""

    def __init__(self, parameters: list[torch.nn.Parameter], axes: dict[str, str]):
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (serial, +bytes or -bytes) in order
        self.live: dict[int, tuple[int, int]] = {}  # storage address -> (serial, bytes)
        # A collective's buffers are released by the last holder, often gloo's worker thread
        # a moment after the wait returns, at a point that varies from run to run. A storage
        # freed on another thread is taken as freed right after its last use here:
        # storage address -> len(events) once an op here that took it had made its outputs;
        # and the frees so placed, as (that length, serial, -bytes).
        self.thread = threading.get_ident()
        self.last_use: dict[int, int] = {}
        self.placed: list[tuple[int, int, int]] = []
        self.state: set[int] = set()  # serials of gradients and of dp's message buffers
        # serials of the gradients alone: those the parameters report, what was summed into
        # them, and copies made from gradients only (FSDP2's fp32 accumulated gradient)
        self.gradients: set[int] = set()
        self.host: set[int] = set()  # serials of host copies (mark_host)
        # serial -> the serials summed into it (each micro-batch's gradient added to the
        # accumulated one, the two uses of a tied weight): gradients with it, if it is one
        self.summed: dict[int, list[int]] = {}
        self.axes = axes
        self.hooked: set[int] = set()
        self.hooks: list = []
        self.parameters = parameters
        # AUTOPAR_LEDGER_TRACE=1: what each storage is (op, shape), for the peak's make-up
        self.made_by: dict | None = {} if os.environ.get("AUTOPAR_LEDGER_TRACE") else None
        for p in parameters:
            self._hook(p)

    def _hook(self, p: torch.Tensor) -> None:
        """Each gradient `p` accumulates is parameter state: the first micro-batch's,
        replaced by its sum with the next, too."""
        if id(p) not in self.hooked and p.requires_grad:
            self.hooked.add(id(p))
            # a pipeline stage's received input is a leaf too: its gradient is an activation's
            weight = isinstance(p, torch.nn.Parameter)
            hook = p.register_post_accumulate_grad_hook(lambda p: self._state([p.grad], weight))
            self.hooks.append(hook)

    def __enter__(self):
        _MEASURING.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _MEASURING.remove(self)
        for hook in self.hooks:
            hook.remove()
        # the gradients as the step's backward leaves them, however they were assigned (a
        # zero-bubble schedule's W pass sets and adds them without autograd's accumulation)
        self._state([p.grad for p in self.parameters if p.grad is not None], True)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a DTensor's local ops come here as it runs them
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = [t for t in _tensors(list(args) + list(kwargs.values())) if _real(t)]
        inputs = {_key(t) for t in given}
        outputs = [t for t in _tensors(out) if _real(t)]
        for t in outputs:
            if _key(t) not in inputs:
                self._track(t.untyped_storage())
                if self.made_by is not None:
                    self.made_by[len(self.events) - 1] = (str(func), tuple(t.shape))
        for key in inputs & self.live.keys():
            self.last_use[key] = len(self.events)
        if func in SUMS:  # a gradient summed into another: both are the parameter's
            operands = [self.live[k][0] for k in inputs if k in self.live]
            for t in outputs:
                if _key(t) in self.live:  # in place (FSDP2's accumulated gradient): each add's
                    serial = self.live[_key(t)][0]
                    self.summed.setdefault(serial, []).extend(o for o in operands if o != serial)
        for t in given:
            if t.is_leaf and t.requires_grad:  # FSDP2's gathered (unsharded) parameters
                self._hook(t)
        if given and all(map(self._is_gradient, given)):  # a copy of gradients (an upcast)
            self._state(outputs, True)
        if func.namespace == "fsdp" and func._opname == FSDP_GRADIENTS_IN:
            # the unsharded gradients FSDP2 reduces, however made (a split backward's W pass
            # assigns them without autograd's accumulation)
            self._state(_tensors(args[0]), True)
        if self._on_dp(func, args, kwargs):  # parameters gathered, gradients reduced
            self._state(given + _tensors(out))
        elif func in WEIGHT_GRADIENTS or (given and all(map(self._is_state, given))):
            # (made from dp's buffers alone: FSDP2 dividing a reduced gradient's copy by a
            # gradient divide factor, executor.data_parallel.apply_expert_data_parallel)
            self._state(outputs)
        return out

    def _is_gradient(self, t: torch.Tensor) -> bool:
        return self._marked(t, self.gradients)

    def _is_state(self, t: torch.Tensor) -> bool:
        return self._marked(t, self.state)

    def _marked(self, t: torch.Tensor, serials: set[int]) -> bool:
        found = self.live.get(_key(t))
        return found is not None and found[0] in serials

    def _on_dp(self, func, args, kwargs) -> bool:
        """A collective on a dp axis, or FSDP2's own copies in and out of its message
        buffers."""
        if func.namespace == "fsdp":
            return True
        found = collective(func, args, kwargs)
        return found is not None and self.axes.get(group_name(found[1])) in DP_AXES

    def _track(self, storage) -> None:
        key = storage._cdata
        if key in self.live or storage.nbytes() == 0:
            return
        serial = len(self.events)
        self.live[key] = (serial, storage.nbytes())
        self.events.append((serial, storage.nbytes()))
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        serial, nbytes = self.live.pop(key, (None, 0))
        used = self.last_use.pop(key, None)
        if serial is None:
            return
        if threading.get_ident() == self.thread:
            self.events.append((serial, -nbytes))
        else:
            self.placed.append((serial + 1 if used is None else used, serial, -nbytes))

    def _state(self, tensors: list[torch.Tensor], gradients: bool = False) -> None:
        """These tensors' storages hold parameter state (gradients, dp's gathered parameters
        and reduced gradients), no activations; `gradients`: they are gradients."""
        for t in tensors:
            t = local_of(t)
            if not (_real(t) and _key(t) in self.live):
                continue
            todo, seen = [self.live[_key(t)][0]], set()
            while todo:
                serial = todo.pop()
                if serial not in seen:
                    seen.add(serial)
                    todo += self.summed.get(serial, ())
            self.state |= seen
            if gradients:
                self.gradients |= seen

    def peak(self) -> int:
        """The largest sum of live bytes at any point, parameter state left out."""
        return self._replay()[0]

    def gradient_peak(self) -> int:
        """The most bytes of gradients held at once: the unsharded gradients a step keeps
        until it reduces them, or the shards it accumulates (a CPU measure: storages alone)."""
        total = peak = 0
        for serial, delta in self._events():
            if serial in self.gradients:
                total += delta
                peak = max(peak, total)
        return peak

    def at_peak(self) -> list[tuple]:
        """(bytes, op, shape) of the storages live at the peak, largest first (the op and
        shape with AUTOPAR_LEDGER_TRACE set)."""
        made_by = self.made_by or {}
        best = self._replay(keep=True)[1]
        return sorted(((b, *made_by.get(s, ("?", ()))) for s, b in best.items()), reverse=True)

    def _events(self) -> list[tuple[int, int]]:
        """(serial, +bytes or -bytes) in order, the frees on other threads placed."""
        placed = sorted(self.placed)
        events = []
        for at, event in enumerate(self.events):
            while placed and placed[0][0] <= at:
                events.append(placed.pop(0)[1:])
            events.append(event)
        return events + [p[1:] for p in placed]

    def _replay(self, keep: bool = False) -> tuple[int, dict[int, int]]:
        """(peak bytes, and with `keep` the storages live then: serial -> bytes)."""
        live: dict[int, int] = {}
        best: dict[int, int] = {}
        total = peak = 0
        for serial, delta in self._events():
            if serial in self.state or serial in self.host:
                continue
            total += delta
            if keep:
                live[serial] = delta
                if delta < 0:
                    del live[serial]
            if total > peak:
                peak = total
                best = dict(live) if keep else best
        return peak, best


_MEASURING: list[LiveBytes] = []  # the peaks being measured now (mark_host marks in each)


def _real(t: torch.Tensor) -> bool:
    """Backed by memory of its own: not DTensor's fake propagation tensors, not meta, not a
    wrapper such as the functional collectives' AsyncCollectiveTensor (its storage reports
    the inner tensor's bytes again while it holds none)."""
    if isinstance(t, FakeTensor) or t.device.type == "meta":
        return False
    return not is_traceable_wrapper_subclass(t)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata
