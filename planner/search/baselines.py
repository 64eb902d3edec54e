"""Baselines under the same cost model as the planner, for comparison:

- megatron: the exhaustive Megatron-LM grid (Narayanan et al. 2021): dp x tp x pp = devices,
  tp within a node, Megatron's tensor-parallel layout with and without sequence parallelism
  (where it applies), balanced layers, 1F1B and interleaved 1F1B (every chunk count that
  splits the layers evenly), every micro-batch count that divides the batch, checkpointing
  off/on, ZeRO 0-3 (ZeRO-1 is Megatron's distributed optimizer), context parallelism
  (--context-parallel-size) where the planner searches it (planner.parallel.context);
- fsdp_tp: torchtitan's FSDP2 + tensor parallelism (+ pipelining): FSDP2 on dp (resharding
  after forward: ZeRO-3, ZeRO-2 under a pipeline; sharded over all of dp or, HSDP, one
  node's ranks), tp within a node with sequence
  parallelism, 1F1B, every micro-batch count, checkpointing off, torchtitan's op-level
  selective policy (selective_alternate) or full, context parallelism as in Megatron's grid;
- both take fp8 matmuls with tensorwise scales (Megatron-LM's --fp8-format with Transformer
  Engine, torchtitan's float8 converter) beside none where the planner searches it
  (planner.parallel.fp8), priced as the planner prices it;
- dp: pure data parallelism (DDP), every micro-batch count, checkpointing off/on;
- fsdp: ZeRO-3 / FSDP over all devices, every micro-batch count, checkpointing off/on.
Each returns the fastest configuration that fits, or None.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from planner.cluster.mesh import LogicalMesh
from planner.cost.model import CostModel
from planner.errors import InputError
from planner.evaluate.config import ParallelConfig
from planner.evaluate.layer_table import LayerTable, build_table
from planner.evaluate.predict import predict
from planner.evaluate.to_plan import to_plan
from planner.graph.batch import graph_at
from planner.graph.opgraph import OpGraph
from planner.intra_op.layout_map import LayoutMap
from planner.intra_op.megatron import tensor_parallel_layout
from planner.parallel import checkpointing, context, data, fp8, sequence
from planner.parallel.pipeline import MAX_VIRTUAL_STAGES, not_runnable
from planner.parallel.tensor import MEGATRON_KINDS, heads_refusal, is_sequence_parallel
from planner.parallel_dims import Combination
from planner.plan import Plan
from planner.request import PlanningInputs
from planner.search.bounds import fits_nowhere, step_lower_bound
from planner.search.layout_cache import LayoutCache
from planner.search.space import meshes, microbatch_count
from planner.vocab import BASELINE_KINDS, ZERO_LEVELS

KINDS = BASELINE_KINDS
# torchtitan's activation_checkpoint modes: none, selective (op) and full.
TORCHTITAN_CHECKPOINTING = (False, checkpointing.ALTERNATE, True)


@dataclass(frozen=True)
class BaselineResult:
    kind: str
    plan: Plan | None
    evaluated: int


def _microbatch_sizes(global_batch: int, dp: int) -> list[int]:
    per_replica = global_batch // dp if global_batch % dp == 0 else 0
    return [b for b in range(1, per_replica + 1) if per_replica % b == 0]


def _grid(kind: str, cluster, layers: int, model_config: dict) -> list[tuple[int, int, int, int]]:
    """(pp, dp, tp, zero) of a baseline family. Both frameworks give each tp rank whole
    attention heads (Megatron-LM asserts that tp divides the heads and the query groups;
    torchtitan's tensor-parallel plan divides them), as the search's meshes do."""
    n = cluster.num_devices
    if kind == "megatron":
        return [
            (pp, dp, tp, z)
            for pp, dp, tp in meshes(cluster, layers, None)
            if heads_refusal(model_config, tp) is None
            for z in (ZERO_LEVELS if dp > 1 else (0,))
        ]
    if kind == "fsdp_tp":  # FSDP2 resharding after forward (ZeRO-2 under a pipeline)
        return [
            (pp, dp, tp, (3 if pp == 1 else 2) if dp > 1 else 0)
            for pp, dp, tp in meshes(cluster, layers, cluster.devices_per_node)
            if heads_refusal(model_config, tp) is None
        ]
    if kind == "dp":
        return [(1, n, 1, 0)]
    return [(1, n, 1, 3 if n > 1 else 0)]


def _sequence_parallel_options(kind: str, inputs: PlanningInputs, tp: int) -> tuple[bool, ...]:
    """Megatron-LM's grid runs with and without --sequence-parallel where it applies;
    torchtitan's tensor parallelism always uses it."""
    model = inputs.model
    if sequence.refusal(model.family, inputs.training.seq_len, tp, model.config) is not None:
        return (False,)
    return {"megatron": (False, True), "fsdp_tp": (True,)}.get(kind, (False,))


def _schedules(kind: str, pp: int, m: int, layers: int) -> list[tuple[str, int]]:
    """1F1B, and in Megatron's grid interleaved 1F1B with every chunk count that splits the
    layers evenly (Megatron's --num-layers-per-virtual-pipeline-stage), micro-batches a
    multiple of pp."""
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1)]
    if kind == "megatron" and m % pp == 0:
        out += [
            ("interleaved_1f1b", v)
            for v in range(2, MAX_VIRTUAL_STAGES + 1)
            if layers % (pp * v) == 0 and not not_runnable("interleaved_1f1b", pp, m)
        ]
    return out


