"""Tensor-parallel layouts per (layout kind, micro-batch size, tp), computed once per search:
the intra-op ILP's (solved up front, in a process pool when asked) and Megatron's."""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from planner.cluster.mesh import LogicalMesh
from planner.cluster.profile import ClusterProfile, parse_profile
from planner.cost.model import CostModel
from planner.executable import GRAPH_FAMILIES, executable
from planner.graph.opgraph import OpGraph
from planner.intra_op.ilp import solve
from planner.intra_op.ilp_layouts import ilp_layouts
from planner.intra_op.megatron import tensor_parallel_layout
from planner.intra_op.node_layout import NodeLayout
from planner.intra_op.sharding_problem import InfeasibleError, ShardingProblem
from planner.plan import TrainingSettings

Progress = Callable[[str, int, int], None]
Layouts = dict[str, NodeLayout]


def solve_tp_layout(
    graph: OpGraph,
    cluster: ClusterProfile,
    training: TrainingSettings,
    tp: int,
    solver: str,
    time_limit: float,
    executable_only: bool = False,
) -> tuple[Layouts | None, int]:
    """The ILP's time-optimal layout on a (1, tp) mesh and its variable count; memory is
    handled by pp, ZeRO and checkpointing outside, and checked exactly by predict()."""
    mesh = LogicalMesh.contiguous(cluster, 0, (1, tp))
    cm = CostModel(cluster, training.dtype, attention=training.attention)
    problem = ShardingProblem(
        graph,
        mesh,
        cm,
        memory_budget=math.inf,
        optimizer=training.optimizer,
        zero=0,
        executable_only=executable_only,
    )
    try:
        solution = solve(problem, solver, time_limit)
    except InfeasibleError:
        return None, 0
    return ilp_layouts(problem, solution), solution.stats.variables


def _solve_in_worker(args: tuple) -> tuple[Layouts | None, int]:
    graph_json, cluster_json, training_json, tp, solver, limit, only = args
    return solve_tp_layout(
        OpGraph.from_json(graph_json),
        parse_profile(cluster_json),
        TrainingSettings.model_validate(training_json),
        tp,
        solver,
        limit,
        only,
    )


class LayoutCache:
    def __init__(self, inputs, options, progress: Progress):
        self.inputs, self.options, self.progress = inputs, options, progress
        # Graph mode runs any layout; only families without it keep to the module styles.
        self.restricted = options.executable_only and inputs.model.family not in GRAPH_FAMILIES
        self.graphs: dict[int, OpGraph] = {}
        self.cache: dict[tuple[str, int, int], Layouts | None] = {}
        self.ilp_calls = 0
        self.ilp_max_vars = 0

    def graph(self, mbs: int) -> OpGraph:
        if mbs not in self.graphs:
            self.graphs[mbs] = self.inputs.at(mbs)
        return self.graphs[mbs]

    def prepare(self, keys: list[tuple[int, int]]) -> None:
        """Solve the ILP for every (micro-batch size, tp) up front, in parallel if asked."""
        o, inputs = self.options, self.inputs
        todo = [(mbs, tp) for mbs, tp in keys if tp > 1 and "ilp" in o.layouts]
        results = []
        if o.workers > 1 and len(todo) > 1:
            args = [
                (
                    self.graph(mbs).to_json(),
                    inputs.cluster.model_dump(mode="json"),
                    inputs.training.model_dump(mode="json"),
                    tp,
                    o.solver,
                    o.ilp_time_limit,
                    self.restricted,
                )
                for mbs, tp in todo
            ]
            with ProcessPoolExecutor(o.workers, mp_context=get_context("fork")) as ex:
                for i, res in enumerate(ex.map(_solve_in_worker, args)):
                    results.append(res)
                    self.progress("tensor-parallel layouts (ILP)", i + 1, len(todo))
        else:
            for i, (mbs, tp) in enumerate(todo):
                results.append(
                    solve_tp_layout(
                        self.graph(mbs),
                        inputs.cluster,
                        inputs.training,
                        tp,
                        o.solver,
                        o.ilp_time_limit,
                        self.restricted,
                    )
                )
                self.progress("tensor-parallel layouts (ILP)", i + 1, len(todo))
        for (mbs, tp), (layouts, nvars) in zip(todo, results, strict=True):
            self.cache[("ilp", mbs, tp)] = layouts
            self.ilp_calls += 1
            self.ilp_max_vars = max(self.ilp_max_vars, nvars)

    def get(self, kind: str, mbs: int, tp: int) -> Layouts | None:
        if tp == 1:
            kind = "megatron"  # nothing to choose on a 1-wide tp axis
        key = (kind, mbs, tp)
        if key not in self.cache:
            graph = self.graph(mbs)
            layout = tensor_parallel_layout(graph, tp)
            if self.restricted and not all(
                executable(n.kind, layout[n.name].strategy, n.module_type) for n in graph.nodes
            ):
                layout = None  # e.g. Megatron's split of MoE experts: not executable yet
            self.cache[key] = layout
        return self.cache[key]
