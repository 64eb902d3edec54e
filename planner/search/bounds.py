"""Lower bounds on a configuration's predicted step time, so whole families of candidates are
dropped before they are evaluated, and the bar they must clear.

For any split of the layers into stages, the stages' per-micro-batch times add up to at least
the work W of one micro-batch on one tp group (compute, tp communication, recomputation; the
sends and ZeRO-3 gathers only add), so with m micro-batches on pp stages
    1F1B / GPipe:  (m - 1) max_s t_s + sum_s t_s  >=  W (m - 1 + pp) / pp
    interleaved:   m max_s t_s + (sum_s t_s - max_s t_s) / v  >=  W (m / pp + (pp - 1) / (pp v))
(both increase with max_s t_s >= sum_s t_s / pp; the second is the first at v = 1)
and the optimizer step is at least that of the stage holding 1/pp of the parameters; the
data-parallel sync is at least 0. For a tensor-parallel layout not yet solved (the ILP's), W
is bounded by every node split perfectly over tp with no communication (`ideal_layouts`): no
strategy splits a node's work over more than tp devices.

Memory: whatever the split, the stages' peaks add up to at least the model state of every
parameter (ZeRO's per-parameter bytes, without ZeRO-3's gather buffer) plus what each stage
keeps per in-flight micro-batch times the fewest micro-batches any stage holds, so the largest
peak is at least 1/pp of that (`memory_lower_bound`): a configuration above the device's
memory cannot fit under any split and is not evaluated.

The bar (`Bar`) keeps every candidate that can still appear in what the plan reports: the
best, the top-k alternatives and the best of another mesh. A candidate is dropped only if its
bound exceeds the (k+1)-th best step time among distinct meshes found so far, so the result
is the same as evaluating everything (tests/planner/test_search_optimality.py).
"""

from __future__ import annotations

import functools
import math

from planner.cluster.mesh import contiguous_axes
from planner.cost.memory import state_bytes_per_param
from planner.cost.schedules import inflight_microbatches
from planner.evaluate.layer_table import LayerTable
from planner.graph.opgraph import OpGraph
from planner.intra_op.layout_map import LayoutMap
from planner.intra_op.node_layout import NodeLayout
from planner.parallel import data
from planner.placements import shard


def table_work(table: LayerTable, checkpointing: bool) -> float:
    """W: one micro-batch's time on one tp group, summed over all layers."""
    work = sum(
        table.range_sum(f"all:{k}", 0, table.num_positions)
        for k in ("fwd", "bwd", "comm_fwd", "comm_bwd")
    )
    if checkpointing:
        n = table.num_positions
        work += table.range_sum("inside:fwd", 0, n) + table.range_sum("inside:comm_fwd", 0, n)
    return work


def zero3_rate(cm, cluster, cfg, per) -> float:
    """Seconds per parameter element of ZeRO-3's per-micro-batch gathers and reduce-scatter,
    on the fastest dp axis of any stage (the time is linear in the bytes)."""
    rates = []
    for s in range(cfg.pp):
        axis = contiguous_axes(cluster, s * cfg.dp * cfg.tp, (cfg.dp, cfg.tp))[0]
        rates.append(data.zero3_exposed(cm, axis, 1, per, 0.0, 0.0))
    return min(rates)


def p2p_lower_bound(cm, table: LayerTable, cfg) -> float:
    """Each of the pp x v - 1 chunk boundaries sends an activation forward and its gradient
    back: at least the smallest cut on the fastest link between neighbouring stages."""
    chunks = cfg.pp * cfg.virtual_stages
    if chunks == 1 or table.num_positions < 2:
        return 0.0
    cut = min(table.cut_bytes[1 : table.num_positions]) / cfg.tp
    step = cfg.dp * cfg.tp
    pairs = {(s, (s + 1) % cfg.pp) for s in range(cfg.pp) if s + 1 < cfg.pp or chunks > cfg.pp}
    fastest = min(cm.send_recv(cut, cm.p2p_axis(a * step, b * step)) for a, b in pairs)
    return 2 * (chunks - 1) * fastest