def _shards(kind: str, cluster, dp: int, tp: int, zero: int, cp: int) -> tuple[int, ...]:
    """torchtitan's data_parallel_shard_degree: all of dp, or one node's ranks (HSDP)."""
    if kind != "fsdp_tp" or cp > 1:
        return (0,)
    return data.shard_options(dp, tp, zero, cluster.devices_per_node)


def _with_cp(kind: str, grid: list[tuple], inputs: PlanningInputs) -> list[tuple]:
    """(pp, dp, tp, zero, cp): Megatron's and torchtitan's grids take context parallelism
    where the planner searches it (long sequences); torchtitan shards over the cp ranks."""
    family, seq = inputs.model.family, inputs.training.seq_len
    out = []
    for pp, dp, tp, zero in grid:
        config = inputs.model.config
        cps = (
            context.cp_options(family, seq, dp, None, config)
            if kind in ("megatron", "fsdp_tp")
            else ()
        )
        for cp in cps or (1,):
            if cp == 1 or kind == "megatron" or zero > 0:
                out.append((pp, dp, tp, zero, cp))
    return out


def _fp8_options(kind: str, inputs: PlanningInputs) -> tuple[str | None, ...]:
    device, dtype = inputs.cluster.device, inputs.training.dtype
    if kind not in ("megatron", "fsdp_tp"):
        return (None,)
    if fp8.refusal("tensorwise", device.kernels, device.peak_flops, dtype) is not None:
        return (None,)
    return fp8.SEARCHED


class GridTables:
    """One request's graphs per micro-batch, Megatron layouts per (batch, tp, sequence
    parallel) and their LayerTables per fp8 recipe: the families' grids ask for many of the
    same (Megatron's and torchtitan's share every sequence-parallel one), so they are
    computed once per request."""

    def __init__(self, inputs: PlanningInputs):
        self.inputs = inputs
        self.graphs: dict[int, OpGraph] = {}
        self.layouts: dict[tuple[int, int, bool], LayoutMap] = {}
        self.tables: dict[tuple[int, int, bool, str | None], LayerTable] = {}
        self.cost_models: dict[str | None, CostModel] = {}

    def adopt(self, cache: LayoutCache) -> None:
        """Take the graphs and Megatron tables a search on the same inputs computed (the
        same graphs where the model has its own layers, the same layouts, cost models and
        meshes; planner.search.layout_cache), so the grids price only what it did not."""
        inputs = self.inputs
        own_layers = inputs.base is inputs.graph and inputs.second_base is inputs.second
        if cache.inputs is not inputs or not own_layers or cache.restricted:
            return  # (a restricted search leaves out layouts the executor cannot run)
        for batch, graph in cache.graphs.items():
            self.graphs.setdefault(batch, graph)
        for (kind, batch, tp), table in cache.tables.items():
            layout_kind, recipe = fp8.split_kind(kind)
            if table is not None and layout_kind in MEGATRON_KINDS:
                sp = tp > 1 and is_sequence_parallel(layout_kind)
                self.tables.setdefault((batch, tp, sp, recipe), table)

    def graph(self, batch: int) -> OpGraph:
        if batch not in self.graphs:
            inputs = self.inputs  # as traced: the baselines use the model's own layers
            self.graphs[batch] = graph_at(inputs.graph, inputs.second, batch)
        return self.graphs[batch]

    def cost_model(self, recipe: str | None) -> CostModel:
        if recipe not in self.cost_models:
            inputs = self.inputs
            self.cost_models[recipe] = CostModel.of_training(
                inputs.cluster, inputs.training, recipe
            )
        return self.cost_models[recipe]

    def table(self, batch: int, tp: int, sp: bool, recipe: str | None) -> LayerTable:
        key = (batch, tp, sp, recipe)
        if key not in self.tables:  # one layout per (batch, tp, sp), priced per recipe
            graph = self.graph(batch)
            lay = self.layouts.get((batch, tp, sp))
            if lay is None:
                lay = tensor_parallel_layout(graph, tp, sequence_parallel=sp)
                self.layouts[(batch, tp, sp)] = lay
            mesh = LogicalMesh.contiguous(self.inputs.cluster, 0, (1, tp))
            self.tables[key] = build_table(graph, lay, self.cost_model(recipe), mesh)[0]
        return self.tables[key]


