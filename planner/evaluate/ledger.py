"""The ledger a plan predicts: per pipeline chunk, per step and per rank, the collectives by
kind and mesh axis (calls, bytes) and the bytes held of parameters, gradients and optimizer
state. The executor measures the same ledger (executor.ledger) and the tests compare them.

Its terms come from what the time terms are computed from: the layouts' tensor-parallel
events (planner.intra_op: per micro-batch forward and backward, per step), the pipeline's
cut activations (planner.parallel.pipeline), and the data-parallel messages of
planner.parallel.data (one per FSDP2 unit: each layer block, and the stage's other
parameters), fp8's amax reductions (planner.parallel.fp8) and, for plans run in graph mode,
its boundary sends and loss reductions (planner.evaluate.ledger_graph). Bytes follow the
cost model's convention: the logical size of a collective (an all-gather's output, a
reduce-scatter's input).

How the executor runs data parallelism (executor.data_parallel, executor.training): FSDP2's
`replicate` (ZeRO-0: one all-reduce of each unit's gradients per step), executor.zero1
(ZeRO-1: whole gradients, each unit's reduce-scattered and its parameters all-gathered once a
step, in fp32 flat buffers), or `fully_shard` (ZeRO-2: parameters gathered for the step's
first forward and kept until the last backward, gradients reduce-scattered once; ZeRO-3:
gathered for each micro-batch's forward and backward, the root unit's kept between them,
and under a pipeline schedule reduced once, otherwise each micro-batch). FSDP2 pads each
parameter's first dim to a multiple of the shard count; gathers move parameters in the
compute dtype, reductions gradients in fp32 (graph mode's ZeRO-0: executor.graph_data_parallel)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from functools import partial

import numpy as np

from planner.cost.schedule_v import device_of_chunk
from planner.evaluate.config import ParallelConfig, assign_chunks
from planner.evaluate.ledger_graph import crossing_values, graph_loss, graph_pipeline
from planner.evaluate.ledger_tensor import recomputed, tensor_parallel
from planner.graph.opgraph import OpGraph, TensorMeta
from planner.intra_op.node_layout import NodeLayout
from planner.parallel import data, expert, fp8
from planner.parallel.context import AttentionBytes
from planner.parallel.registry import exchange_of
from planner.placements import REPLICATE, shard_dim
from planner.plan import HeldBytes, LedgerEntry, StageLedger

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MASTER_BYTES = 4  # parameters, gradients and optimizer state are fp32 (executor.precision)
STATE_PER_PARAM = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}  # fp32 tensors


def chunk_size(n: int, parts: int, index: int) -> int:
    """torch.chunk's (and DTensor's Shard's) share of `n` for `index` of `parts`."""
    each = -(-n // parts)
    return max(0, min(each, n - index * each))


class _Comm:
    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self.routed: set[tuple[str, str]] = set()

    def add(self, kind: str, axis: str, nbytes: int, calls: int = 1, routed: bool = False) -> None:
        """`calls` collectives of `nbytes` each; `routed`: the group's mean (LedgerEntry)."""
        entry = self.entries[(kind, axis)]
        entry[0] += calls
        entry[1] += int(nbytes) * calls
        if routed:
            self.routed.add((kind, axis))

    def entries_list(self) -> list[LedgerEntry]:
        return [
            LedgerEntry(kind=k, axis=a, calls=c, bytes=b, routed=(k, a) in self.routed)
            for (k, a), (c, b) in sorted(self.entries.items())
        ]


def _local_shape(meta: TensorMeta, tp_place: str, tp: int, tp_rank: int) -> list[int]:
    shape = list(meta.shape)
    d = shard_dim(tp_place) if tp > 1 else None
    if d is not None and d < len(shape):
        shape[d] = chunk_size(shape[d], tp, tp_rank)
    return shape


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _units(
    layouts, nodes, ep: int = 1, tp: int = 1
) -> dict[object, dict[str, tuple[TensorMeta, str]]]:
    """The chunk's parameters by FSDP2 unit (a layer index, or None for the stage's other
    parameters), each once, with its tp placement; under expert parallelism each layer's
    expert weights are a unit of their own, (EXPERTS, layer), holding 1 / ep of the experts
    and, where tp splits their features, 1 / tp of those, as plain tensors (their shape the
    rank's: executor.expert_parallel wraps them on the expert-data-parallel group)."""
    units: dict[object, dict[str, tuple[TensorMeta, str]]] = defaultdict(dict)
    seen: set[str] = set()
    for node in nodes:
        for name, meta in node.params.items():
            if name in seen:
                continue
            seen.add(name)
            unit = node.layer
            place = layouts[node.name].params.get(name, REPLICATE)
            if ep > 1 and expert.is_expert_weight(name, meta.shape):
                unit = (EXPERTS, node.layer)
                shape = _local_shape(meta, place, tp, 0)
                meta = meta.model_copy(update={"shape": [shape[0] // ep, *shape[1:]]})
                place = REPLICATE
            units[unit][name] = (meta, place)
    return units


EXPERTS = "experts"


def _is_experts(unit) -> bool:
    return isinstance(unit, tuple) and unit[0] == EXPERTS


def _step_gradient_scale(config: ParallelConfig, dtype: str, graph_mode: bool) -> float:
    """A tp-replicated weight's gradient, reduced over tp once a step, in fp32 bytes over the
    compute dtype's where it is fp32 when reduced, else 1. FSDP2 (which wraps every module
    path stage in bf16/fp16: executor.data_parallel) reduces the partial gradient as it
    finds it: in the compute dtype when it reduces in the backward that made it, in fp32
    when it accumulated it first (FSDPParam.to_accumulated_grad_if_needed upcasts to the
    reduce dtype): under torch's pipeline schedules, which turn the sync off, and over
    several micro-batches at ZeRO 0-2 (executor.training.accumulate). Graph mode keeps
    fp32 weights (autocast), so fp32 gradients."""
    accumulated = config.pp > 1 or (config.microbatches > 1 and config.zero != 3)
    return MASTER_BYTES / COMPUTE_BYTES[dtype] if graph_mode or accumulated else 1.0


def data_axes(config: ParallelConfig) -> tuple[str, str | None]:
    """(the axis FSDP2 shards or replicates over, HSDP's replicate axis or None), named as the
    executor's recorder names them (executor.ledger.AXIS_PRIORITY)."""
    if config.hybrid:
        return "dp_shard", "dp_replicate"
    return _dp_name(config), None


def _dp_name(config: ParallelConfig) -> str:
    """The recorder's name for the dp group: "cp" where one replica's cp group is every
    rank, "ep" where one ep group is (DeviceMesh gives both axes the default group, which
    executor.ledger.AXIS_PRIORITY names cp or ep); elsewhere each axis has a group of its
    own."""
    alone = config.tp == config.pp == 1 and config.dp > 1
    if alone and config.cp == config.dp:
        return "cp"
    return "ep" if alone and config.ep == config.dp else "dp"


def stage_ledgers(
    config: ParallelConfig,
    graph: OpGraph,
    layouts: dict[str, NodeLayout],
    ranges: list[tuple[int, int]],
    dtype: str,
    optimizer: str,
    checkpointed: list[int | None],
    sequence_parallel: bool = False,
    kernels: str = "cuda",
    graph_mode: bool = False,
    resharded: list[int | None] | None = None,
    runtime: str = "autopar",
) -> list[StageLedger]:
    """One ledger per pipeline chunk (plan stage), `graph` at the micro-batch size.
    `checkpointed`: per chunk, how many of its first layers recompute (None: all of them
    when the configuration checkpoints); `kernels`: the device's ("cpu": gloo, which has no
    reduce-scatter for context parallelism's backward); `resharded`: per chunk, under
    layer-wise ZeRO how many of its first layers are at ZeRO-3 (None: all); `runtime`: the
    one that runs the plan, where it reduces gradients more often than autopar's executor
    (torchtitan: every micro-batch's backward, planner.runtime), each reduction with its
    gather as predict prices them."""
    chunk_of = assign_chunks(graph, ranges)
    cut = graph.cut_bytes
    tied = _tied_names(graph, chunk_of, config)
    firsts: dict[int, int] = {}  # each device's first chunk carries its once-a-step terms
    for c in range(len(ranges)):
        firsts.setdefault(device_of_chunk(config.schedule, c, config.pp), c)
    out = []
    attention = AttentionBytes.of(graph) if config.cp > 1 else None
    moe = expert.ExpertLayers.of(graph) if config.ep > 1 else None
    by_chunk: dict[int, list] = defaultdict(list)
    for n in graph.nodes:
        by_chunk[chunk_of[n.name]].append(n)
    first_chunk = {name for n in by_chunk[0] for name in n.params}
    crossing = crossing_values(graph, layouts, chunk_of, config.tp) if graph_mode else []
    for c, (a, b) in enumerate(ranges):
        nodes = by_chunk[c]
        comm = _Comm()
        kept_from = None if resharded is None or resharded[c] is None else a + resharded[c]
        reductions = partial(_unit_reductions, config, kept_from, runtime)
        tensor_parallel(
            *(comm, config, nodes, layouts, a, checkpointed[c], reductions),
            step_scale=_step_gradient_scale(config, dtype, graph_mode),
        )
        fp8.scale_reductions(
            comm,
            config,
            nodes,
            layouts,
            partial(recomputed, config, first_layer=a, count=checkpointed[c]),
        )
        _context_parallel(
            comm, config, attention, graph.data.batch, (a, b), checkpointed[c], kernels
        )
        _expert_parallel(comm, config, moe, graph.data.batch, (a, b), checkpointed[c])
        units = _units(layouts, nodes, config.ep, config.tp)
        # tied copies beyond the first stage's are left out of the gradient norm
        uncounted = first_chunk if c != 0 else set()
        _data_parallel(comm, config, units, dtype, uncounted, kept_from, runtime)
        if graph_mode:
            graph_pipeline(comm, config, c, crossing)
            graph_loss(comm, config, nodes, layouts)
        else:
            shards = (config.tp if sequence_parallel else 1) * config.cp
            _pipeline(comm, config, ranges, c, cut, shards)
        _tied(comm, config, units, tied)
        if c in firsts.values():
            _per_step(comm, config, dtype)
        # uneven shards: each rank its own; else the first rank's for all
        held = _held_by_rank(config, units, optimizer, uncounted, not _even(config, units))
        out.append(StageLedger(comm=comm.entries_list(), held=held))
    return out


def _even(config, units) -> bool:
    """Whether every rank of a stage holds as many elements as its first: each sharded dim
    divides by its shard count (tp, and ZeRO 2-3's on dim 0)."""
    shards = config.shard_degree if config.zero > 1 and config.dp > 1 else 1
    for unit, group in units.items():
        if _is_experts(unit):
            edp = config.edp if config.zero > 1 else 1
            if any(meta.shape[0] % edp for meta, _ in group.values()):
                return False
            continue
        for meta, place in group.values():
            d = shard_dim(place) if config.tp > 1 else None
            if d is not None and d < len(meta.shape) and meta.shape[d] % config.tp:
                return False
            local = _local_shape(meta, place, config.tp, 0)
            if shards > 1 and local and local[0] % shards:
                return False
    return True


def _context_parallel(
    comm: _Comm, config, attention, mbs: int, layers: tuple[int, int], count, kernels: str
) -> None:
    """Each layer's sequence exchange on the cp group (its SequenceExchange's collectives),
    each micro-batch: its forward's again where the layer recomputes, its backward's once."""
    if config.cp == 1:
        return
    m = config.microbatches
    exchange = exchange_of(config.cp_comm)
    for layer in range(*layers):
        terms = exchange.terms(attention.at(layer, mbs), config.cp, config.tp, kernels)
        again = recomputed(config, layer, layers[0], count)
        for c in terms.forward:
            comm.add(c.kind, "cp", c.nbytes, c.count * m * (2 if again else 1))
        for c in terms.backward:
            comm.add(c.kind, "cp", c.nbytes, c.count * m)


def _expert_parallel(comm: _Comm, config, moe, mbs: int, layers: tuple[int, int], count) -> None:
    """Each MoE layer's dispatch and combine all-to-alls on the ep group, each micro-batch:
    forward (again where the layer recomputes) and backward; routed (dropless) dispatch
    first exchanges each expert's row count (one int64 per expert), and its token bytes are
    the group's mean (planner.parallel.expert.ExpertLayers) of a rank's tokens (1 / cp of
    the micro-batch's under context parallelism, 1 / tp folded over tp)."""
    if config.ep == 1:
        return
    m = config.microbatches
    for layer in range(*layers):
        calls = moe.moe_layers[layer]
        if not calls:
            continue
        # a cp (folded: tp) rank's tokens
        each = round(
            moe.exchanged[layer] / calls * mbs / config.cp / (config.tp if config.folded else 1)
        )
        forwards = calls * m * (2 if recomputed(config, layer, layers[0], count) else 1)
        if moe.routed:
            comm.add("all_to_all", "ep", 8 * moe.experts, forwards, routed=True)
        comm.add("all_to_all", "ep", each, 2 * forwards, routed=moe.routed)
        comm.add("all_to_all", "ep", each, 2 * calls * m, routed=moe.routed)


def _padded(meta: TensorMeta, tp_place: str, config, shards: int) -> int:
    """Elements of a parameter as FSDP2 gathers it: its tp-local shape (tp rank 0's, the
    largest) with dim 0 padded to a multiple of the shard count."""
    shape = _local_shape(meta, tp_place, config.tp, 0)
    if not shape:
        return shards
    rows = -(-shape[0] // shards) * shards
    return rows * _numel(shape[1:])


def zero1_flats(config, params: dict, uncounted: set[str], tp_rank: int = 0) -> list[int]:
    """ZeRO-1's flat buffers of one unit (executor.zero1): its parameters' tp-local elements
    grouped by whether tp shards them and whether the gradient norm counts them."""
    flats: dict[tuple[bool, bool], int] = defaultdict(int)
    for name, (meta, place) in params.items():
        sharded = config.tp > 1 and shard_dim(place) is not None
        flats[(sharded, name not in uncounted)] += _numel(
            _local_shape(meta, place, config.tp, tp_rank)
        )
    return list(flats.values())


def _data_parallel(
    comm: _Comm,
    config,
    units,
    dtype: str,
    uncounted: set[str],
    kept_from: int | None = None,
    runtime: str = "autopar",
) -> None:
    """Each FSDP2 unit's collectives at the plan's ZeRO level; under layer-wise ZeRO the
    layers from `kept_from` on at ZeRO-2's."""
    if config.dp == 1:
        return
    axis, replicate = data_axes(config)
    zero = config.zero
    shards = config.shard_degree
    for unit, params in units.items():
        if _is_experts(unit):
            _expert_data_parallel(comm, config, params, dtype, runtime)
            continue
        syncs = _unit_reductions(config, kept_from, runtime, unit)
        if zero == 1:  # one reduce-scatter and one all-gather per flat buffer, fp32
            for n in zero1_flats(config, params, uncounted):
                padded = -(-n // config.dp) * config.dp * MASTER_BYTES
                comm.add("reduce_scatter", axis, padded, syncs)
                comm.add("all_gather", axis, padded, syncs)
            continue
        if zero == 0:
            elems = sum(_numel(_local_shape(m_, pl, config.tp, 0)) for m_, pl in params.values())
            comm.add("all_reduce", axis, elems * MASTER_BYTES, syncs)
            continue
        elems = sum(_padded(meta, pl, config, shards) for meta, pl in params.values())
        gathers, reductions = _fsdp_counts(config, _unit_level(config, kept_from, unit), runtime)
        comm.add("all_gather", axis, elems * COMPUTE_BYTES[dtype], gathers)
        comm.add("reduce_scatter", axis, elems * MASTER_BYTES, reductions)
        if replicate is not None:
            comm.add("all_reduce", replicate, elems // shards * MASTER_BYTES, reductions)


def _unit_level(config, kept_from: int | None, unit) -> int:
    """The ZeRO level of an FSDP2 unit (a layer index, None for the stage's other parameters):
    the plan's, or under layer-wise ZeRO 2 for the layers from `kept_from` on."""
    kept = kept_from is not None and isinstance(unit, int) and unit >= kept_from
    return 2 if kept else config.zero


def _unit_reductions(config, kept_from: int | None, runtime: str, layer) -> int:
    """How often a step reduces the gradients of a layer's FSDP2 unit (None: the stage's
    other parameters) over dp, as `runtime` runs it (autopar's executor: once a step but at
    ZeRO-3 without a pipeline)."""
    level = _unit_level(config, kept_from, layer)
    return data.reductions_per_step(config, runtime, level)


def _fsdp_counts(config, zero: int | None = None, runtime: str = "autopar") -> tuple[int, int]:
    """(gathers, reductions) of one FSDP2 unit a step under ZeRO 2-3 (`zero`: the unit's
    level, by default the plan's); at ZeRO-2 a runtime reducing every backward gathers
    again for the next forward (predict's gradient sync: both, per reduction)."""
    zero = config.zero if zero is None else zero
    reductions = data.reductions_per_step(config, runtime, zero)
    if zero == 3 and config.pp == 1:  # forward and backward each micro-batch
        return 2 * config.microbatches, reductions
    if zero == 3:
        # under a pipeline schedule each forward gathers, the first backward gathers
        # again and keeps the parameters until the step's reduction (torch's stage sets
        # reshard_after_backward off until then); the schedule reduces once
        return config.microbatches + 1, reductions
    return reductions, reductions


def _expert_data_parallel(comm: _Comm, config, params, dtype: str, runtime: str) -> None:
    """A layer's expert weights (1 / ep of the experts) over the expert-data-parallel group,
    the ranks that hold the same experts: the dense units' collectives at the plan's ZeRO
    level, on that group (none where it is one rank)."""
    edp = config.edp
    if edp == 1:
        return
    syncs = data.reductions_per_step(config, runtime)
    if config.zero == 0:
        elems = sum(_numel(meta.shape) for meta, _ in params.values())
        comm.add("all_reduce", "edp", elems * MASTER_BYTES, syncs)
        return
    if config.zero == 1:  # a distributed optimizer's flat buffer over the group (Megatron's)
        elems = sum(_numel(meta.shape) for meta, _ in params.values())
        padded = -(-elems // edp) * edp * MASTER_BYTES
        comm.add("reduce_scatter", "edp", padded, syncs)
        comm.add("all_gather", "edp", padded, syncs)
        return
    elems = sum(
        -(-meta.shape[0] // edp) * edp * _numel(meta.shape[1:]) for meta, _ in params.values()
    )
    gathers, reductions = _fsdp_counts(config, runtime=runtime)
    comm.add("all_gather", "edp", elems * COMPUTE_BYTES[dtype], gathers)
    comm.add("reduce_scatter", "edp", elems * MASTER_BYTES, reductions)


def _pipeline(comm: _Comm, config, ranges, c: int, cut: list[int], shards: int) -> None:
    """Each micro-batch's activation sent forward and its gradient back, between chunks on
    different devices; `shards`: the tp shards each rank sends one of (sequence parallelism's
    sequence shards), 1 where every tp rank sends the whole tensor."""
    p, m = config.pp, config.microbatches
    if p == 1:
        return
    here = device_of_chunk(config.schedule, c, p)
    if c + 1 < len(ranges) and device_of_chunk(config.schedule, c + 1, p) != here:
        nbytes = cut[ranges[c][1]] // shards
        comm.add("send", "pp", nbytes, m)
        comm.add("recv", "pp", nbytes, m)
    if c > 0 and device_of_chunk(config.schedule, c - 1, p) != here:
        nbytes = cut[ranges[c][0]] // shards
        comm.add("recv", "pp", nbytes, m)
        comm.add("send", "pp", nbytes, m)


def _tied_names(graph: OpGraph, chunk_of: dict[str, int], config) -> set[str]:
    """Parameters used on two devices' chunks (tied embeddings across a pipeline): each
    device holds a copy and their gradients are summed."""
    devices: dict[str, set[int]] = defaultdict(set)
    for node in graph.nodes:
        for name in node.params:
            devices[name].add(device_of_chunk(config.schedule, chunk_of[node.name], config.pp))
    return {name for name, where in devices.items() if len(where) > 1}


def _tied(comm: _Comm, config, units, tied: set[str]) -> None:
    """The tied copies' gradients all-reduced between the two devices, each rank its own
    shard (the module path places both copies alike: executor.pipeline.sum_tied_grads)."""
    for group in units.values():
        for name, (meta, place) in group.items():
            if name in tied:
                held = _held_elements(meta, place, config, 0, 0)
                comm.add("all_reduce", "tied", held * MASTER_BYTES)


def _per_step(comm: _Comm, config, dtype: str) -> None:
    """Once a step on every rank: the global gradient norm's all-reduce (one float64 over all
    ranks), under fp16's loss scaling the finite-gradients flag's (one float32, a MIN over
    all ranks: executor.precision.LossScaler) and, with a pipeline, the barrier before the
    tied embeddings are summed."""
    if config.pp * config.dp * config.tp > 1:
        comm.add("all_reduce", world_axis(config), 8)
        if dtype == "fp16":
            comm.add("all_reduce", world_axis(config), 4)
    if config.pp > 1:
        comm.add("barrier", "pp", 0)


def world_axis(config) -> str:
    """The name the recorder gives the group of all ranks: the mesh axis that spans them
    (DeviceMesh reuses the default group there), else "world"."""
    world = config.pp * config.dp * config.tp
    if config.tp == world:
        return "tp"
    if config.folded and config.ep == world:  # ep over dp x tp, every rank
        return "ep"
    if config.dp == world:
        return _dp_name(config)
    if config.pp == world:
        return "pp"
    return "world"


def _held_elements(meta: TensorMeta, place: str, config, dp_rank: int, tp_rank: int) -> int:
    """A parameter's elements on one rank: its tp shard, and under ZeRO 2-3 FSDP2's share of
    that shard's dim 0 (HSDP: within the rank's shard group)."""
    shape = _local_shape(meta, place, config.tp, tp_rank)
    shards = config.shard_degree if config.zero > 1 and config.dp > 1 else 1
    if shards > 1 and shape:
        shape[0] = chunk_size(shape[0], shards, dp_rank % shards)
    return _numel(shape)


def _held_by_rank(config, units, optimizer: str, uncounted, every: bool) -> list[HeldBytes]:
    """What each rank of the chunk holds (`every`; else the first rank only), dp rank by dp
    rank, tp rank within: tp-local parameters (FSDP2's dp shard of dim 0 under ZeRO 2-3),
    gradients alike, optimizer state per element it steps (under ZeRO-1 its shard of each
    padded flat buffer: executor.zero1). Each tp rank's parameters are walked once, their
    dim-0 shares for every shard index at once (a dp of 512 times a tp of 2 would otherwise
    walk every parameter 1,024 times)."""
    shards = config.shard_degree if config.zero > 1 and config.dp > 1 else 1
    edp = config.edp
    expert_shards = edp if config.zero > 1 else 1
    index = np.arange(shards)
    per_tp = []
    for tp_rank in range(config.tp if every else 1):
        elements = np.zeros(shards, dtype=np.int64)
        experts = np.zeros(expert_shards, dtype=np.int64)  # by expert-data-parallel rank
        for unit, group in units.items():
            if _is_experts(unit):
                for meta, _ in group.values():
                    each = -(-meta.shape[0] // expert_shards)
                    rows = np.clip(meta.shape[0] - np.arange(expert_shards) * each, 0, each)
                    experts += rows * _numel(meta.shape[1:])
                continue
            for meta, place in group.values():
                shape = _local_shape(meta, place, config.tp, tp_rank)
                if shards > 1 and shape:
                    each = -(-shape[0] // shards)
                    dim0 = np.clip(shape[0] - index * each, 0, each)  # chunk_size per index
                    elements += dim0 * _numel(shape[1:])
                else:
                    elements += _numel(shape)
        stepped = None
        if config.zero == 1 and config.dp > 1:
            stepped = sum(
                -(-n // (edp if _is_experts(unit) else config.dp))
                for unit, group in units.items()
                for n in zero1_flats(config, group, uncounted, tp_rank)
            )
        per_tp.append((elements, experts, stepped))
    out = []
    for dp_rank in range(config.dp if every else 1):
        for tp_rank, (elements, experts, stepped) in enumerate(per_tp):
            # ep neighbouring dp ranks (folded: ranks) hold different experts; ZeRO shards
            # across the groups
            rank = dp_rank * config.tp + tp_rank if config.folded else dp_rank
            group = rank // config.ep % expert_shards
            params = int(elements[dp_rank % shards] + experts[group])
            out.append(
                HeldBytes(
                    params=params * MASTER_BYTES,
                    grads=params * MASTER_BYTES,
                    # ZeRO-1 steps fp32 master shards of its whole parameters: held too
                    optimizer=(
                        params * STATE_PER_PARAM[optimizer]
                        if stepped is None
                        else stepped * (STATE_PER_PARAM[optimizer] + 1)
                    )
                    * MASTER_BYTES,
                )
            )
    return out


def rank_ledger(plan, rank: int) -> tuple[dict[tuple[str, str], tuple[int, int]], dict[str, int]]:
    """What the plan predicts for one rank: {(kind, axis): (calls, bytes)} summed over the
    stages it holds, and its held bytes by kind."""
    comm: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    held = {"params": 0, "grads": 0, "optimizer": 0}
    for stage in plan.stages:
        ledger = stage.predicted.ledger
        if rank not in stage.ranks or ledger is None:
            continue
        for e in ledger.comm:
            comm[(e.kind, e.axis)][0] += e.calls
            comm[(e.kind, e.axis)][1] += e.bytes
        held_here = ledger.held[stage.ranks.index(rank) if len(ledger.held) > 1 else 0]
        for kind, value in held_here.model_dump().items():
            held[kind] += value
    return {k: (c, b) for k, (c, b) in comm.items()}, held
