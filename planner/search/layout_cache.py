"""Tensor-parallel layouts per (layout kind, micro-batch size, tp), computed once per search:
the intra-op ILP's (solved up front, in a process pool when asked) and Megatron's; and their
LayerTables (what the search prices configurations with), with the "ideal" table of the
bounds. Layouts and tables are kept in the disk cache (planner.disk_cache): a warm search
reads the small tables and loads a layout (and builds a graph) only for the plan it returns."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from planner import disk_cache
from planner.cluster.mesh import LogicalMesh
from planner.cluster.profile import ClusterProfile
from planner.cost.model import CostModel
from planner.evaluate.layer_table import LayerTable, build_table
from planner.executable import (
    GRAPH_FAMILIES,
    ExecutorMode,
    executable,
    executor_mode_and_reason,
)
from planner.graph.opgraph import OpGraph
from planner.intra_op.ilp import solve
from planner.intra_op.ilp_layouts import ilp_layouts
from planner.intra_op.layout_map import LayoutMap, dump_layouts, load_layouts, strategy_of
from planner.intra_op.megatron import tensor_parallel_layout
from planner.intra_op.node_layout import NodeLayout
from planner.intra_op.sharding_problem import InfeasibleError, ShardingProblem
from planner.parallel import fp8
from planner.parallel.tensor import FOLDED_KIND, MEGATRON_KINDS, is_sequence_parallel
from planner.plan import TrainingSettings
from planner.search.bounds import ideal_layouts

Progress = Callable[[str, int, int], None]
Layouts = Mapping[str, NodeLayout]


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
    cm = CostModel.of_training(cluster, training)
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


STEP_NAMES = {
    "ilp": "tensor-parallel layouts (ILP)",
    "megatron": "Megatron layouts",
    "megatron_sp": "Megatron layouts with sequence parallelism",
    FOLDED_KIND: "Megatron layouts with MoE blocks on their tp rank's tokens",
    "ideal": "bounds per (micro-batch, tp)",
}
_FORKED: LayoutCache | None = None  # the cache a build_tables worker was forked from


def _tables_in_worker(keys: list[tuple[str, int, int]]) -> list[tuple]:
    return [_table_in_worker(key) for key in keys]


def _table_in_worker(key: tuple[str, int, int]) -> tuple:
    cache = _FORKED
    assert cache is not None, "build_tables sets the cache before forking"
    solves, hits = cache.ilp_calls, cache.cache_hits
    table = cache.table(*key)
    kind, mbs, tp = key
    layout_kind = fp8.split_kind(kind)[0]
    layouts = None
    if disk_cache.cache_dir() is None and kind != "ideal":  # else read from disk when needed
        layouts = cache.cache.get((layout_kind if tp > 1 else "megatron", mbs, tp))
        if isinstance(layouts, LayoutMap):  # sent without the graph, which the parent has
            layouts = (layouts.own, layouts.layer_source)
    return (
        key,
        table,
        cache.variables.get((mbs, tp), 0),
        cache.ilp_calls - solves,
        cache.cache_hits - hits,
        layouts,
    )


class LayoutCache:
    def __init__(self, inputs, options, progress: Progress):
        self.inputs, self.options, self.progress = inputs, options, progress
        # Graph mode runs any layout; only families without it keep to the module styles.
        self.restricted = options.executable_only and inputs.model.family not in GRAPH_FAMILIES
        self.graphs: dict[int, OpGraph] = {}
        self.cache: dict[tuple[str, int, int], Layouts | None] = {}
        self.modes: dict[tuple[str, int, int], ExecutorMode | None] = {}
        self.ilp_calls = 0
        self.cache_hits = 0
        self.ilp_max_vars = 0
        self.solved: set[tuple[int, int]] = set()  # (micro-batch, tp) with an ILP layout
        self.variables: dict[tuple[int, int], int] = {}  # the ILP's size per (mbs, tp)
        self.tables: dict[tuple[str, int, int], LayerTable | None] = {}
        training = inputs.training
        self.cm = CostModel.of_training(inputs.cluster, training)
        self._cms = {None: self.cm}  # per fp8 recipe (planner.parallel.fp8)
        # What every cached layout and table depends on besides (kind, micro-batch, tp).
        self._key_material = {
            "model": inputs.model.content_hash,
            "seq": training.seq_len,
            "dtype": training.dtype,
            "attention": training.attention,
            "optimizer": training.optimizer,
            # the node count is left out: a layout or table is per (micro-batch, tp) on a tp
            # group whose links depend on devices per node, so `autopar size` reuses them
            # across cluster sizes
            "cluster": inputs.cluster.model_dump(mode="json", exclude={"nodes"}),
            "solver": options.solver,
            "ilp_time_limit": options.ilp_time_limit,
            "executable_only": self.restricted,
        }
        if training.runtime != "autopar":  # its kernels' saved bytes (planner.runtime)
            self._key_material["runtime"] = training.runtime

    def graph(self, mbs: int) -> OpGraph:
        if mbs not in self.graphs:
            self.graphs[mbs] = self.inputs.at(mbs)
        return self.graphs[mbs]

    def _megatron(self, graph: OpGraph, mbs: int, tp: int, kind: str = "megatron") -> Layouts:
        """Megatron's layout (with sequence parallelism for kind "megatron_sp"), from the
        disk cache when this model was laid out before."""
        if tp == 1:
            return tensor_parallel_layout(graph, tp)
        key = self._cache_key(mbs, tp, kind)
        payload = disk_cache.load("megatron", key)
        if payload is not None:
            return load_layouts(payload, graph)
        sp, folded = is_sequence_parallel(kind), kind == FOLDED_KIND
        layout = tensor_parallel_layout(graph, tp, sequence_parallel=sp, fold_experts=folded)
        disk_cache.store("megatron", key, dump_layouts(layout))
        return layout

    def _cache_key(self, mbs: int, tp: int, kind: str = "ilp") -> str:
        return disk_cache.key_of(kind, {**self._key_material, "microbatch": mbs, "tp": tp})

    def _from_disk(self, mbs: int, tp: int) -> bool:
        payload = disk_cache.load("ilp", self._cache_key(mbs, tp))
        if payload is None:
            return False
        stored = payload["layouts"]
        layouts = None if stored is None else load_layouts(stored, self.graph(mbs))
        self._record(mbs, tp, layouts, payload["variables"])
        self.cache_hits += 1
        return True

    def _record(self, mbs: int, tp: int, layouts: Layouts | None, nvars: int) -> None:
        self.cache[("ilp", mbs, tp)] = layouts
        self._solved(mbs, tp, nvars)

    def _solved(self, mbs: int, tp: int, nvars: int) -> None:
        self.solved.add((mbs, tp))
        self.variables[(mbs, tp)] = nvars
        self.ilp_max_vars = max(self.ilp_max_vars, nvars)

    def _store_ilp(self, mbs: int, tp: int, layouts: Layouts | None, nvars: int) -> None:
        self._record(mbs, tp, layouts, nvars)
        self.ilp_calls += 1
        stored = None if layouts is None else dump_layouts(layouts)
        disk_cache.store("ilp", self._cache_key(mbs, tp), {"layouts": stored, "variables": nvars})

    def cost_model(self, recipe: str | None) -> CostModel:
        """The search's cost model with this fp8 recipe (None: none)."""
        if recipe not in self._cms:
            self._cms[recipe] = CostModel.of_training(
                self.inputs.cluster, self.inputs.training, recipe
            )
        return self._cms[recipe]

    def table(self, kind: str, mbs: int, tp: int) -> LayerTable | None:
        """The LayerTable of get(kind, mbs, tp) (None where that is None); kind "ideal":
        every node split perfectly over tp (planner.search.bounds.ideal_layouts); a kind
        with an fp8 recipe (fp8.table_kind): that layout priced with fp8 matmuls."""
        layout_kind, recipe = fp8.split_kind(kind)
        if tp == 1 and layout_kind != "ideal":
            layout_kind = "megatron"
            kind = fp8.table_kind(layout_kind, recipe)
        key = (kind, mbs, tp)
        if key not in self.tables and not self._table_from_disk(kind, mbs, tp):
            graph = self.graph(mbs)
            ideal = layout_kind == "ideal"
            lay = ideal_layouts(graph, tp) if ideal else self.get(layout_kind, mbs, tp)
            table = None
            if lay is not None:
                mesh = LogicalMesh.contiguous(self.inputs.cluster, 0, (1, tp))
                table = build_table(graph, lay, self.cost_model(recipe), mesh)[0]
            self.tables[key] = table
            payload = {
                "table": None if table is None else table.to_json(),
                "variables": self.variables.get((mbs, tp), 0) if kind == "ilp" else 0,
            }
            disk_cache.store("table", self._cache_key(mbs, tp, f"table-{kind}"), payload)
        return self.tables[key]

    def _table_from_disk(self, kind: str, mbs: int, tp: int) -> bool:
        payload = disk_cache.load("table", self._cache_key(mbs, tp, f"table-{kind}"))
        if payload is None:
            return False
        stored = payload["table"]
        self.tables[(kind, mbs, tp)] = None if stored is None else LayerTable.from_json(stored)
        if kind == "ilp":  # the ILP was solved: its layout is read only if it is needed
            self._solved(mbs, tp, int(payload["variables"]))
            self.cache_hits += 1
        return True

    def prepare(self, keys: list[tuple[int, int]]) -> None:
        """Solve the ILP for these (micro-batch size, tp) and build their tables; solutions
        come from the disk cache when an identical problem was solved before."""
        if "ilp" in self.options.layouts:
            self.build_tables("ilp", [(mbs, tp) for mbs, tp in keys if tp > 1])

    def build_tables(self, kind: str, keys: list[tuple[int, int]]) -> None:
        """table(kind, mbs, tp) for each key (build_all)."""
        layout_kind, recipe = fp8.split_kind(kind)
        step = STEP_NAMES[layout_kind] + (f" (fp8 {recipe})" if recipe else "")
        self.build_all([(kind, mbs, tp) for mbs, tp in keys], step)

    def build_all(self, wanted: list[tuple[str, int, int]], step: str) -> None:
        """table(kind, mbs, tp) for each (kind, mbs, tp), spread over `options.workers`
        forked processes, one task per layout (its kinds priced with each fp8 recipe): each
        computes the layout (an ILP solve or Megatron's propagation), prices it and writes
        both to the disk cache; the layout comes back only without a disk cache."""
        todo: list[tuple[str, int, int]] = []
        for kind, mbs, tp in wanted:
            layout_kind, recipe = fp8.split_kind(kind)
            if tp == 1 and layout_kind != "ideal":  # as table() names it
                kind = fp8.table_kind("megatron", recipe)
            key = (kind, mbs, tp)
            if key not in todo and key not in self.tables and not self._table_from_disk(*key):
                todo.append(key)
        workers = min(self.options.workers, len(todo))
        if workers <= 1:
            for i, key in enumerate(todo):
                self.table(*key)
                self.progress(step, i + 1, len(todo))
            return
        tasks: dict[tuple, list] = {}  # one per layout: its tables, one per fp8 recipe
        for kind, mbs, tp in todo:
            tasks.setdefault((fp8.split_kind(kind)[0], mbs, tp), []).append((kind, mbs, tp))
        for mbs in sorted({mbs for _, mbs, _ in todo}):
            self.graph(mbs)  # built once here, inherited by the workers
        global _FORKED
        _FORKED = self
        done_count = 0
        try:
            with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as ex:
                for results in ex.map(_tables_in_worker, tasks.values()):
                    for done in results:
                        self._adopt(*done)
                        done_count += 1
                        self.progress(step, done_count, len(todo))
        finally:
            _FORKED = None

    def _adopt(self, key, table, nvars: int, solves: int, hits: int, layouts) -> None:
        """Record what a worker of build_tables computed."""
        kind, mbs, tp = key
        self.tables[key] = table
        kind = fp8.split_kind(kind)[0]
        key = (kind, mbs, tp)
        if kind == "ilp":
            self._solved(mbs, tp, nvars)
        self.ilp_calls += solves
        self.cache_hits += hits
        if isinstance(layouts, tuple):
            layouts = LayoutMap(self.graph(mbs), *layouts)
        if kind != "ideal" and (layouts is not None or disk_cache.cache_dir() is None):
            self.cache[key] = layouts

    def _solve(self, mbs: int, tp: int) -> tuple[Layouts | None, int]:
        o, inputs = self.options, self.inputs
        return solve_tp_layout(
            self.graph(mbs),
            inputs.cluster,
            inputs.training,
            tp,
            o.solver,
            o.ilp_time_limit,
            self.restricted,
        )

    def executor_mode(self, kind: str, mbs: int, tp: int) -> ExecutorMode | None:
        """How the executor would run this kind's layout (planner.executable, as to_plan
        decides it): a per-node layout at tp > 1 in graph mode, without building it (an ILP
        layout may come from disk as a cost table only); Megatron's from its strategies."""
        family = self.inputs.model.family
        if tp > 1 and kind not in (*MEGATRON_KINDS, FOLDED_KIND):
            return "graph" if family in GRAPH_FAMILIES else None
        key = (kind, mbs, tp)
        if key not in self.modes:
            layouts, graph = self.get(kind, mbs, tp), self.graph(mbs)
            mode = None
            if layouts is not None:
                nodes = [
                    (n.name, n.kind, strategy_of(layouts, n.name), n.module_type)
                    for n in graph.nodes
                ]
                mode = executor_mode_and_reason(family, True, nodes)[0]
            self.modes[key] = mode
        return self.modes[key]

    def get(self, kind: str, mbs: int, tp: int) -> Layouts | None:
        if tp == 1:
            kind = "megatron"  # nothing to choose on a 1-wide tp axis
        key = (kind, mbs, tp)
        if key not in self.cache and kind == "ilp" and not self._from_disk(mbs, tp):
            self._store_ilp(mbs, tp, *self._solve(mbs, tp))  # its disk entry is gone
        if key not in self.cache:
            graph = self.graph(mbs)
            layout = self._megatron(graph, mbs, tp, kind)
            if self.restricted and not all(
                executable(n.kind, layout[n.name].strategy, n.module_type) for n in graph.nodes
            ):
                layout = None  # e.g. Megatron's split of MoE experts: not executable yet
            self.cache[key] = layout
        return self.cache[key]