def memory_lower_bound(table: LayerTable, cfg, dtype: str, optimizer: str) -> float:
    """A lower bound on predict(...).peak_memory_bytes of `cfg` under `table`'s layout, for
    any split of the layers into stages (see the module's docstring)."""
    n = table.num_positions
    params = table.range_sum("all:params", 0, n)  # tied copies only add
    states = params * state_bytes_per_param(dtype, optimizer, cfg.zero, cfg.dp)
    if cfg.checkpointing:
        kept = sum(table.layer_inputs[:n]) + table.range_sum("outside:saved", 0, n)
    else:
        kept = table.range_sum("all:saved", 0, n)
    fewest = _fewest_inflight(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
    # predict truncates each stage's activation bytes to an integer: at most 1 byte each.
    return (states + kept * fewest) / cfg.pp - 1


@functools.cache  # asked for every variant the search considers, pruned or not
def _fewest_inflight(schedule: str, pp: int, microbatches: int, v: int) -> float:
    return min(inflight_microbatches(schedule, s, pp, microbatches, v) for s in range(pp))


def _compute(table: LayerTable, checkpointing: bool) -> float:
    n = table.num_positions
    out = table.range_sum("all:fwd", 0, n) + table.range_sum("all:bwd", 0, n)
    return out + (table.range_sum("inside:fwd", 0, n) if checkpointing else 0.0)


def step_lower_bound(
    table: LayerTable,
    cfg,
    optimizer: str,
    mem_rate: float,
    work: float | None = None,
    zero3: tuple[float, float] | None = None,
    p2p: float = 0.0,
) -> float:
    """A lower bound on predict(...).step_time_s of `cfg` under `table`'s layout (or any
    layout whose table is at least as large everywhere). `zero3` = (zero3_rate, overlap):
    summed over stages, ZeRO-3's exposed communication is at least that of all parameters
    less what all the compute hides. `p2p`: what the pipeline sends add at least
    (p2p_lower_bound)."""
    w = (table_work(table, cfg.checkpointing) if work is None else work) + p2p
    if zero3 is not None and cfg.zero == 3 and cfg.dp > 1:
        rate, overlap = zero3
        params = table.range_sum("all:params", 0, table.num_positions)
        compute = _compute(table, cfg.checkpointing)
        w += max(0.0, rate * params - overlap * compute)
    pp, m = cfg.pp, cfg.microbatches
    pipe = w * (m / pp + (pp - 1) / (pp * cfg.virtual_stages))
    params = table.range_sum("all:params", 0, table.num_positions) / pp
    return pipe + data.optimizer_step_time(params, cfg.zero, cfg.dp, optimizer, mem_rate)


def ideal_layouts(graph: OpGraph, tp: int) -> LayoutMap:
    """Every node's work and parameters split over tp, no communication: a table built from
    these is below that of any tensor-parallel layout on tp devices. A node's ideal layout
    depends on the node alone, so identical layers share their first's (a LayoutMap)."""
    split = shard(0)
    source = graph.layer_groups
    return LayoutMap(
        graph,
        {
            n.name: NodeLayout(
                strategy="ideal",
                compute_shards=tp,
                saved_shards=tp,
                params={p: split for p in n.params},
            )
            for n in graph.nodes
            if n.layer is None or source[n.layer] == n.layer
        },
        dict(source),
    )


class Bar:
    """The (k+1)-th best step time among distinct meshes found so far (inf until then)."""

    def __init__(self, top_k: int):
        self.keep = top_k + 1
        self.best_per_mesh: dict[tuple, float] = {}
        self.value = math.inf

    def add(self, mesh: tuple, step_time: float) -> None:
        if step_time >= self.best_per_mesh.get(mesh, math.inf):
            return
        self.best_per_mesh[mesh] = step_time
        if len(self.best_per_mesh) >= self.keep:
            self.value = sorted(self.best_per_mesh.values())[self.keep - 1]

    def beaten(self, bound: float) -> bool:
        """Whether a candidate with this lower bound cannot matter."""
        return bound > self.value * (1 + 1e-9)
