"""Lower bounds on a configuration's predicted step time, so whole families of candidates are
dropped before they are evaluated, and the bar they must clear.

For any split of the layers into stages, the stages' per-micro-batch times add up to at least
the work W of one micro-batch on one tp group (compute, tp communication, recomputation; the
sends and ZeRO-3 gathers only add), so with m micro-batches on pp stages
    1F1B / GPipe:  (m - 1) max_s t_s + sum_s t_s  >=  W (m - 1 + pp) / pp
    interleaved:   m max_s t_s + (sum_s t_s - max_s t_s) / v  >=  W (m / pp + (pp - 1) / (pp v))
    zero bubble:   m max_s t_s + (fill and drain >= 0)    >=  W m / pp
(all increase with max_s t_s >= sum_s t_s / pp; the second is the first at v = 1)
and the optimizer step is at least that of the stage holding 1/pp of the parameters; the
data-parallel sync is at least 0. For a tensor-parallel layout not yet solved (the ILP's), W
is bounded by every node split perfectly over tp with no communication (`ideal_layouts`): no
strategy splits a node's work over more than tp devices.

Memory: stage s's peak is at least the model state of its parameters (ZeRO's per-parameter
bytes, without ZeRO-3's gather buffer) plus what it keeps per in-flight micro-batch times the
f_s micro-batches it holds. Whatever the split, the largest peak is at least any weighted
mean of the stages' peaks, sum_s w_s peak_s, which is at least sum over layer positions of
min_s w_s (state_i + kept_i f_s) (`memory_lower_bound`). Weights w_s proportional to
1 / (state + kept f_s) of the whole model make it exact for identical layers (each stage then
holds layers in inverse proportion to its per-layer load). The first and last stages also
bound it alone (they hold the first and last positions: the LM head's logits in every
micro-batch the last stage holds), and every stage adds at least the smallest layer's
rebuilt activations (checkpointing) and gathered parameters (ZeRO-3). A configuration above
the device's memory cannot fit under any split and is not evaluated.

The bar (`Bar`) keeps every candidate that can still appear in what the plan reports: the
best, the top-k alternatives and the best of another mesh. A candidate is dropped only if its
bound exceeds the (k+1)-th best step time among distinct meshes found so far, so the result
is the same as evaluating everything (tests/planner/test_search_optimality.py).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter

from planner.cost.memory import bytes_per_param, state_bytes_per_param
from planner.cost.schedule_v import V_SHAPED
from planner.cost.schedules import WEIGHT_SPLIT, inflight_microbatches
from planner.evaluate.layer_table import LayerTable
from planner.evaluate.node_costs import IDEAL
from planner.graph.opgraph import OpGraph
from planner.intra_op.layout_map import LayoutMap
from planner.intra_op.node_layout import NodeLayout
from planner.parallel import data
from planner.parallel.checkpointing import (
    OP_POLICIES,
    PARTIAL,
    kept_per_layer,
    rebuilt_of,
    recompute_of,
    recomputes,
)
from planner.parallel.registry import store_of
from planner.placements import shard
from planner.runtime import runtime_of


def table_work(table: LayerTable, checkpointing, cluster=None) -> float:
    """W: one micro-batch's time on one tp group, summed over all layers (under an
    activation store, with the cluster known and holding it, its copies too: every
    layer's, out and back)."""
    n = table.num_positions
    work = sum(table.range_sum(f"all:{k}", 0, n) for k in ("fwd", "bwd", "comm_fwd", "comm_bwd"))
    store = store_of(checkpointing)
    if store is not None and cluster is not None and store.refusal(cluster) is None:
        work += store.transfer_time(cluster, table.range_sum("inside:saved", 0, n))
    return work + recompute_of(table, 0, n, checkpointing)


