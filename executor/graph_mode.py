"""Graph mode: run a plan node by node with DTensor, so every sharding strategy
the ILP can choose runs as planned — not only the ones with a module-level parallel style
(column/row-parallel linears, vocab-parallel embeddings).

Every rank exports the same training forward (model + loss) that the planner traced; node
names match the plan's. Parameters become DTensors on the stage's (dp, tp) mesh (its dims of
size 1 left out: UnitFreeMesh) with the placements the plan gives them. The interpreter then
runs the exported graph: before each node, its tensor inputs are redistributed to the node's
planned input placements (that is the plan's resharding on the edge, done by DTensor:
all-gather, all-to-all, reduce-scatter or a local slice), and the aten op runs on DTensors,
whose sharding propagation computes its local share. Batch or sequence splits on tp,
hidden-parallel embeddings, expert-parallel einsums, convolution channel splits and follower
dims all run this way. Backward is autograd through DTensor, so partial gradients are reduced
where the plan says they are.

The global micro-batch is given to every rank (replicated); the first redistribute slices it
as the plan's input placements say, which is how data parallelism splits the batch here.

Activation checkpointing recomputes each layer block's nodes in backward
(torch.utils.checkpoint around the block's stretch of the graph). Pipeline stages:
executor/graph_pipeline.py. Data parallelism: parameters replicated over dp (ZeRO-0), each
unit's gradients summed in one all-reduce (executor/graph_data_parallel.py); plans with
ZeRO-1/2/3 or HSDP are not executable in graph mode (planner.executable.graph_mode_refusal).
Autocast casts the weights (FSDP2's mixed precision has no place without FSDP2). Each aten op
pays DTensor's dispatch on the CPU, so a graph-mode step is slower than the module path for
the same placements: the module path runs every plan whose tp layout is Megatron's
(planner/executable.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.export.graph_signature import InputKind
from torch.fx.node import map_arg

from executor.checkpointing import checkpoint_kwargs
from executor.errors import ExecutionError
from executor.graph_local_ops import (
    CONV_OPS,
    LOCAL_OPS,
    attention_on_local_shards,
    conv_on_local_shards,
    grouped_mm_on_local_shards,
    is_grouped_mm,
    is_masked,
    reduce_masked,
)
from planner.placements import PARTIAL, REPLICATE, shard, shard_dim
from planner.plan import NodeSharding

# Checks export leaves in the graph: the dtypes it saw while tracing in fp32, which autocast
# legitimately changes at run time.
TRACE_CHECKS = {torch.ops.aten._assert_tensor_metadata.default}


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


def replicas_on_unit_dims(places, mesh: DeviceMesh) -> list:
    """`places` with a split over a mesh dim of size 1 read as a replica (the same local
    data). Graph mode never splits there: DTensor would gather the other dims' shards to
    re-slice them in its mesh-dim order, an all-gather for nothing."""
    return [Replicate() if size == 1 else p for p, size in zip(places, mesh.shape, strict=True)]


class UnitFreeMesh:
    """The stage's (dp, tp) mesh without its dims of size 1, and the plan's placements read
    on it. Nothing is split over a dim of size 1, but DTensor's sharding propagation still
    enumerates every op's strategies over it (the product over mesh dims), and a split
    merged by a view across two dims becomes a `_StridedShard`, whose redistribute cost
    DTensor finds by a shortest-path search: under cProfile, a rank of the einsum split_c case
    spent 10.7 of its 17.5 s there on the (1, 2) mesh, and 5.6 s in all on the 1-D mesh; six
    einsum cases took 42.7 s and 27.6 s (bench/results/warm_ranks.md)."""

    def __init__(self, mesh: DeviceMesh):
        self.full = mesh
        names = mesh.mesh_dim_names or ()
        kept = [i for i, size in enumerate(mesh.shape) if size > 1] or [mesh.ndim - 1]
        self.kept = tuple(kept)
        if len(kept) == mesh.ndim:
            self.mesh = mesh
        elif len(kept) == 1:
            self.mesh = mesh[names[kept[0]]]
        else:
            self.mesh = mesh[tuple(names[i] for i in kept)]

    def placements(self, texts) -> list:
        """The DTensor placements of a plan's placements (one per dim of the full mesh)."""
        return [placement(texts[i]) for i in self.kept]

    def texts(self, placed) -> list[str]:
        """The plan's spelling, one per dim of the full mesh, of placements on this mesh."""
        out = [REPLICATE] * self.full.ndim
        for i, p in zip(self.kept, placed, strict=True):
            out[i] = placement_text(p)
        return out


