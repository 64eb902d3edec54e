"""predict(): a configuration's step time and memory under the cost model, numbers only.

This is what the search calls per candidate, so it builds no Plan (planner.evaluate.to_plan
does that once for the winner). Per pipeline chunk it sums the nodes' compute and
tensor-parallel communication (from a planner.evaluate.layer_table.LayerTable: O(layers)
per configuration, not O(nodes)), adds recomputation (planner.parallel.checkpointing),
point-to-point sends (planner.parallel.pipeline) and the executor's measured overhead; per
pipeline stage the data-parallel terms (planner.parallel.data) and memory; then the
schedule's step time (planner.cost.schedules).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.cluster.mesh import LogicalMesh
from planner.cluster.profile import ClusterProfile
from planner.cost.memory import (
    MemoryBreakdown,
    breakdown,
    bytes_per_param,
    compute_copy_bytes,
    model_state_bytes,
)
from planner.cost.model import CostModel
from planner.cost.schedule_v import chunks_of_device, device_of_chunk, gradient_holders
from planner.cost.schedules import (
    WEIGHT_SPLIT,
    inflight_microbatches,
    pending_weight_bytes,
    pipeline_span,
    split_backward_points,
)
from planner.errors import InputError
from planner.evaluate.chunk_costs import ChunkCost, StageSums, add_overhead, chunk_costs
from planner.evaluate.config import ParallelConfig, split_layers
from planner.evaluate.layer_table import LayerTable, build_table
from planner.graph.opgraph import OpGraph
from planner.intra_op.megatron import tensor_parallel_layout
from planner.intra_op.node_layout import NodeLayout
from planner.parallel import checkpointing, context, data, expert, offload, pipeline
from planner.parallel.registry import store_of
from planner.plan import TrainingSettings


@dataclass(frozen=True)
class StageFigures:
    """One pipeline stage (a rank row of the mesh), per micro-batch time and peak memory."""

    time: float
    compute: float
    comm: float
    memory: MemoryBreakdown
    wgrad: float = 0.0  # parameter-gradient compute per micro-batch (ChunkCost.wgrad)
    checkpointed: int = 0  # layers fully checkpointed under partial checkpointing (first k)
    host_bytes: int = (
        0  # model state (CPU offload) and activations (activation offload) on the host
    )
    resharded: int | None = None  # layer-wise ZeRO: the first k layers at ZeRO-3, the rest 2


@dataclass(frozen=True)
class GraphFacts:
    """What predict() reads from the graph itself when a LayerTable carries the costs: the
    search passes these instead of a graph it would otherwise build per micro-batch size."""

    batch: int
    num_layers: int
    train_flops: float

    @classmethod
    def of(cls, graph: OpGraph) -> GraphFacts:
        return cls(graph.data.batch, graph.num_layers, graph.train_flops)


@dataclass(frozen=True)
class Prediction:
    config: ParallelConfig
    microbatch_size: int
    ranges: list[tuple[int, int]]  # layers per pipeline chunk
    chunks: list[ChunkCost]
    stages: list[StageFigures]  # per pipeline stage
    step_time_s: float
    pipeline_s: float
    dp_sync_s: float
    optimizer_s: float
    bubble_fraction: float
    comm_s: float  # communication per step not hidden by compute
    slowest_stage: int
    peak_memory_bytes: int
    capacity_bytes: int
    train_flops: float = field(default=0.0)  # per step, whole model
    host_bytes: int = 0  # what a device keeps in host memory (CPU and activation offload)
    host_capacity_bytes: int = 0

    @property
    def fits_in_memory(self) -> bool:
        host_fits = self.host_bytes <= self.host_capacity_bytes or not self.host_bytes
        return self.peak_memory_bytes <= self.capacity_bytes and host_fits

    @property
    def stage_compute_s(self) -> float:
        """Compute per micro-batch on the stage with the most."""
        return max(st.compute for st in self.stages)


def predict(
    graph: OpGraph | GraphFacts,
    cluster: ClusterProfile,
    training: TrainingSettings,
    config: ParallelConfig,
    *,
    layouts: dict[str, NodeLayout] | None = None,
    table: LayerTable | None = None,
    ranges: list[tuple[int, int]] | None = None,
) -> Prediction:
    """Step time and memory of `config`; `graph` is traced at the micro-batch size.

    `layouts` default to Megatron's; `ranges` (one per pipeline chunk) to balanced layer
    counts; `table` (build_table of graph and layouts on a tp mesh) may be passed in when
    many configurations share graph, layouts and tp (with context parallelism, the table
    as one cp rank runs it: planner.parallel.context.scaled_table).
    `config` must be valid (ParallelConfig.validate): the search and the baselines build only
    valid ones, and evaluate() checks a user's before anything is traced."""
    facts = graph if isinstance(graph, GraphFacts) else GraphFacts.of(graph)
    num_layers = max(facts.num_layers, 1)
    mbs = config.microbatch_size(training.global_batch_size)
    if facts.batch != mbs:
        raise InputError("graph.batch", f"traced at batch {facts.batch}, configuration needs {mbs}")
    cm = CostModel.of_training(cluster, training, config.fp8)
    p, v = config.pp, config.virtual_stages
    ranges = ranges or split_layers(num_layers, p * v)
    first_ranks = [s * config.dp * config.tp for s in range(p)]
    if table is None:
        if not isinstance(graph, OpGraph):
            raise TypeError("predict() without a table needs the graph, not its GraphFacts")
        layouts = layouts or tensor_parallel_layout(graph, config.tp)
        tp_mesh = LogicalMesh.contiguous(cluster, 0, (1, config.tp))
        # (the micro-batch's work divided by cp: the search passes tables at a cp rank's
        # own GEMM shapes, planner.parallel.context.table_batch)
        table, _ = build_table(graph, layouts, cm, tp_mesh)
        if config.cp > 1:
            attention = context.AttentionBytes.of(graph)
            table = context.scaled_table(
                table, config.cp, attention, mbs, config.tp, cm, config.cp_comm
            )
    if config.ep > 1 and not table.expert_params:
        if not isinstance(graph, OpGraph):
            raise TypeError("predict() with ep > 1 needs the graph or an ep table")
        layers = expert.ExpertLayers.of(graph, training.expert_imbalance)
        table = expert.scaled_table(
            table, config.ep, layers, mbs, config.tp, cm, config.cp, config.folded
        )
    kept = pipeline.kept_outputs(table.layer_inputs, ranges, config.schedule, config.pp)
    chunks = chunk_costs(table, config.checkpointing, ranges, kept)
    add_overhead(chunks, cluster, config, ranges)
    p2p = pipeline.p2p_times(cm, table.cut_bytes, ranges, first_ranks, config.tp, config.schedule)
    for ch, t in zip(chunks, p2p, strict=True):
        ch.p2p += t
    stages, dp_sync, opt_step = [], [], []
    for s in range(p):
        dp_axes = data.data_axes(cluster, first_ranks[s], config)
        if config.ep > 1:  # the expert weights' ZeRO group
            axes = expert.axes(
                cluster, first_ranks[s], config.dp, config.ep, config.tp, config.folded
            )
            dp_axes += (axes[1],)
        figures, sync, opt = stage_figures(
            s, chunks, ranges, dp_axes, cm, cluster, training, config, table
        )
        stages.append(figures)
        dp_sync.append(sync)
        opt_step.append(opt)
    return pipeline_prediction(
        config, mbs, ranges, chunks, stages, dp_sync, opt_step, cluster, facts, training
    )