def partial_recompute_floor(table: LayerTable, cfg, training, capacity: float) -> float:
    """Partial checkpointing's least recomputation per micro-batch, summed over stages. With
    weights w_s summing to 1, sum_s w_s peak_s is at most the device's memory where the
    configuration fits, and without checkpointing at least the weighted bound S (for any
    split); a checkpointed layer on stage s saves at most f_s times its kept bytes less its
    input's (its rebuild only adds back), so at least (S - capacity) / (most saved x
    max_s w_s f_s) layers are checkpointed, costing at least the cheapest layers'
    recomputation. Zero for the other checkpointing modes."""
    if cfg.checkpointing != PARTIAL:
        return 0.0
    shards = cfg.shard_degree
    per_param = _state_per_param(
        cfg, training.dtype, training.optimizer, cfg.zero, shards, cfg.offload, training.runtime
    )
    found = _weighted_sum(table, cfg, per_param, False)
    if found is None or found[0] - cfg.pp <= capacity:  # predict truncates to whole bytes
        return 0.0
    if "partial_floor" not in table.derived:
        plain, partial = _memory_rows(table, False), _memory_rows(table, PARTIAL)
        most = max(a[1] - b[1] for a, b in zip(plain, partial, strict=True))
        n = table.num_positions
        costs = sorted(recompute_of(table, i, i + 1, True) for i in range(n))
        table.derived["partial_floor"] = (most, [0.0, *itertools.accumulate(costs)])
    most, cheapest = table.derived["partial_floor"]
    inflight = _inflight(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
    per_layer = most * max(w * f for w, f in zip(found[3], inflight, strict=True))
    if per_layer <= 0:
        return 0.0
    layers = math.ceil((found[0] - cfg.pp - capacity) / per_layer)
    return cheapest[min(layers, len(cheapest) - 1)]


def zero3_rate(cm, cluster, cfg, per) -> float:
    """Seconds per parameter element of ZeRO-3's per-micro-batch gathers and reduce-scatter,
    on the fastest dp axis of any stage: the bandwidth term alone (one message of 2^40
    elements; per-layer messages only add latency)."""
    rates = []
    many = 2**40
    for s in range(cfg.pp):
        # HSDP gathers on its shard axis (the replicas' all-reduce left out: a lower bound)
        axis = data.data_axes(cluster, s * cfg.dp * cfg.tp, cfg)[0]
        rates.append(data.zero3_exposed(cm, axis, many, per, 0.0, 0.0, many) / many)
    return min(rates)


def p2p_lower_bound(cm, table: LayerTable, cfg) -> float:
    """Each of the pp x v - 1 chunk boundaries (ZB-V: but the one inside device pp - 1) sends
    an activation forward and its gradient back: at least the smallest cut on the fastest
    link between neighbouring stages."""
    chunks = cfg.pp * cfg.virtual_stages
    if chunks == 1 or table.num_positions < 2:
        return 0.0
    cut = min(table.cut_bytes[1 : table.num_positions]) / cfg.tp
    step = cfg.dp * cfg.tp
    pairs = {(s, (s + 1) % cfg.pp) for s in range(cfg.pp) if s + 1 < cfg.pp or chunks > cfg.pp}
    fastest = min(cm.send_recv(cut, cm.p2p_axis(a * step, b * step)) for a, b in pairs)
    crossing = chunks - 2 if cfg.schedule in V_SHAPED else chunks - 1  # ZB-V turns on a device
    return 2 * crossing * fastest


def memory_lower_bound(
    table: LayerTable, cfg, dtype: str, optimizer: str, runtime: str = "autopar"
) -> float:
    """A lower bound on predict(...).peak_memory_bytes of `cfg` under `table`'s layout, for
    any split of the layers into stages (see the module's docstring)."""
    bounds = (_even_bound, _weighted_bound)
    return max(bound(table, cfg, dtype, optimizer, runtime) for bound in bounds)


def fits_nowhere(
    table: LayerTable, cfg, dtype: str, optimizer: str, capacity: int, runtime: str = "autopar"
) -> bool:
    """memory_lower_bound(...) > capacity, trying the cheaper bound first."""
    return (
        _even_bound(table, cfg, dtype, optimizer, runtime) > capacity
        or _weighted_bound(table, cfg, dtype, optimizer, runtime) > capacity
    )


def memory_floor(
    table: LayerTable, cfg, dtype: str, optimizer: str, zeros, ckpts, runtime: str = "autopar"
) -> float:
    """At most memory_lower_bound(...) of `cfg` with any of the ZeRO levels `zeros` and
    checkpointing choices `ckpts`: when it exceeds the device, none of them can fit."""
    per_param = min(
        _state_per_param(cfg, dtype, optimizer, z, cfg.dp, False, runtime) for z in zeros
    )
    kept = min(_memory_totals(table, c)[1] for c in ckpts)
    fewest = min(_inflight(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages))
    return (_memory_totals(table, False)[0] * per_param + kept * fewest) / cfg.pp - 1


def _even_bound(table: LayerTable, cfg, dtype: str, optimizer: str, runtime: str) -> float:
    """Every stage holding as few micro-batches as the stage that holds fewest."""
    params, kept = _memory_totals(table, cfg.checkpointing)
    per_param = _state_per_param(
        cfg, dtype, optimizer, cfg.zero, cfg.shard_degree, cfg.offload, runtime
    )
    fewest = min(_inflight(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages))
    # predict truncates each stage's activation bytes to an integer: at most 1 byte each.
    extra = _per_stage(table, cfg, dtype, optimizer, runtime) - _head_freed(table, cfg)
    return (params * per_param + kept * fewest) / cfg.pp + extra - 1


def _weighted_bound(table: LayerTable, cfg, dtype: str, optimizer: str, runtime: str) -> float:
    per_param = _state_per_param(
        cfg, dtype, optimizer, cfg.zero, cfg.shard_degree, cfg.offload, runtime
    )
    found = _weighted_sum(table, cfg, per_param, cfg.checkpointing)
    if found is None:
        return -1.0
    bound, first, last, _ = found
    # The first and last stages each hold at least their end position (the LM head's logits
    # on the last, in every micro-batch it holds).
    return max(bound, first, last) + _per_stage(table, cfg, dtype, optimizer, runtime) - 1


def _weighted_sum(table: LayerTable, cfg, per_param: float, checkpointing):
    """(a lower bound on sum_s w_s peak_s for any split, the first and the last position's
    bytes on their stages, the weights w_s), or None where a stage's load is not positive."""
    inflight = _inflight(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
    params, kept = _memory_totals(table, checkpointing)
    loads = [params * per_param + kept * f for f in inflight]
    if min(loads) <= 0:
        return None
    # Weights proportional to 1 / load make the bound exact for identical layers.
    norm = sum(1 / load for load in loads)
    weights = [1 / (load * norm) for load in loads]
    # The first position is on the first stage and the last on the last (chunk 0 starts
    # the model and chunk pp * v - 1 ends it; ZB-V turns it back to the first stage); the
    # others on whichever costs least.
    (p0, k0), (pn, kn), rest, copies = _memory_ends(table, checkpointing)
    if cfg.pp * cfg.virtual_stages > 1:  # in another chunk than the parameter's owner
        pn += copies
    end = 0 if cfg.schedule in V_SHAPED else -1
    first, last = p0 * per_param + k0 * inflight[0], pn * per_param + kn * inflight[end]
    if table.num_positions > 1:
        last += _last_stage_extra(table, cfg)
    else:  # one position, on the one stage: it is the last one too
        first += _last_stage_extra(table, cfg)
    bound = weights[0] * first + weights[end] * last
    bound += sum(
        count * min(w * (p * per_param + k * f) for w, f in zip(weights, inflight, strict=True))
        for p, k, count in rest
    )
    return bound, first, last, weights


def _last_stage_extra(table: LayerTable, cfg) -> float:
    """What the last stage adds beyond its kept bytes, less _per_stage's rebuilt layer: the
    loss's workspace, or (checkpointing's rebuild_peak) a rebuild after the head's saved
    bytes are gone, whichever is larger."""
    workspace = table.range_sum("outside:workspace", 0, table.num_positions)  # once
    if not cfg.checkpointing or cfg.checkpointing == PARTIAL:  # none rebuilt or brought back
        return workspace
    rebuilt = _smallest_layer(table, cfg.checkpointing)[0]
    return max(workspace, rebuilt - table.saved_after(table.num_positions - 1)) - rebuilt


def _head_freed(table: LayerTable, cfg) -> float:
    """Per stage on average, what a rebuild on the last stage does not hold of the head's
    saved bytes (rebuild_peak), which _per_stage's rebuilt layer on every stage assumes."""
    if not cfg.checkpointing or cfg.checkpointing == PARTIAL:  # none rebuilt or brought back
        return 0.0
    return table.saved_after(table.num_positions - 1) / cfg.pp


def _smallest_layer(table: LayerTable, checkpointing) -> tuple[float, float]:
    key = f"smallest_layer:{checkpointing}"
    if key not in table.derived:  # asked for every variant the search bounds
        n = table.num_positions
        table.derived[key] = (
            min(rebuilt_of(table, i, i + 1, checkpointing) for i in range(n)),
            min(table.inside["params"][:n]),
        )
    return table.derived[key]


def _per_stage(table: LayerTable, cfg, dtype: str, optimizer: str, runtime: str) -> float:
    """What every stage adds once, whichever layers it holds (each holds one at least): the
    layer checkpointing rebuilds, ZeRO-3's gathered layer (at least the smallest layer's;
    none where every weight is counted gathered, state_bytes_per_param)."""
    saved, params = _smallest_layer(table, cfg.checkpointing)
    out = saved if cfg.checkpointing and cfg.checkpointing != PARTIAL else 0.0  # k may be 0
    whole = runtime_of(runtime).holds_whole_gradients(
        cfg.zero, cfg.shard_degree, *cfg.dense_state_holding
    )
    whole = whole or _held_chunk_share(cfg, cfg.zero, cfg.shard_degree, runtime) > 0
    if cfg.zero >= 3 and not whole:
        out += params * bytes_per_param(dtype, optimizer).weights
    return out


def _state_per_param(
    cfg, dtype: str, optimizer: str, zero: int, shards: int, offload: bool, runtime: str
) -> float:
    """state_bytes_per_param as every stage holds it at least, for any split: as the runtime
    holds every parameter's (cfg.dense_state_holding); and where a device holds its chunks'
    whole gradients a set at a time (torch's multi-stage schedules reduce each chunk after
    its last backward, schedule_v.gradient_holders), its largest chunk's at least, 1/v of
    its parameters (each chunk is held so at some point, and predict counts the largest
    set held at once)."""
    dense = state_bytes_per_param(
        dtype, optimizer, zero, shards, offload, runtime, *cfg.dense_state_holding
    )
    share = _held_chunk_share(cfg, zero, shards, runtime)
    if not share:
        return dense
    held = state_bytes_per_param(
        dtype, optimizer, zero, shards, offload, runtime, cfg.pp, cfg.microbatches
    )
    return dense + share * (held - dense)


def _held_chunk_share(cfg, zero: int, shards: int, runtime: str) -> float:
    """1/v where the runtime holds whole gradients under this pipeline but a device not all
    its chunks' at once (dense_state_holding prices them as held sharded); else 0. Experts
    are priced apart (dense_state_holding)."""
    if cfg.pp == 1 or cfg.ep != 1 or cfg.dense_state_holding != (1, 1):
        return 0.0
    declared = runtime_of(runtime)
    if declared.holds_whole_gradients(zero, shards, 1, 1):
        return 0.0
    if not declared.holds_whole_gradients(zero, shards, cfg.pp, cfg.microbatches):
        return 0.0
    return 1.0 / cfg.virtual_stages


def _memory_totals(table: LayerTable, checkpointing: bool) -> tuple[float, float]:
    """(parameter elements, bytes kept per in-flight micro-batch) of the whole model."""
    key = f"memory_totals:{checkpointing}"
    if key not in table.derived:
        rows = _memory_rows(table, checkpointing)
        table.derived[key] = (sum(p for p, _ in rows), sum(k for _, k in rows))
    return table.derived[key]


def _memory_rows(table: LayerTable, checkpointing: bool) -> list[tuple[float, float]]:
    """Per layer position: (parameter elements, activation bytes kept per in-flight
    micro-batch)."""
    key = f"memory_rows:{checkpointing}"
    if key not in table.derived:
        n, ins, out = table.num_positions, table.inside, table.outside
        params = [a + b for a, b in zip(ins["params"][:n], out["params"][:n], strict=True)]
        first = (
            [kept_per_layer(table, i, checkpointing) for i in range(n)]
            if checkpointing
            else ins["saved"]
        )
        kept = [a + b for a, b in zip(first[:n], out["saved"][:n], strict=True)]
        table.derived[key] = list(zip(params, kept, strict=True))
    return table.derived[key]


def _memory_ends(table: LayerTable, checkpointing: bool) -> tuple:
    """((params, kept) of the first position, of the last, or (0, 0) when it is the first;
    (params, kept, how many) per distinct position between them; the elements of the copy
    the last position holds of tied parameters the first owns, when they are in two chunks)."""
    key = f"memory_ends:{checkpointing}"
    if key not in table.derived:
        rows = _memory_rows(table, checkpointing)
        last = rows[-1] if len(rows) > 1 else (0, 0)
        owned = {u.name for u in table.uses if u.position == 0}
        copies = sum(
            u.elements
            for u in table.uses
            if u.tied and u.position == len(rows) - 1 > 0 and u.name in owned
        )
        rest = Counter(rows[1:-1])
        table.derived[key] = (rows[0], last, [(p, k, c) for (p, k), c in rest.items()], copies)
    return table.derived[key]


@functools.cache  # asked for every variant the search considers, pruned or not
def _inflight(schedule: str, pp: int, microbatches: int, v: int) -> tuple[float, ...]:
    return tuple(inflight_microbatches(schedule, s, pp, microbatches, v) for s in range(pp))


def _compute(table: LayerTable, checkpointing) -> float:
    n = table.num_positions
    out = table.range_sum("all:fwd", 0, n) + table.range_sum("all:bwd", 0, n)
    if checkpointing in OP_POLICIES:
        return out + table.range_sum(f"inside:{checkpointing}_recompute", 0, n)
    # partial may checkpoint no layer; an activation store recomputes nothing
    full = recomputes(checkpointing) and checkpointing != PARTIAL
    return out + (table.range_sum("inside:fwd", 0, n) if full else 0.0)


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
    fill = 0.0 if cfg.schedule in WEIGHT_SPLIT else (pp - 1) / (pp * cfg.virtual_stages)
    pipe = w * (m / pp + fill)
    params = table.range_sum("all:params", 0, table.num_positions) / pp
    opt = data.optimizer_step_time(params, cfg.zero, cfg.shard_degree, optimizer, mem_rate)
    return pipe + opt


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
                strategy=IDEAL,
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