def placement_text(p) -> str:
    """The plan's spelling of a DTensor placement."""
    if isinstance(p, Shard):
        return shard(p.dim)
    return PARTIAL if isinstance(p, Partial) else REPLICATE


def placements(texts: list[str]) -> list:
    return [placement(t) for t in texts]


def export_training(module: nn.Module, example_inputs: tuple[torch.Tensor, ...]):
    """The training forward (model + loss) as an exported ATen graph, as the planner traced it."""
    return torch.export.export(module, example_inputs, strict=False)


def parameter_names(module: nn.Module, strip_prefix: str = "model.") -> dict[str, str]:
    """Each parameter's canonical name (the plan's), by the name export gives its placeholder:
    tied parameters share one."""
    canonical: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name.removeprefix(strip_prefix))
    return {name: canonical[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}


class GraphStage(nn.Module):
    """The exported training forward of `module` with DTensor parameters placed as planned:
    the whole graph, or (`nodes`) the nodes of one pipeline stage, whose parameters it then
    holds alone. Parameters are registered under their canonical names with dots spelled
    `__` (nn.Module names cannot hold dots); `canonical_parameters` gives the plan's names."""

    def __init__(
        self,
        exported,
        module: nn.Module,
        shardings: list[NodeSharding],
        mesh: DeviceMesh,
        nodes: set[str] | None = None,
        strip_prefix: str = "model.",
    ):
        super().__init__()
        self.unit_free = UnitFreeMesh(mesh)
        mesh = self.mesh = self.unit_free.mesh
        self._freed_after: dict[str, list[str]] | None = None  # _last_uses, once sends are known
        self.by_node = {s.node: s for s in shardings}
        self.gm = exported.graph_module
        self.constants = exported.constants
        self.replicated = [Replicate()] * mesh.ndim
        self.nodes = [
            n
            for n in self.gm.graph.nodes
            if n.op in ("call_function", "get_attr") and (nodes is None or n.name in nodes)
        ]
        used = {a.name for n in self.nodes for a in n.all_input_nodes}
        canonical = parameter_names(module, strip_prefix)
        full = dict(module.named_parameters(remove_duplicate=False))
        buffers = dict(module.named_buffers(remove_duplicate=False))
        wanted = self._param_placements()
        self.names: dict[str, str] = {}  # canonical name -> registered name
        self.bindings: dict[str, tuple[str, Any]] = {}
        for spec in exported.graph_signature.input_specs:
            node_name = spec.arg.name
            if spec.kind == InputKind.PARAMETER:
                if nodes is not None and node_name not in used:
                    continue
                name = canonical[spec.target]
                if name not in self.names:
                    where = wanted.get(name, self.replicated)
                    tensor = full[spec.target].detach().clone()
                    self.names[name] = name.replace(".", "__")
                    self.register_parameter(
                        self.names[name], nn.Parameter(distribute_tensor(tensor, mesh, where))
                    )
                self.bindings[node_name] = ("param", name)
            elif spec.kind == InputKind.BUFFER:
                self.bindings[node_name] = ("const", buffers.get(spec.target))
            elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
                self.bindings[node_name] = ("const", self.constants[spec.target])
            else:
                self.bindings[node_name] = ("input", None)
        self.user_inputs = [n for n, (kind, _) in self.bindings.items() if kind == "input"]

    def _param_placements(self) -> dict[str, list]:
        """Each parameter's storage placement: what its first user in the plan asks for."""
        out: dict[str, list] = {}
        for s in self.by_node.values():
            for name, texts in s.params.items():
                out.setdefault(name, self.unit_free.placements(texts))
        return out

    def canonical_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, self.get_parameter(reg)) for name, reg in self.names.items()]

    def placement_texts(self, p: DTensor) -> list[str]:
        """A parameter's placements as the plan spells them (one per dim of the stage mesh)."""
        return self.unit_free.texts(p.placements)

    def _dt(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            return DTensor.from_local(value, self.mesh, self.replicated, run_check=False)
        return value

    def bind(self, env: dict[str, Any]) -> None:
        """Parameters, buffers and constants into `env` (by placeholder name)."""
        for name, (kind, ref) in self.bindings.items():
            if kind == "param":
                env[name] = self.get_parameter(self.names[ref])
            elif kind == "const":
                env[name] = self._dt(ref)

    def checkpoint_blocks(
        self, modules: list[str], policy: str = "full", count: int | None = None
    ) -> None:
        """Recompute the nodes of each layer block among `modules` (the plan stage's, e.g.
        "blocks.3"), or of the first `count`, in backward instead of keeping their
        activations (under the "selective" policy, all but the matmuls' and attention's
        outputs)."""
        self.checkpoint_policy = policy
        blocks = [m for m in modules if m.rsplit(".", 1)[-1].isdigit()][:count]

        def block_of(node) -> str | None:
            s = self.by_node.get(node.name)
            module = s.module if s is not None else ""
            return next((b for b in blocks if module == b or module.startswith(b + ".")), None)

        keys = [block_of(node) for node in self.nodes]
        # A node the plan does not name (export's tensor-metadata checks) between two nodes
        # of one block is in that block: splitting it would checkpoint each piece apart and
        # keep the values between them for backward.
        before, last = [], None
        for key in keys:
            before.append(last)
            last = key if key is not None else last
        after = None
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] is None and self.nodes[i].name not in self.by_node:
                keys[i] = before[i] if before[i] == after else None
            after = keys[i] if keys[i] is not None else after
        self.segments = []
        for node, key in zip(self.nodes, keys, strict=True):
            if self.segments and self.segments[-1][0] == key:
                self.segments[-1][1].append(node)
            else:
                self.segments.append((key, [node]))

    def run(self, env: dict[str, Any]) -> None:
        """Interpret this stage's nodes; their values land in `env`, each dropped after its
        last use here unless the caller reads it (read_after_run). The grad mode is the
        caller's again afterwards (a stage may end inside an exported no_grad region)."""
        cache: dict[tuple[str, tuple[str, ...]], DTensor] = {}
        grad_mode = torch.is_grad_enabled()
        try:
            for block, nodes in getattr(self, "segments", None) or [(None, self.nodes)]:
                if block is None:
                    self._interpret(nodes, env, cache)
                else:
                    self._checkpointed(nodes, env)
                    self._release(nodes, env, cache)
        finally:
            torch.set_grad_enabled(grad_mode)

    def read_after_run(self) -> set[str]:
        """The values run()'s caller reads from `env`: the graph's output."""
        out_node = next(n for n in self.gm.graph.nodes if n.op == "output")
        return {n.name for n in out_node.all_input_nodes}

    def _last_uses(self) -> dict[str, list[str]]:
        """Per node of this stage, the values no later node here reads: what a value holds
        is freed once used up (as torch.fx's Interpreter does), not when the stage returns;
        autograd keeps what backward needs."""
        if self._freed_after is None:
            last: dict[str, str] = {}
            for node in self.nodes:
                for arg in node.all_input_nodes:
                    last[arg.name] = node.name
            keep = self.read_after_run()
            self._freed_after = {}
            for name, at in last.items():
                if name not in keep:
                    self._freed_after.setdefault(at, []).append(name)
        return self._freed_after

    def _release(self, nodes, env: dict[str, Any], resharded: dict) -> None:
        freed = {name for node in nodes for name in self._last_uses().get(node.name, ())}
        for name in freed:
            env.pop(name, None)
        if freed and resharded:
            for key in [k for k in resharded if k[0] in freed]:
                del resharded[key]

    def _interpret(self, nodes, env: dict[str, Any], resharded: dict) -> None:
        for node in nodes:
            if node.op == "get_attr":
                env[node.name] = self._dt(getattr(self.gm, node.target))
                continue
            if node.target in TRACE_CHECKS:
                continue
            try:
                env[node.name] = self._call(node, env, resharded)
            except (RuntimeError, NotImplementedError, ValueError) as err:
                raise ExecutionError(
                    f"node {node.name} ({node.target}) under its planned placements: {err}"
                ) from err
            self._release((node,), env, resharded)

    def _checkpointed(self, nodes, env: dict[str, Any]) -> None:
        """Run `nodes` under torch.utils.checkpoint: only the values later nodes use are kept;
        backward runs the nodes again (their reshards too, on every rank alike)."""
        from torch.utils.checkpoint import checkpoint

        inside = {n.name for n in nodes}
        kept = [n.name for n in nodes if any(u.name not in inside for u in n.users)]
        # The recomputation holds what it reads, not the whole environment: a closure over
        # `env` would keep every earlier value of the micro-batch alive until its backward.
        reads = {a.name for n in nodes for a in n.all_input_nodes if a.name not in inside}
        needed = {name: env[name] for name in reads if name in env}

        def block() -> tuple:
            local = dict(needed)
            self._interpret(nodes, local, {})
            return tuple(local[name] for name in kept)

        policy = checkpoint_kwargs(getattr(self, "checkpoint_policy", "full"))
        env.update(zip(kept, checkpoint(block, use_reentrant=False, **policy), strict=True))

    def loss(self, env: dict[str, Any]) -> torch.Tensor:
        """The graph's output, the loss: a plain scalar tensor, identical on every rank."""
        out_node = next(n for n in self.gm.graph.nodes if n.op == "output")
        out = map_arg(out_node.args[0], lambda n: env[n.name])
        loss = out[0] if isinstance(out, tuple | list) else out
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The whole graph on the (global, replicated) micro-batch: the loss."""
        env: dict[str, Any] = {}
        self.bind(env)
        for name, value in zip(self.user_inputs, inputs, strict=True):
            env[name] = self.place_source(name, value)
        self.run(env)
        return self.loss(env)

    def place_source(self, name: str, value: torch.Tensor) -> Any:
        dt = self._dt(value)
        s = self.by_node.get(name)
        if s is not None and s.outputs:
            dt = dt.redistribute(
                self.mesh, replicas_on_unit_dims(self.unit_free.placements(s.outputs[0]), self.mesh)
            )
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
            # No split over a mesh dim of size 1, nor of a size-1 (broadcast) tensor dim: DTensor
            # cannot expand a dim it holds sharded.
            sizes = self.mesh.shape
            target = [
                have
                if isinstance(want, Partial) and isinstance(have, Partial)  # masked too
                else Replicate()
                if isinstance(want, Shard)
                and (want.dim >= value.ndim or size == 1 or value.shape[want.dim] == 1)
                else want
                for want, have, size in zip(
                    self.unit_free.placements(wanted), value.placements, sizes, strict=True
                )
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
        result = None
        if node.target in LOCAL_OPS:
            result = attention_on_local_shards(node.target, args, kwargs, self.mesh)
        elif node.target in CONV_OPS:
            result = conv_on_local_shards(node.target, args, kwargs, self.mesh)
        elif is_grouped_mm(node.target):
            result = grouped_mm_on_local_shards(node.target, args, kwargs, self.mesh)
        else:
            grad_mode = torch.is_grad_enabled()
            try:
                result = node.target(*args, **kwargs)
            except NotImplementedError:  # no DTensor sharding rule: run it replicated
                # (a no_grad region that failed half-way has not restored the grad mode)
                torch.set_grad_enabled(grad_mode)
                result = None
        if result is None:
            result = self._replicated(node.target, args, kwargs)
        if isinstance(result, torch.Tensor) and not isinstance(result, DTensor):
            result = self._dt(result)
        return reduce_masked(result) if is_masked(result) else result

    def _replicated(self, op, args, kwargs) -> Any:
        def full(a):
            return a.full_tensor() if isinstance(a, DTensor) else a

        out = op(*[full(a) for a in args], **{k: full(v) for k, v in kwargs.items()})
        if isinstance(out, tuple | list):
            return type(out)(self._dt(o) if isinstance(o, torch.Tensor) else o for o in out)
        return self._dt(out)
