"""Plans that use one chosen tensor-parallel strategy on every node that offers it: the
strategy-by-strategy equivalence tests (and anyone checking how a strategy executes) run
these. Strategies come from planner.intra_op.sharding_rules, the same choices the ILP picks from."""

from __future__ import annotations

import math

from planner.cluster.mesh import LogicalMesh
from planner.cluster.profile import ClusterProfile
from planner.cost.model import CostModel
from planner.evaluate.config import ParallelConfig
from planner.evaluate.estimate import evaluate
from planner.graph.opgraph import OpGraph, OpNode
from planner.graph.tracing import trace_model
from planner.intra_op.ilp_layouts import chosen_layouts
from planner.intra_op.node_layout import NodeLayout
from planner.intra_op.sharding_problem import ShardingProblem
from planner.intra_op.sharding_rules import AxisChoice, axis_choices, with_zero
from planner.models import ModelSpec, resolve
from planner.plan import Plan, TrainingSettings
from planner.request import model_ref


def _choices(node: OpNode, n: int) -> dict[str, AxisChoice]:
    """The rules' choices for a node on an n-wide axis, with their ZeRO-3 variants, by name."""
    choices = {c.name: c for c in axis_choices(node, n)}
    for c in list(choices.values()):
        zero = with_zero(c, node, n)
        if zero is not None:
            choices[zero.name] = zero
    return choices


def strategies_by_kind(graph: OpGraph, n: int) -> dict[str, set[str]]:
    """Every strategy name the rules offer per node kind on an axis of n devices."""
    out: dict[str, set[str]] = {}
    for node in graph.nodes:
        out.setdefault(node.kind, set()).update(_choices(node, n))
    return out


def forced_layouts(
    graph: OpGraph, kind: str, strategy: str, n: int, cluster: ClusterProfile
) -> dict[str, NodeLayout]:
    """Nodes of `kind` run `strategy` where they offer it; every other node is replicated.
    Their communication is the ILP's for the same choice (planner.intra_op.ilp_layouts), so
    the plan's ledger is what the run sends; a ZeRO-3 variant on the tp axis, which the ILP
    does not offer there, gets its placements only (no ledger terms)."""
    names = {
        node.name: strategy
        for node in graph.nodes
        if node.kind == kind and strategy in _choices(node, n)
    }
    if not names:
        raise ValueError(f"no {kind} node offers strategy {strategy!r}")
    if strategy.endswith("+zero3"):
        return {
            node.name: _layout(_choices(node, n)[names.get(node.name, "replicate")], n)
            for node in graph.nodes
        }
    mesh = LogicalMesh.contiguous(cluster, 0, (1, n))
    problem = ShardingProblem(
        graph, mesh, CostModel(cluster, "fp32"), memory_budget=math.inf, optimizer="sgd"
    )
    return chosen_layouts(problem, names)


def _layout(choice: AxisChoice, n: int) -> NodeLayout:
    return NodeLayout(
        strategy=choice.name,
        compute_shards=n if choice.split_compute else 1,
        saved_shards=n if choice.split_compute else 1,
        params=dict(choice.params),
        inputs=list(choice.inputs),
        outputs=list(choice.outputs),
    )


def strategy_plan(
    model: ModelSpec,
    cluster: ClusterProfile,
    kind: str,
    strategy: str,
    *,
    tp: int = 2,
    global_batch: int = 4,
    seq: int = 16,
    graph: OpGraph | None = None,
) -> Plan:
    """A single-stage plan on tp devices with `strategy` on every `kind` node offering it.
    `graph`: the model already traced at (global_batch, seq, fp32), when the caller has it.
    Trained with fp32 SGD: an equivalence check of the sharding, which Adam's sign-like
    first steps would blur (a ~0 gradient moves a parameter by lr either way)."""
    resolved = resolve(model)
    training = TrainingSettings(
        global_batch_size=global_batch, seq_len=seq, dtype="fp32", optimizer="sgd"
    )
    graph = graph or trace_model(resolved, global_batch, seq, "fp32")
    config = ParallelConfig(dp=1, tp=tp, pp=1, microbatches=1)
    layouts = forced_layouts(graph, kind, strategy, tp, cluster)
    return evaluate(
        graph,
        cluster,
        training,
        config,
        model_ref(resolved, seq),
        layouts=layouts,
        tokens_per_sample=seq,
    )
