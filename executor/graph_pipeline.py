"""Graph mode across pipeline stages: the exported training graph cut where the plan cuts it,
each piece run by a GraphStage on its stage's (dp, tp) mesh, the pieces driven by the plan's
torch.distributed.pipelining schedule.

Every node belongs to the plan stage that lists it (a node the plan does not list joins the
latest stage among its inputs, or its first user's). A value produced on one stage and used on
a later one travels through every stage between (torch's pipelining passes tensors from one
stage to the next only): stage s sends the values produced at or before s that a later stage
uses, as local shards of a fixed placement (the producer's planned output placement, partial
sums reduced), and the next stage wraps them back into DTensors. The micro-batch's tokens and
labels enter the first stage as the graph's inputs; the labels travel to the last stage, whose
piece ends in the loss.

The pipelining stages are built with static shapes and dtypes (a dry run on fake tensors under
the plan's autocast): torch's runtime inference would run the pieces on empty tensors, and
uninitialised labels or token ids would index out of range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.fx import Interpreter

from executor.errors import ExecutionError
from executor.graph_mode import GraphStage, UnitFreeMesh, parameter_names, replicas_on_unit_dims
from executor.precision import autocast

GRAPH_OPS = ("call_function", "get_attr")


@dataclass(frozen=True)
class Boundary:
    """A value sent from one pipeline stage to the next: its global shape and dtype, and the
    placements its local shards are sent in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple
    grad: bool = True  # whether a gradient comes back: it depends on some parameter

    def stride(self) -> tuple[int, ...]:
        out, step = [], 1
        for size in reversed(self.shape):
            out.append(step)
            step *= max(size, 1)
        return tuple(reversed(out))

    def example(self, mesh: DeviceMesh, device: torch.device) -> torch.Tensor:
        """An empty local shard, as torch's pipelining stage allocates its buffers from."""
        local, _ = compute_local_shape_and_global_offset(self.shape, mesh, list(self.placements))
        t = torch.empty(local, dtype=self.dtype, device=device)
        return t.requires_grad_(self.dtype.is_floating_point and self.grad)

    def wrap(self, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        return DTensor.from_local(
            local,
            mesh,
            replicas_on_unit_dims(self.placements, mesh),
            shape=self.shape,
            stride=self.stride(),
            run_check=False,
        )

    def unwrap(self, value: Any, mesh: DeviceMesh) -> torch.Tensor:
        if not isinstance(value, DTensor):
            raise ExecutionError(f"value {self.name} crosses a pipeline stage but is no tensor")
        if _same_shards(value, self.placements, mesh):
            return value.to_local().contiguous()
        return value.redistribute(mesh, list(self.placements)).to_local().contiguous()


def _same_shards(value: DTensor, wanted: tuple, mesh: DeviceMesh) -> bool:
    """Whether `value`'s local shard already is the one `wanted` places on this rank: the
    same placements once mesh dims of size 1 count as replicated, sharded in the default
    mesh-dim order (DTensor's redistribute would gather and re-slice it)."""
    same = replicas_on_unit_dims(value.placements, mesh) == replicas_on_unit_dims(wanted, mesh)
    spec = value._spec
    return same and type(spec).is_default_device_order(spec.shard_order)


def stage_of_nodes(gm: torch.fx.GraphModule, plan) -> dict[str, int]:
    """Which plan stage runs each node (graph inputs: the first)."""
    owner = {s.node: st.index for st in plan.stages for s in st.shardings}
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if node.op in GRAPH_OPS and node.name not in owner:
            ups = [owner[a.name] for a in node.all_input_nodes if a.name in owner]
            if ups:
                owner[node.name] = max(ups)
    last = len(plan.stages) - 1
    for node in reversed(nodes):
        if node.op in GRAPH_OPS and node.name not in owner and node.users:
            users = [owner.get(u.name, last) for u in node.users if u.op != "output"]
            owner[node.name] = min(users, default=last)
    previous = 0
    for node in nodes:  # side effects (grad mode switches): with the node before them
        if node.op in GRAPH_OPS:
            previous = owner.setdefault(node.name, previous)
    for node in nodes:
        if node.op not in GRAPH_OPS:
            continue
        early = [a.name for a in node.all_input_nodes if owner.get(a.name, 0) > owner[node.name]]
        if early:
            raise ExecutionError(
                f"plan.stages: node {node.name} (stage {owner[node.name]}) uses {early[0]} "
                f"from a later stage ({owner[early[0]]})"
            )
    return owner


def value_dtypes(gm: torch.fx.GraphModule, dtype: str, device: torch.device) -> dict[str, Any]:
    """Every node's output under the plan's autocast, on fake tensors (shapes and dtypes as
    the run will have them, without computing anything)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        args = []
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                v = node.meta["val"]
                args.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device))
        interpreter = Interpreter(gm, garbage_collect_values=False)
        with autocast(dtype, device):
            interpreter.run(*args)
    return {node.name: value for node, value in interpreter.env.items()}


def with_parameters(gm: torch.fx.GraphModule, params: set[str]) -> set[str]:
    """The nodes whose values depend on a parameter (placeholders named in `params`): only
    their gradients flow back; rotary tables, masks and labels have none. The planner
    reads the same off its traced graph (planner.graph.dependence)."""
    out = set(params)
    for node in gm.graph.nodes:
        if any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out


def boundaries(
    gm, plan, owner: dict[str, int], user_inputs: list[str], mesh: UnitFreeMesh, values, grads
):
    """For each stage but the last, the values it sends to the next one. `grads`: the
    nodes whose values get a gradient (with_parameters)."""
    last = len(plan.stages) - 1
    by_node = {s.node: s for st in plan.stages for s in st.shardings}
    produced = {name: 0 for name in user_inputs}
    produced |= {n.name: owner[n.name] for n in gm.graph.nodes if n.op in GRAPH_OPS}
    out: list[list[Boundary]] = [[] for _ in range(last)]
    for node in gm.graph.nodes:
        if node.name not in produced:
            continue
        used_until = max(
            (last if u.op == "output" else owner[u.name] for u in node.users), default=0
        )
        for s in range(produced[node.name], used_until):
            sharding = by_node.get(node.name)
            grad = node.name in grads
            out[s].append(_boundary(node.name, sharding, values, mesh, grad))
    return out


def _boundary(name: str, sharding, values, mesh: UnitFreeMesh, grad: bool) -> Boundary:
    value = values[name]
    if not isinstance(value, torch.Tensor):
        raise ExecutionError(f"node {name} crosses a pipeline stage but its value is no tensor")
    texts = sharding.outputs[0] if sharding is not None and sharding.outputs else None
    wanted = mesh.placements(texts) if texts else [Replicate()] * mesh.mesh.ndim
    sent = tuple(
        Replicate()
        if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim >= value.dim())
        else p
        for p in wanted
    )
    return Boundary(name, tuple(value.shape), value.dtype, sent, grad)


class PipelineGraphStage(GraphStage):
    """One plan stage's nodes. Forward takes the first stage's graph inputs or the previous
    stage's boundary shards; returns the next stage's shards, or the loss on the last."""

    def __init__(self, exported, module, stage, mesh, owner, receives, sends, last: bool):
        nodes = {name for name, index in owner.items() if index == stage.index}
        super().__init__(exported, module, stage.shardings, mesh, nodes=nodes)
        self.index, self.receives, self.sends, self.last = stage.index, receives, sends, last
        if stage.activation_checkpointing:
            self.checkpoint_blocks(
                stage.modules, stage.checkpoint_policy, stage.checkpointed_layers
            )

    def read_after_run(self) -> set[str]:
        return {b.name for b in self.sends} | (super().read_after_run() if self.last else set())

    def forward(self, *args: torch.Tensor):
        env: dict[str, Any] = {}
        self.bind(env)
        if self.index == 0:
            for name, value in zip(self.user_inputs, args, strict=True):
                env[name] = self.place_source(name, value)
        else:
            for b, local in zip(self.receives, args, strict=True):
                env[b.name] = b.wrap(local, self.mesh)
        self.run(env)
        if self.last:  # shape (1,): the schedule concatenates the micro-batches' outputs
            return self.loss(env).reshape(1)
        return tuple(_owned(b.unwrap(env[b.name], self.mesh)) for b in self.sends)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A stage output that is not a view (a micro-batch's token ids passed through, a
    reshape's result): the split-backward schedules detach their stage outputs in place
    after the input-gradient pass, which torch refuses for views."""
    return t.clone() if t._is_view() else t


@dataclass
class GraphPipeline:
    """This rank's pieces of the graph and the example tensors their pipelining stages need."""

    stages: list[tuple]  # (plan stage, PipelineGraphStage)
    examples: dict[int, tuple[tuple, tuple]]  # stage index -> (inputs, outputs)
    tied: list[nn.Parameter]  # this rank's copies of parameters two stages use


def cut(plan, exported, module, mesh: DeviceMesh, rank: int, micro, device) -> GraphPipeline:
    """Cut the exported graph into this rank's stages. `micro`: one global micro-batch
    (tokens, labels)."""
    gm = exported.graph_module
    owner = stage_of_nodes(gm, plan)
    user_inputs = [
        s.arg.name for s in exported.graph_signature.input_specs if s.kind.name == "USER_INPUT"
    ]
    values = value_dtypes(gm, plan.request.training.dtype, device)
    params = {
        s.arg.name for s in exported.graph_signature.input_specs if s.kind.name == "PARAMETER"
    }
    grads = with_parameters(gm, params)
    unit_free = UnitFreeMesh(mesh)  # the mesh the stages' DTensors live on
    sends = boundaries(gm, plan, owner, user_inputs, unit_free, values, grads)
    last = len(plan.stages) - 1
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    loss = values[out_node.all_input_nodes[0].name]
    stages, examples = [], {}
    for st in (st for st in plan.stages if rank in st.ranks):
        receives = sends[st.index - 1] if st.index > 0 else []
        mine = sends[st.index] if st.index < last else []
        stage = PipelineGraphStage(
            exported, module, st, mesh, owner, receives, mine, st.index == last
        )
        stages.append((st, stage.to(device)))
        inputs = (
            tuple(t.to(device) for t in micro)
            if st.index == 0
            else tuple(b.example(unit_free.mesh, device) for b in receives)
        )
        outputs = (
            (torch.empty((1,), dtype=loss.dtype, device=device, requires_grad=True),)
            if st.index == last
            else tuple(b.example(unit_free.mesh, device) for b in mine)
        )
        examples[st.index] = (inputs, outputs)
    tied_names = tied_parameters(exported, module, owner, last)
    tied = [p for _, s in stages for name, p in s.canonical_parameters() if name in tied_names]
    return GraphPipeline(stages, examples, tied)


def tied_parameters(exported, module, owner: dict[str, int], last: int) -> set[str]:
    """Canonical names of parameters used on more than one stage: tied embeddings, on the
    first and the last (each holds a copy; executor.pipeline sums their gradients)."""
    canonical = parameter_names(module)
    users = {n.name: n.users for n in exported.graph_module.graph.nodes if n.op == "placeholder"}
    tied = set()
    for spec in exported.graph_signature.input_specs:
        if spec.kind.name != "PARAMETER":
            continue
        stages = {owner[u.name] for u in users[spec.arg.name] if u.name in owner}
        if len(stages) > 1:
            if not stages <= {0, last}:
                raise ExecutionError(
                    f"plan.stages: parameter {canonical[spec.target]} is used on stages "
                    f"{sorted(stages)}; only the first and last stage may share one"
                )
            tied.add(canonical[spec.target])
    return tied