def baseline(kind: str, inputs: PlanningInputs, shared: GridTables | None = None) -> BaselineResult:
    """The family's best configuration; `shared`: the tables of other families' grids on
    the same inputs (GridTables), to reuse."""
    if kind not in KINDS:
        raise InputError("baseline.kind", f"unknown baseline {kind!r}", ", ".join(KINDS))
    cluster, training = inputs.cluster, inputs.training
    if shared is None or shared.inputs is not inputs:
        shared = GridTables(inputs)
    gb = training.global_batch_size
    recipes = _fp8_options(kind, inputs)
    best = None
    evaluated = 0
    capacity, precision = cluster.usable_memory_bytes, (training.dtype, training.optimizer)
    layers = max(inputs.graph.num_layers, 1)
    attention = context.AttentionBytes.of(inputs.graph)
    grid = _grid(kind, cluster, layers, inputs.model.config or {})
    for pp, dp, tp, zero, cp in _with_cp(kind, grid, inputs):
        for mbs in _microbatch_sizes(gb, dp // cp):
            combo = Combination(pp, dp, tp, mbs, cp)
            if context.dominated(combo, {combo.halved()}):
                continue  # as in the search: its half runs the same tokens, gathers less
            rank_batch = context.table_batch(mbs, cp)  # a cp rank's GEMM shapes
            g = shared.graph(mbs)
            m = microbatch_count(gb, combo)
            sps = _sequence_parallel_options(kind, inputs, tp)
            for sp, recipe in product(sps, recipes):
                cm = shared.cost_model(recipe)
                table = shared.table(rank_batch, tp, sp, recipe)
                table = context.scaled_table(table, cp, attention, mbs, tp, cm)
                ckpts = TORCHTITAN_CHECKPOINTING if kind == "fsdp_tp" else (False, True)
                shards = _shards(kind, cluster, dp, tp, zero, cp)
                options = product(_schedules(kind, pp, m, layers), ckpts, shards)
                for (schedule, v), ckpt, shard in options:
                    cfg = ParallelConfig(
                        dp, tp, pp, m, schedule, v, zero, ckpt, shard, cp, fp8=recipe
                    )
                    # The search's bounds (planner.search.bounds): what fits under no split
                    # of the layers, or cannot beat the best so far, is not predicted; the
                    # best is the same as predicting the whole grid
                    # (tests/planner/test_baselines.py).
                    if fits_nowhere(table, cfg, *precision, capacity, training.runtime):
                        continue
                    if best is not None:
                        bound = step_lower_bound(table, cfg, training.optimizer, cm.mem_rate)
                        if bound > best[0][0] * (1 + 1e-9):
                            continue
                    pred = predict(g, cluster, training, cfg, table=table)
                    evaluated += 1
                    if not pred.fits_in_memory:
                        continue
                    order = checkpointing.modes().index(ckpt)  # sortable: none, selective, full
                    key = (pp, dp, tp, zero, mbs, schedule, v, order, sp, shard, cp, recipe or "")
                    rank = (round(pred.step_time_s, 12), key)
                    if best is None or rank < best[0]:
                        best = (rank, pred, g, sp)
    if best is None:
        return BaselineResult(kind, None, evaluated)
    _, pred, g, sp = best
    lay = tensor_parallel_layout(g, pred.config.tp, sequence_parallel=sp)
    plan = to_plan(
        pred,
        g,
        cluster,
        training,
        inputs.model,
        tokens_per_sample=inputs.tokens_per_sample,
        layouts=lay,
        detail=False,
        tp_layout="megatron",  # lay is Megatron's: no need to compare
        sequence_parallel=sp,
        solver=f"baseline: {kind} grid",
    )
    search = plan.search.model_copy(update={"candidates_evaluated": evaluated})
    return BaselineResult(kind, plan.model_copy(update={"search": search}), evaluated)