def pipeline_prediction(
    config: ParallelConfig,
    mbs: int,
    ranges: list[tuple[int, int]],
    chunks: list[ChunkCost],
    stages: list[StageFigures],
    dp_sync: list[float],
    opt_step: list[float],
    cluster: ClusterProfile,
    facts: GraphFacts,
    training: TrainingSettings,
) -> Prediction:
    """The step from each stage's figures, gradient sync and optimizer step: the schedule's
    pipeline time (`config`'s schedule, micro-batches and chunks per device) plus the
    slowest sync and optimizer step."""
    m, v = config.microbatches, config.virtual_stages
    stage_times = [st.time for st in stages]
    weight_grad = [st.wgrad for st in stages] if config.schedule in WEIGHT_SPLIT else None
    pipe, bubble = pipeline_span(
        config.schedule,
        stage_times,
        m,
        v,
        weight_grad,
        lambda: replay_chunk_times(chunks, stage_times, config),
    )
    step = pipe + max(dp_sync) + max(opt_step)
    # The first of the slowest (stages equal but for float rounding count as equal).
    top = max(stage_times)
    slowest = next(s for s in range(len(stages)) if stage_times[s] >= top * (1 - 1e-9))
    return Prediction(
        config=config,
        microbatch_size=mbs,
        ranges=ranges,
        chunks=chunks,
        stages=stages,
        step_time_s=step,
        pipeline_s=pipe,
        dp_sync_s=max(dp_sync),
        optimizer_s=max(opt_step),
        bubble_fraction=min(1.0, bubble),
        comm_s=stages[slowest].comm * m + max(dp_sync),
        slowest_stage=slowest,
        peak_memory_bytes=max(st.memory.total for st in stages),
        capacity_bytes=cluster.usable_memory_bytes,
        host_bytes=max(st.host_bytes for st in stages),
        host_capacity_bytes=cluster.host.memory_bytes if cluster.host else 0,
        train_flops=facts.train_flops * (training.global_batch_size // mbs),
    )


def replay_chunk_times(chunks, stage_times, config) -> list[tuple[float, float, float]]:
    """Per chunk, (F, B, W) for one micro-batch: B the input gradient (with recomputation),
    W the weight gradient, the sends split between F and B, and every chunk of a device
    scaled so that the device's chunks add up to its stage time (overhead, exposed ZeRO)."""
    device = [device_of_chunk(config.schedule, c, config.pp) for c in range(len(chunks))]
    totals = [0.0] * config.pp
    for c, ch in enumerate(chunks):
        totals[device[c]] += ch.total
    out = []
    for c, ch in enumerate(chunks):
        f = ch.fwd + ch.comm_fwd + ch.p2p / 2
        b = ch.bwd - ch.wgrad + ch.recompute + ch.comm_bwd + ch.p2p / 2
        scale = stage_times[device[c]] / totals[device[c]] if totals[device[c]] > 0 else 1.0
        scale *= ch.total / (f + b + ch.wgrad) if f + b + ch.wgrad > 0 else 1.0
        out.append((f * scale, b * scale, ch.wgrad * scale))
    return out


def stage_figures(s, chunks, ranges, dp_axes, cm, cluster, training, config, table):
    """(figures, exposed dp sync, optimizer step time) of pipeline stage s, whose chunks are
    s, s + pp, ... (interleaving) or s and 2 pp - 1 - s (the V schedules). `dp_axes`: the dp
    axis ZeRO runs on, HSDP's replicate axis or None, and under expert parallelism the expert
    weights' (planner.parallel.expert)."""
    dp_axis, replicate, *edp_axis = dp_axes
    own = chunks_of_device(config.schedule, s, config.pp, config.virtual_stages)
    per, overlap = bytes_per_param(training.dtype, training.optimizer), cluster.efficiency.overlap
    sums = StageSums([chunks[c] for c in own])
    params, compute, comm = sums.params, sums.compute, sums.comm
    # under expert parallelism a rank holds 1 / ep of the experts, ZeRO over the edp ranks
    local_experts = expert.stage_experts(table, [ranges[c] for c in own])
    dense, edp = params - local_experts, config.edp
    layer = sums.largest_layer_params
    holders = gradient_holders(
        config.schedule, config.pp, config.microbatches, config.virtual_stages, s
    )
    whole_chunks = max(sum(chunks[c].params for c in held) for held in holders)
    weights, grads, opt_state = model_state_bytes(
        dense,
        training.dtype,
        training.optimizer,
        config.zero,
        config.shard_degree,
        largest_layer_params=layer,
        offload=config.offload,
        runtime=training.runtime,
        pp=config.pp,
        microbatches=config.microbatches,
        held_whole=None if whole_chunks >= params else dense * whole_chunks // params,
    )
    if local_experts:  # their ZeRO group is the dp / ep ranks holding the same experts
        w, g, o = model_state_bytes(
            local_experts,
            training.dtype,
            training.optimizer,
            config.zero,
            edp,
            offload=config.offload,
            runtime=training.runtime,
            pp=config.pp,
            microbatches=config.microbatches,
        )
        weights, grads, opt_state = weights + w, grads + g, opt_state + o
    stage_layers = [i for c in own for i in range(*ranges[c])]
    rows = [int(table.inside["params"][i]) for i in stage_layers]
    root = dense - sum(rows)  # the stage's other parameters: FSDP2's root unit
    reduced = (config.zero, config.dp, config.pp, config.microbatches, training.runtime)
    if not (config.offload or local_experts) and data.reduced_in_backward(*reduced):
        # the unit being reduced and the root unit hold their gradients unsharded, beside
        # the other units' shards (with one micro-batch, theirs are made by this reduction)
        held = data.unsharded_in_backward(table, max(root, 0), layer, 0 in stage_layers)
        own_shards = grads * held // max(dense, 1) if config.microbatches == 1 else 0
        grads += held * per.grads - own_shards
    order = (config.schedule, s, config.pp, config.microbatches, config.virtual_stages)
    inflight = inflight_microbatches(*order)
    weights += compute_copy_bytes(  # 0 at ZeRO-3
        params, training.dtype, config.zero, config.dp, training.runtime
    )
    checkpointed, recompute = 0, 0.0
    if config.checkpointing == checkpointing.PARTIAL:
        budget = cluster.usable_memory_bytes - weights - grads - opt_state
        checkpointed, acts, recompute = checkpointing.fewest_layers(
            checkpointing.layer_rows(table, [ranges[c] for c in own]),
            inflight,
            budget,
            sums.saved_outside_layers,
            sums.saved_after_layers,
            sums.workspace,
        )
    else:
        acts = checkpointing.activation_bytes(
            saved_per_microbatch=sums.saved,
            inflight_microbatches=inflight,
            checkpointing=config.checkpointing,
            checkpoint_inputs_per_microbatch=sums.layer_inputs,
            largest_layer_saved=sums.largest_layer_saved,
            unchecked_saved_per_microbatch=sums.saved_outside_layers,
            saved_after_layers=sums.saved_after_layers,
            workspace=sums.workspace,
        )
    kept = resharded = None
    if config.layerwise_zero:  # the fewest first layers at ZeRO-3; the rest keep their weights
        weights -= layer * per.weights  # ZeRO-3's gather buffer: now the resharded units'
        budget = cluster.usable_memory_bytes - (weights + grads + opt_state + acts)
        whole = config.microbatches > 1  # the ZeRO-2 layers' gradients accumulate whole
        resharded, extra = data.fewest_resharded(
            rows, root, per, config.shard_degree, budget, whole
        )
        kept = sum(rows[resharded:])
        kept_grads = (
            sum(data.kept_gradient_bytes(n, per, config.shard_degree) for n in rows[resharded:])
            if whole
            else 0
        )
        weights, grads = weights + extra - kept_grads, grads + kept_grads
    if config.schedule in WEIGHT_SPLIT:  # the weight gradients' inputs wait from B to W
        held = sums.layer_inputs + sums.saved_outside_layers
        held = held if config.checkpointing else sums.saved
        points = split_backward_points(*order)
        acts += pending_weight_bytes(points, inflight, held, sums.wgrad_stash)
    host_acts = 0
    if (store := store_of(config.checkpointing)) is not None:  # copies out and back
        layer_saved = sums.saved - sums.saved_outside_layers
        recompute = store.transfer_time(cluster, layer_saved)
        host_acts = store.host_bytes(layer_saved, inflight)
    compute += recompute
    t_stage = compute + comm + sums.overhead
    if config.zero == 3 and config.dp > 1:  # CPU offload's copies run beside compute too
        held = dense + local_experts * config.ep  # dp ranks share dense and experts alike
        moved = config.offload and offload.transfer_time(cluster, held, config.shard_degree, per)
        if local_experts:
            moved += expert.zero3_comm(cm, edp_axis[0], local_experts, per, layer)
        args = (cm, dp_axis, dense - (kept or 0), per, compute, overlap, layer, replicate)
        exposed = data.zero3_exposed(*args, extra=moved)
        t_stage += exposed
        comm += exposed
    sync = data.gradient_sync(cm, dp_axis, dense, per, config.zero, layer, replicate)
    dense_sync = sync  # ZeRO 0-2's: under the runtimes reducing every backward, each time
    if kept:  # the ZeRO-2 layers' once-a-step reduce-scatter and gather
        sync += data.gradient_sync(cm, dp_axis, kept, per, 2, layer, replicate)
    if local_experts:
        sync += data.gradient_sync(cm, edp_axis[0], local_experts, per, config.zero, layer)
    sync += sums.step_comm
    # FSDP2 reduces a replicated weight's tp-partial gradient with each dp reduction of its
    # unit (the ledger counts the same); layer-wise ZeRO's ZeRO-2 layers once a step
    again = data.reductions_per_step(config, training.runtime) - 1
    if again:
        kept_step = (
            sum(table.inside["step_comm"][i] for i in stage_layers[resharded:]) if kept else 0
        )
        sync += again * (sums.step_comm - kept_step)
    sync = data.exposed_sync(sync, overlap, sums.bwd + recompute, s)
    # the earlier micro-batches' reductions, each beside its own backward
    sync += again * data.exposed(dense_sync, sums.bwd + recompute, overlap)
    overhead = cluster.measured.executor_overhead if cluster.measured else None
    if overhead is not None and config.dp > 1:  # FSDP's per-step work is not hidden
        layers = sum(ranges[c][1] - ranges[c][0] for c in own)
        sync += overhead.fsdp_layer_step_s * layers
    opt = data.optimizer_step_time(
        dense, config.zero, config.shard_degree, training.optimizer, cm.mem_rate
    )
    opt += data.optimizer_step_time(
        local_experts, config.zero, edp, training.optimizer, cm.mem_rate
    )
    if config.offload:
        opt = offload.optimizer_step_time(cluster, params, config.shard_degree, training.optimizer)
    memory = breakdown(weights, grads, opt_state, acts)
    host = offload.host_bytes(params, config.shard_degree, per) if config.offload else 0
    host += host_acts
    figures = StageFigures(
        t_stage, compute, comm, memory, sums.wgrad, checkpointed, host, resharded
    )
    return figures, sync, opt
