"""Graph mode: run a single-stage plan node by node with DTensor, so every sharding strategy
the ILP can choose runs as planned — not only the ones with a module-level parallel style
(column/row-parallel linears, vocab-parallel embeddings).

Every rank exports the same training forward (model + loss) that the planner traced; node
names match the plan's. Parameters become DTensors on the stage's (dp, tp) mesh with the
placements the plan gives them. The interpreter then runs the exported graph: before each
node, its tensor inputs are redistributed to the node's planned input placements (that is the
plan's resharding on the edge, done by DTensor: all-gather, all-to-all, reduce-scatter or a
local slice), and the aten op runs on DTensors, whose sharding propagation computes its local
share. Batch or sequence splits on tp, hidden-parallel embeddings, expert-parallel einsums,
convolution channel splits and follower dims all run this way; ZeRO-3 parameters are simply
sharded on dp. Backward is autograd through DTensor, so partial gradients are reduced where
the plan says they are.

The global micro-batch is given to every rank (replicated); the first redistribute slices it
as the plan's input placements say, which is how data parallelism splits the batch here.

Not applied in graph mode (numerically the same step, different memory and time): activation
checkpointing, and FSDP's prefetching. Each aten op pays DTensor's dispatch on the CPU, so a
graph-mode step is slower than the module path for the same placements: the module path runs
every plan whose tp layout is Megatron's (planner/executable.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.export.graph_signature import InputKind
from torch.fx.node import map_arg

from executor.errors import ExecutionError
from planner.executable import GRAPH_FAMILIES
from planner.placements import PARTIAL, REPLICATE, shard, shard_dim
from planner.plan import NodeSharding

# Per (batch, head) independent: run on local shards (DTensor has no rule for the CPU kernel).
LOCAL_OPS = {torch.ops.aten.scaled_dot_product_attention.default}


def placement(text: str):
    """The DTensor placement of a plan's placement string (planner.placements)."""
    if text == REPLICATE:
        return Replicate()
    if text == PARTIAL:
        return Partial()
    dim = shard_dim(text)
    if dim is not None:
        return Shard(dim)
    raise ExecutionError(f"unknown placement {text!r} (expected R, P or S(d))")


def placement_text(p) -> str:
    """The plan's spelling of a DTensor placement."""
    if isinstance(p, Shard):
        return shard(p.dim)
    return PARTIAL if isinstance(p, Partial) else REPLICATE


