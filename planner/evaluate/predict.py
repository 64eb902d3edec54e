"""predict(): a configuration's step time and memory under the cost model, numbers only.

This is what the search calls per candidate, so it builds no Plan (planner.evaluate.to_plan
does that once for the winner). Per pipeline chunk it sums the nodes' compute and
tensor-parallel communication, adds recomputation (planner.parallel.checkpointing),
point-to-point sends (planner.parallel.pipeline) and the executor's measured overhead; per
pipeline stage the data-parallel terms (planner.parallel.data) and memory; then the
schedule's step time (planner.cost.schedules).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.cluster.mesh import LogicalMesh
from planner.cluster.profile import ClusterProfile
from planner.cost.memory import MemoryBreakdown, breakdown, bytes_per_param, model_state_bytes
from planner.cost.model import CostModel
from planner.cost.schedules import bubble_fraction, inflight_microbatches, pipeline_time
from planner.errors import InputError
from planner.evaluate.config import ParallelConfig, assign_chunks, split_layers
from planner.evaluate.node_costs import NodeCost, node_costs
from planner.graph.opgraph import OpGraph, OpNode
from planner.intra_op.megatron import tensor_parallel_layout
from planner.intra_op.node_layout import NodeLayout
from planner.parallel import checkpointing, data, pipeline
from planner.placements import REPLICATE, is_shard
from planner.plan import TrainingSettings


@dataclass
class ChunkCost:
    """One pipeline chunk's sums per micro-batch (time, s; memory inputs, bytes/elements)."""

    fwd: float = 0.0
    bwd: float = 0.0
    comm_fwd: float = 0.0
    comm_bwd: float = 0.0
    recompute: float = 0.0
    p2p: float = 0.0
    overhead: float = 0.0  # the executor's own per-micro-batch cost (measured profiles)
    step_comm: float = 0.0
    params: int = 0
    saved: int = 0
    saved_outside_layers: int = 0
    layer_inputs: int = 0
    largest_layer_saved: int = 0
    largest_layer_params: int = 0

    @property
    def total(self) -> float:
        return (
            self.fwd
            + self.bwd
            + self.comm_fwd
            + self.comm_bwd
            + self.recompute
            + self.p2p
            + self.overhead
        )


@dataclass(frozen=True)
class StageFigures:
    """One pipeline stage (a rank row of the mesh), per micro-batch time and peak memory."""

    time: float
    compute: float
    comm: float
    memory: MemoryBreakdown


@dataclass(frozen=True)
class Prediction:
    config: ParallelConfig
    microbatch_size: int
    ranges: list[tuple[int, int]]  # layers per pipeline chunk
    chunk_of: dict[str, int]  # node -> chunk
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

    @property
    def fits_in_memory(self) -> bool:
        return self.peak_memory_bytes <= self.capacity_bytes

    @property
    def stage_compute_s(self) -> float:
        """Compute per micro-batch on the stage with the most."""
        return max(st.compute for st in self.stages)


def predict(
    graph: OpGraph,
    cluster: ClusterProfile,
    training: TrainingSettings,
    config: ParallelConfig,
    *,
    layouts: dict[str, NodeLayout] | None = None,
    costs: dict[str, NodeCost] | None = None,
    ranges: list[tuple[int, int]] | None = None,
) -> Prediction:
    """Step time and memory of `config`; `graph` is traced at the micro-batch size.

    `layouts` default to Megatron's; `ranges` (one per pipeline chunk) to balanced layer
    counts; `costs` may be passed in when many configurations share graph, layouts and tp.
    `config` must be valid (ParallelConfig.validate): the search and the baselines build only
    valid ones, and evaluate() checks a user's before anything is traced."""
    num_layers = max(graph.num_layers, 1)
    mbs = config.microbatch_size(training.global_batch_size)
    if graph.data.batch != mbs:
        raise InputError(
            "graph.batch", f"traced at batch {graph.data.batch}, configuration needs {mbs}"
        )
    cm = CostModel(cluster, training.dtype, attention=training.attention)
    layouts = layouts or tensor_parallel_layout(graph, config.tp)
    p, v, m = config.pp, config.virtual_stages, config.microbatches
    ranges = ranges or split_layers(num_layers, p * v)
    chunk_of = assign_chunks(graph, ranges)
    ranks = config.ranks()
    meshes = [
        LogicalMesh(cluster, tuple(r for row in ranks[s] for r in row), (config.dp, config.tp))
        for s in range(p)
    ]
    costs = costs or node_costs(graph, layouts, cm, meshes[0])
    chunks = _chunk_costs(graph, layouts, costs, config, ranges, chunk_of)
    _add_overhead(chunks, cluster, config, ranges)
    p2p = pipeline.p2p_times(cm, graph.cut_bytes, ranges, [r[0][0] for r in ranks], config.tp)
    for ch, t in zip(chunks, p2p, strict=True):
        ch.p2p += t
    stages, dp_sync, opt_step = [], [], []
    for s in range(p):
        figures, sync, opt = _stage(s, chunks, ranges, meshes[s], cm, cluster, training, config)
        stages.append(figures)
        dp_sync.append(sync)
        opt_step.append(opt)
    stage_times = [st.time for st in stages]
    pipe = pipeline_time(stage_times, m, v)
    step = pipe + max(dp_sync) + max(opt_step)
    slowest = max(range(p), key=lambda s: stage_times[s])
    return Prediction(
        config=config,
        microbatch_size=mbs,
        ranges=ranges,
        chunk_of=chunk_of,
        chunks=chunks,
        stages=stages,
        step_time_s=step,
        pipeline_s=pipe,
        dp_sync_s=max(dp_sync),
        optimizer_s=max(opt_step),
        bubble_fraction=min(1.0, bubble_fraction(stage_times, m, v)),
        comm_s=stages[slowest].comm * m + max(dp_sync),
        slowest_stage=slowest,
        peak_memory_bytes=max(st.memory.total for st in stages),
        capacity_bytes=cluster.device.memory_bytes,
        train_flops=graph.train_flops * (training.global_batch_size // mbs),
    )


def _chunk_costs(graph, layouts, costs, config, ranges, chunk_of) -> list[ChunkCost]:
    """Per chunk: compute, tp communication, recomputation and memory inputs."""
    chunks = [ChunkCost() for _ in ranges]
    owner_chunk: dict[str, int] = {}
    layer_saved: dict[int, int] = {}
    layer_params: dict[int, int] = {}
    for node in graph.nodes:
        c = chunk_of[node.name]
        nc = costs[node.name]
        ch = chunks[c]
        ch.fwd += nc.fwd
        ch.bwd += nc.bwd
        ch.comm_fwd += nc.comm_fwd
        ch.comm_bwd += nc.comm_bwd
        ch.step_comm += nc.step_comm
        ch.saved += nc.saved
        params = (
            _owned_params(node, owner_chunk, c, layouts[node.name], config.tp)
            if node.shared_params or node.params.keys() & owner_chunk.keys()
            else nc.params
        )
        for name in node.params:
            owner_chunk.setdefault(name, c)
        ch.params += params
        if node.layer is None:
            ch.saved_outside_layers += nc.saved
        else:
            layer_saved[node.layer] = layer_saved.get(node.layer, 0) + nc.saved
            layer_params[node.layer] = layer_params.get(node.layer, 0) + params
            if config.checkpointing:
                ch.recompute += checkpointing.recompute_time(nc.fwd, nc.comm_fwd)
    inputs = graph.layer_input_bytes
    for c, (a, b) in enumerate(ranges):
        ch = chunks[c]
        ch.layer_inputs = sum(inputs[a:b])
        ch.largest_layer_saved = max((layer_saved.get(i, 0) for i in range(a, b)), default=0)
        ch.largest_layer_params = max((layer_params.get(i, 0) for i in range(a, b)), default=0)
    return chunks


def _add_overhead(chunks, cluster: ClusterProfile, config: ParallelConfig, ranges) -> None:
    """The executor's own per-micro-batch costs, where the profile measured them."""
    overhead = cluster.measured.executor_overhead if cluster.measured else None
    if overhead is None:
        return
    for c, (a, b) in enumerate(ranges):
        if config.tp > 1:
            chunks[c].overhead += overhead.tp_layer_microbatch_s * (b - a)
        if config.dp > 1:
            chunks[c].overhead += overhead.fsdp_layer_microbatch_s * (b - a)
        if len(ranges) > 1:
            chunks[c].overhead += overhead.pp_microbatch_s


def _stage(s, chunks, ranges, mesh, cm, cluster, training, config):
    """(figures, exposed dp sync, optimizer step time) of pipeline stage s, whose chunks are
    s, s + pp, ... (interleaving)."""
    p = config.pp
    mine = [chunks[c] for c in range(len(ranges)) if c % p == s]
    dp_axis = mesh.axis("dp")
    per = bytes_per_param(training.dtype, training.optimizer)
    overlap = cluster.efficiency.overlap
    params = sum(ch.params for ch in mine)
    t_stage = sum(ch.total for ch in mine)
    compute = sum(ch.fwd + ch.bwd + ch.recompute for ch in mine)
    comm = sum(ch.comm_fwd + ch.comm_bwd + ch.p2p for ch in mine)
    if config.zero == 3 and config.dp > 1:
        exposed = data.zero3_exposed(cm, dp_axis, params, per, compute, overlap)
        t_stage += exposed
        comm += exposed
    sync = data.gradient_sync(cm, dp_axis, params, per, config.zero)
    sync += sum(ch.step_comm for ch in mine)
    bwd = sum(ch.bwd + ch.recompute + ch.comm_bwd for ch in mine)
    sync = data.exposed_sync(sync, overlap, bwd, s)
    overhead = cluster.measured.executor_overhead if cluster.measured else None
    if overhead is not None and config.dp > 1:  # FSDP's per-step work is not hidden
        layers = sum(b - a for c, (a, b) in enumerate(ranges) if c % p == s)
        sync += overhead.fsdp_layer_step_s * layers
    opt = data.optimizer_step_time(params, config.zero, config.dp, training.optimizer, cm.mem_rate)
    weights, grads, opt_state = model_state_bytes(
        params,
        training.dtype,
        training.optimizer,
        config.zero,
        config.dp,
        largest_layer_params=max((ch.largest_layer_params for ch in mine), default=0),
    )
    inflight = inflight_microbatches(
        config.schedule, s, p, config.microbatches, config.virtual_stages
    )
    acts = checkpointing.activation_bytes(
        saved_per_microbatch=sum(ch.saved for ch in mine),
        inflight_microbatches=inflight,
        checkpointing=config.checkpointing,
        checkpoint_inputs_per_microbatch=sum(ch.layer_inputs for ch in mine),
        largest_layer_saved=max((ch.largest_layer_saved for ch in mine), default=0),
        unchecked_saved_per_microbatch=sum(ch.saved_outside_layers for ch in mine),
    )
    memory = breakdown(weights, grads, opt_state, acts)
    return StageFigures(t_stage, compute, comm, memory), sync, opt


def _owned_params(
    node: OpNode, owner_chunk: dict[str, int], chunk: int, lay: NodeLayout, tp: int
) -> int:
    """Parameter elements this node adds to one device of its chunk. A tied parameter used
    again in another chunk needs its own copy there (the tied LM head on the last stage)."""
    count = 0
    for name, meta in node.params.items():
        first = owner_chunk.setdefault(name, chunk)
        if name not in node.shared_params or first != chunk:
            sharded = is_shard(lay.params.get(name, REPLICATE))
            count += meta.numel // tp if sharded else meta.numel
            if name in node.shared_params:
                owner_chunk[name] = chunk
    return count