def placements(texts: list[str]) -> list:
    return [placement(t) for t in texts]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous: DTensor infers global strides from local
    ones, and a kernel's oddly strided gradient would make later views fail."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class GraphStage:
    """The exported training forward of `module` with DTensor parameters placed as planned."""

    def __init__(
        self,
        module: nn.Module,
        example_inputs: tuple[torch.Tensor, ...],
        shardings: list[NodeSharding],
        mesh: DeviceMesh,
        strip_prefix: str = "model.",
    ):
        self.mesh = mesh
        self.by_node = {s.node: s for s in shardings}
        ep = torch.export.export(module, example_inputs, strict=False)
        self.gm = ep.graph_module
        self.constants = ep.constants
        self.replicated = [Replicate()] * mesh.ndim
        canonical: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            canonical.setdefault(id(p), name.removeprefix(strip_prefix))
        full = dict(module.named_parameters(remove_duplicate=False))
        buffers = dict(module.named_buffers(remove_duplicate=False))
        wanted = self._param_placements()
        self.params: dict[str, nn.Parameter] = {}
        self.bindings: dict[str, tuple[str, Any]] = {}
        for spec in ep.graph_signature.input_specs:
            node_name = spec.arg.name
            if spec.kind == InputKind.PARAMETER:
                tensor = full[spec.target]
                name = canonical[id(tensor)]
                if name not in self.params:
                    where = wanted.get(name, self.replicated)
                    dt = distribute_tensor(tensor.detach().clone(), mesh, where)
                    self.params[name] = nn.Parameter(dt)
                self.bindings[node_name] = ("param", name)
            elif spec.kind == InputKind.BUFFER:
                self.bindings[node_name] = ("const", buffers.get(spec.target))
            elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
                self.bindings[node_name] = ("const", self.constants[spec.target])
            else:
                self.bindings[node_name] = ("input", None)

    def _param_placements(self) -> dict[str, list]:
        """Each parameter's storage placement: what its first user in the plan asks for."""
        out: dict[str, list] = {}
        for s in self.by_node.values():
            for name, texts in s.params.items():
                out.setdefault(name, placements(texts))
        return out

    def named_parameters(self):
        return self.params.items()

    def _dt(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            return DTensor.from_local(value, self.mesh, self.replicated, run_check=False)
        return value

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The loss (a plain scalar tensor, identical on every rank)."""
        env: dict[str, Any] = {}
        resharded: dict[tuple[str, tuple[str, ...]], DTensor] = {}
        user = iter(inputs)
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                kind, ref = self.bindings[node.name]
                if kind == "param":
                    env[node.name] = self.params[ref]
                elif kind == "const":
                    env[node.name] = self._dt(ref)
                else:
                    env[node.name] = self._place_source(node.name, next(user))
            elif node.op == "call_function":
                try:
                    env[node.name] = self._call(node, env, resharded)
                except (RuntimeError, NotImplementedError, ValueError) as err:
                    raise ExecutionError(
                        f"node {node.name} ({node.target}) under its planned placements: {err}"
                    ) from err
            elif node.op == "output":
                out = map_arg(node.args[0], lambda n: env[n.name])
                loss = out[0] if isinstance(out, tuple | list) else out
                return loss.full_tensor() if isinstance(loss, DTensor) else loss
            elif node.op == "get_attr":
                env[node.name] = self._dt(getattr(self.gm, node.target))
        raise ExecutionError("the exported graph has no output")

    def _place_source(self, name: str, value: torch.Tensor) -> Any:
        dt = self._dt(value)
        s = self.by_node.get(name)
        if s is not None and s.outputs:
            dt = dt.redistribute(self.mesh, placements(s.outputs[0]))
        return dt

    def _call(self, node, env: dict[str, Any], resharded: dict) -> Any:
        s = self.by_node.get(node.name)
        position = [0]

        def fetch(arg) -> Any:
            value = env[arg.name]
            kind = self.bindings.get(arg.name, ("activation", None))[0]
            if not isinstance(value, DTensor) or kind == "const":
                return value  # buffers and constants are not among the plan's inputs
            if kind == "param":
                name = self.bindings[arg.name][1]
                wanted = s.params.get(name) if s is not None else None
            else:
                index = position[0]
                position[0] += 1
                wanted = s.inputs[index] if s is not None and index < len(s.inputs) else None
            if wanted is None:
                return value
            target = [
                have
                if isinstance(want, Partial) and isinstance(have, Partial)  # masked too
                else Replicate()
                if isinstance(want, Shard) and want.dim >= value.ndim
                else want
                for want, have in zip(placements(wanted), value.placements, strict=True)
            ]
            if list(value.placements) == target:
                return value
            # One reshard per (tensor, placements), shared by its consumers: a vocab-parallel
            # embedding's masked partial output can be reduced only once.
            key = (arg.name, tuple(placement_text(p) for p in target))
            if key not in resharded:
                resharded[key] = value.redistribute(self.mesh, target)
            return resharded[key]

        args = map_arg(node.args, fetch)
        kwargs = map_arg(node.kwargs, fetch)
        args = tuple(self._dt(a) if isinstance(a, torch.Tensor) else a for a in args)
        if node.target in LOCAL_OPS:
            result = self._local(node.target, args, kwargs)
        else:
            try:
                result = node.target(*args, **kwargs)
            except NotImplementedError:  # no DTensor sharding rule: run it replicated
                result = self._replicated(node.target, args, kwargs)
        if isinstance(result, torch.Tensor) and not isinstance(result, DTensor):
            result = self._dt(result)
        return result

    def _local(self, op, args, kwargs) -> Any:
        """Ops that are independent per batch element and head (attention): each rank runs
        its shard locally when all tensor inputs share placements on those dims."""
        tensors = [a for a in args if isinstance(a, DTensor)]
        first = list(tensors[0].placements)
        local_ok = all(
            isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim in (0, 1)) for p in first
        ) and all(list(t.placements) == first for t in tensors)
        if not local_ok:
            return self._replicated(op, args, kwargs)
        local_args = [
            _ContiguousGrad.apply(a.to_local()) if isinstance(a, DTensor) else a for a in args
        ]
        # contiguous: DTensor derives global strides from the local ones, and the CPU kernel
        # returns a transposed layout that later views would misread.
        out = op(*local_args, **kwargs).contiguous()
        return DTensor.from_local(out, self.mesh, first, run_check=False)

    def _replicated(self, op, args, kwargs) -> Any:
        def full(a):
            return a.full_tensor() if isinstance(a, DTensor) else a

        out = op(*[full(a) for a in args], **{k: full(v) for k, v in kwargs.items()})
        if isinstance(out, tuple | list):
            return type(out)(self._dt(o) if isinstance(o, torch.Tensor) else o for o in out)
        return self._dt(out)


def train(plan, mesh: DeviceMesh, opts, fault):
    """Train a single-stage plan in graph mode (`opts`: executor.training.RunOptions):
    per-step records, a fingerprint of each parameter and the placements it was stored with."""
    import time

    from executor.data import data_source
    from executor.optim import build_optimizer, clip_grad_norm
    from executor.precision import autocast, loss_scaler
    from executor.stage_model import build_full_model
    from executor.training import fingerprint, step_record
    from planner.models.registry import FAMILIES, TrainingModule

    training = plan.request.training
    seq, gb, m = training.seq_len, training.global_batch_size, plan.schedule.microbatches
    model, family = build_full_model(plan.request.model.model_dump(), seq, opts.seed)
    if family not in GRAPH_FAMILIES:
        raise ExecutionError(
            f"graph mode runs {', '.join(sorted(GRAPH_FAMILIES))} models; this plan's is {family}"
        )
    vocab = plan.request.model.config.get("vocab") or 2
    module = TrainingModule(model, FAMILIES[family].loss)
    batches = data_source(opts.data, seq, vocab, opts.seed)
    x, y = batches(0, gb)
    stage = GraphStage(
        module, (x[: gb // m], y[: gb // m]), plan.stages[0].shardings, mesh["dp", "tp"]
    )
    params = [p for _, p in stage.named_parameters()]
    optimizer = build_optimizer(training.optimizer, params, opts.lr, opts.momentum)
    scaler = loss_scaler(training.dtype)
    device = x.device
    records = []
    for step in range(opts.steps):
        fault(step)
        t0 = time.perf_counter()
        tokens, labels = batches(step, gb)
        optimizer.zero_grad()
        total = 0.0
        for xm, ym in zip(tokens.chunk(m), labels.chunk(m), strict=True):
            with autocast(training.dtype, device):
                loss = stage.forward(xm, ym) / m
            (loss * scaler.scale).backward()
            total += float(loss.detach())
        if scaler.unscale_and_check(params):
            clip_grad_norm(params, opts.max_grad_norm)
            optimizer.step()
        records.append(step_record(step, t0, total))
    state = {name: fingerprint(p) for name, p in stage.named_parameters()}
    where = {
        name: [placement_text(x) for x in p.placements] for name, p in stage.named_parameters()
    }
    return records, state, where
