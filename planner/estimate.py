"""Evaluate a Megatron-style configuration (dp x tp x pp, micro-batches, schedule, ZeRO,
activation checkpointing) under the cost model and return a Plan.

This is the evaluator the baselines and the search share: given per-node layouts it computes
per-stage time and memory, the pipeline step time, and the predicted figures.
Assumptions, each a choice a demanding user should know about:
- tensor-parallel and pipeline point-to-point communication is not overlapped with compute
  (Megatron-LM 2021 behaviour); pipeline sends carry 1/tp of the boundary activation
  (Megatron's scatter/gather optimisation);
- data-parallel gradient reduction (ZeRO 0: all-reduce; 1-2: reduce-scatter + all-gather)
  overlaps with the backward of the last micro-batch (and, in a pipeline, with the drain:
  stage s ends s backward steps early); ZeRO-3 gathers parameters for forward and backward
  of every micro-batch and reduce-scatters gradients, overlapped with that micro-batch's
  compute (only the excess is exposed). The profile's `efficiency.overlap` says how much of
  that communication can run under compute (1 on GPUs with separate copy engines; measured
  by profile-cluster: near 0 for gloo on CPU, whose collectives use the same cores);
- checkpointing recomputes each layer's forward (and its tp communication) in backward.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Literal

from planner import __version__
from planner.cluster import ClusterProfile
from planner.cost_model import CostModel
from planner.errors import InputError
from planner.executable import executable, executor_mode
from planner.graph import OpGraph, OpNode
from planner.megatron import NodeLayout, tensor_parallel_layout
from planner.memory import activation_bytes, breakdown, bytes_per_param, model_state_bytes
from planner.mesh import LogicalMesh
from planner.plan import (
    ClusterRef,
    LogicalMeshSpec,
    MemoryPrediction,
    MeshSpec,
    ModelRef,
    NodeSharding,
    Plan,
    PlanRequest,
    Predicted,
    ScheduleSpec,
    SearchInfo,
    Stage,
    StagePrediction,
    TrainingSettings,
)
from planner.schedules import bubble_fraction, check_schedule, inflight_microbatches, pipeline_time

# Bytes the optimizer step reads and writes per parameter (mixed precision Adam: fp32 param,
# grad, m, v read; param, m, v and the bf16 copy written).
OPTIMIZER_STEP_BYTES = {"adamw": 28, "adam": 28, "sgd_momentum": 20, "sgd": 12}


@dataclass(frozen=True)
class ParallelConfig:
    dp: int
    tp: int
    pp: int
    microbatches: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero: int = 0
    checkpointing: bool = False

    def validate(self, cluster: ClusterProfile, global_batch: int, layers: int) -> None:
        for name in ("dp", "tp", "pp", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InputError(f"--{name}", f"{value!r} is not a positive integer", ">= 1")
        if self.dp * self.tp * self.pp != cluster.num_devices:
            raise InputError(
                "--dp/--tp/--pp",
                f"dp*tp*pp = {self.dp * self.tp * self.pp} but the cluster has "
                f"{cluster.num_devices} devices ({cluster.nodes} nodes x "
                f"{cluster.devices_per_node})",
                "a product equal to the device count",
            )
        if global_batch % (self.dp * self.microbatches):
            raise InputError(
                "--global-batch",
                f"{global_batch} is not divisible by dp*microbatches = "
                f"{self.dp * self.microbatches}",
                "a multiple of dp * microbatches",
            )
        check_schedule(self.schedule, self.virtual_stages)
        if self.zero not in (0, 1, 2, 3):
            raise InputError("--zero", f"{self.zero!r} is not a ZeRO stage", "0, 1, 2 or 3")
        chunks = self.pp * self.virtual_stages
        if layers < chunks:
            raise InputError(
                "--pp",
                f"{chunks} pipeline chunks but the model has only {layers} layers",
                f"pp * virtual_stages <= {layers}",
            )

    def microbatch_size(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.microbatches)


def split_layers(num_layers: int, chunks: int) -> list[tuple[int, int]]:
    """Contiguous, balanced [start, end) layer ranges."""
    base, extra = divmod(num_layers, chunks)
    out, start = [], 0
    for c in range(chunks):
        end = start + base + (1 if c < extra else 0)
        out.append((start, end))
        start = end
    return out


def assign_chunks(graph: OpGraph, ranges: list[tuple[int, int]]) -> dict[str, int]:
    """Chunk index per node: by layer position (nodes outside layers go with their
    neighbours: embedding with the first chunk, head and loss with the last)."""
    chunk_of_layer = {}
    for c, (a, b) in enumerate(ranges):
        for layer in range(a, b):
            chunk_of_layer[layer] = c
    pos = graph.positions
    return {n.name: chunk_of_layer[pos[n.name]] for n in graph.nodes}


def _hash(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class NodeCost:
    """Per micro-batch on one device: compute, tensor-parallel communication, and the
    per-step gradient synchronisation on the tp axis (parameters replicated there while the
    data is split there)."""

    fwd: float
    bwd: float
    comm_fwd: float
    comm_bwd: float
    step_comm: float
    saved: int
    params: int  # parameter elements per device of parameters this node owns


def node_costs(
    graph: OpGraph, layouts: dict[str, NodeLayout], cm: CostModel, mesh: LogicalMesh
) -> dict[str, NodeCost]:
    """Costs of every node under its layout; the tp axis of `mesh` carries the comm."""
    out = {}
    tp = mesh.axis("tp").size
    for node in graph.nodes:
        lay = layouts[node.name]
        t = cm.node_time(node, lay.compute_shards)
        saved = (node.saved_bytes + cm.attention_scores_bytes(node)) // lay.saved_shards
        out[node.name] = NodeCost(
            t.fwd,
            t.bwd,
            _comm(cm, lay.fwd_comm, mesh),
            _comm(cm, lay.bwd_comm, mesh),
            _comm(cm, lay.step_comm, mesh, bucketed=True),
            saved,
            sum(
                m.numel // (tp if lay.params.get(p, "R").startswith("S") else 1)
                for p, m in node.params.items()
                if p not in node.shared_params
            ),
        )
    return out


@dataclass
class _ChunkCost:
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


def _comm(
    cm: CostModel, events: list[tuple[str, int]], mesh: LogicalMesh, bucketed: bool = False
) -> float:
    axis = mesh.axis("tp")
    if bucketed:
        return sum(cm.bucketed(name, nbytes, axis) for name, nbytes in events)
    return sum(getattr(cm, name)(nbytes, axis) for name, nbytes in events)


def evaluate(
    graph: OpGraph,
    cluster: ClusterProfile,
    training: TrainingSettings,
    config: ParallelConfig,
    model: ModelRef,
    *,
    tokens_per_sample: int | None = None,
    layouts: dict[str, NodeLayout] | None = None,
    costs: dict[str, NodeCost] | None = None,
    ranges: list[tuple[int, int]] | None = None,
    detail: bool = True,
    solver: str = "none: evaluated a given configuration",
    started: float | None = None,
    tp_layout: Literal["megatron", "per_node"] | None = None,
) -> Plan:
    """Predict step time and memory of `config`; `graph` is traced at the micro-batch size.

    `layouts` default to Megatron's; `ranges` (one per pipeline chunk) default to balanced
    layer counts; `costs` may be passed in when evaluating many configurations that share
    graph, layouts and tp; `detail=False` leaves out per-node shardings. `tp_layout` says
    whether given layouts are Megatron's; by default they are compared with it.
    """
    started = time.perf_counter() if started is None else started
    num_layers = max(graph.num_layers, 1)
    config.validate(cluster, training.global_batch_size, num_layers)
    mbs = config.microbatch_size(training.global_batch_size)
    if graph.data.batch != mbs:
        raise InputError(
            "graph.batch", f"traced at batch {graph.data.batch}, configuration needs {mbs}"
        )
    cm = CostModel(cluster, training.dtype, attention=training.attention)
    if layouts is None or config.tp == 1:
        tp_layout = "megatron"
    elif tp_layout is None:
        megatron = tensor_parallel_layout(graph, config.tp)
        same = all(same_tp_placements(n, layouts[n.name], megatron[n.name]) for n in graph.nodes)
        tp_layout = "megatron" if same else "per_node"
    layouts = layouts or tensor_parallel_layout(graph, config.tp)
    p, v, m = config.pp, config.virtual_stages, config.microbatches
    ranges = ranges or split_layers(num_layers, p * v)
    chunk_of = assign_chunks(graph, ranges)
    ranks = [
        [
            [s * config.dp * config.tp + d * config.tp + t for t in range(config.tp)]
            for d in range(config.dp)
        ]
        for s in range(p)
    ]
    meshes = [
        LogicalMesh(cluster, tuple(r for row in ranks[s] for r in row), (config.dp, config.tp))
        for s in range(p)
    ]
    costs = costs or node_costs(graph, layouts, cm, meshes[0])

    # Per chunk: compute, tp communication, memory inputs.
    chunks = [_ChunkCost() for _ in ranges]
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
                ch.recompute += nc.fwd + nc.comm_fwd
    inputs = graph.layer_input_bytes
    for c, (a, b) in enumerate(ranges):
        ch = chunks[c]
        ch.layer_inputs = sum(inputs[a:b])
        ch.largest_layer_saved = max((layer_saved.get(i, 0) for i in range(a, b)), default=0)
        ch.largest_layer_params = max((layer_params.get(i, 0) for i in range(a, b)), default=0)

    overhead = cluster.measured.executor_overhead if cluster.measured else None
    if overhead is not None:
        for c, (a, b) in enumerate(ranges):
            if config.tp > 1:
                chunks[c].overhead += overhead.tp_layer_microbatch_s * (b - a)
            if config.dp > 1:
                chunks[c].overhead += overhead.fsdp_layer_microbatch_s * (b - a)
            if len(ranges) > 1:
                chunks[c].overhead += overhead.pp_microbatch_s

    # Pipeline point-to-point: activations forward, gradients backward, 1/tp of the tensor.
    cuts = graph.cut_bytes
    for c in range(len(ranges) - 1):
        if c % p == (c + 1) % p:
            continue
        src, dst = ranks[c % p][0][0], ranks[(c + 1) % p][0][0]
        cost = cm.send_recv(cuts[ranges[c][1]] / config.tp, cm.p2p_axis(src, dst))
        chunks[c].p2p += cost  # forward send
        chunks[c + 1].p2p += cost  # backward send of the gradient

    # ZeRO-3: per micro-batch parameter gathers and gradient reduce-scatter over dp.
    per = bytes_per_param(training.dtype, training.optimizer)
    stage_times, stage_compute, stage_comm, memories = [], [], [], []
    dp_sync, opt_step = [], []
    overlap = cluster.efficiency.overlap
    for s in range(p):
        mine = [chunks[c] for c in range(len(ranges)) if c % p == s]
        mesh = meshes[s]
        dp_axis = mesh.axis("dp")
        params = sum(ch.params for ch in mine)
        t_stage = sum(ch.total for ch in mine)
        compute = sum(ch.fwd + ch.bwd + ch.recompute for ch in mine)
        comm = sum(ch.comm_fwd + ch.comm_bwd + ch.p2p for ch in mine)
        if config.zero == 3 and config.dp > 1:
            gather = cm.bucketed("all_gather", params * per.weights, dp_axis)
            zero_comm = 2 * gather + cm.bucketed("reduce_scatter", params * per.grads, dp_axis)
            exposed = max(0.0, zero_comm - overlap * compute)
            t_stage += exposed
            comm += exposed
            dp_sync.append(0.0)
        elif config.dp > 1 and config.zero in (1, 2):
            # ZeRO-1/2 (and FSDP without resharding): gradients reduce-scattered, updated
            # shards all-gathered (Rajbhandari et al. 2020, section 7: an all-reduce's volume).
            dp_sync.append(
                cm.bucketed("reduce_scatter", params * per.grads, dp_axis)
                + cm.bucketed("all_gather", params * per.weights, dp_axis)
            )
        elif config.dp > 1:
            dp_sync.append(cm.bucketed("all_reduce", params * per.grads, dp_axis))
        else:
            dp_sync.append(0.0)
        dp_sync[-1] += sum(ch.step_comm for ch in mine)
        # Gradient buckets are reduced while backward still runs (DDP/FSDP overlap): the last
        # micro-batch's backward hides part of it, and in 1F1B/GPipe stage s finishes its
        # last backward s micro-batch-backwards before stage 0 ends the step.
        bwd = sum(ch.bwd + ch.recompute + ch.comm_bwd for ch in mine)
        dp_sync[-1] = max(0.0, dp_sync[-1] - overlap * bwd * (1 + s))
        if overhead is not None and config.dp > 1:  # FSDP's per-step work is not hidden
            layers = sum(b - a for c, (a, b) in enumerate(ranges) if c % p == s)
            dp_sync[-1] += overhead.fsdp_layer_step_s * layers
        opt_params = params if config.zero == 0 else -(-params // config.dp)
        opt_step.append(opt_params * OPTIMIZER_STEP_BYTES[training.optimizer] / cm.mem_rate)
        stage_times.append(t_stage)
        stage_compute.append(compute)
        stage_comm.append(comm)
        weights, grads, opt = model_state_bytes(
            params,
            training.dtype,
            training.optimizer,
            config.zero,
            config.dp,
            largest_layer_params=max((ch.largest_layer_params for ch in mine), default=0),
        )
        inflight = inflight_microbatches(config.schedule, s, p, m, v)
        acts = activation_bytes(
            saved_per_microbatch=sum(ch.saved for ch in mine),
            inflight_microbatches=inflight,
            checkpointing=config.checkpointing,
            checkpoint_inputs_per_microbatch=sum(ch.layer_inputs for ch in mine),
            largest_layer_saved=max((ch.largest_layer_saved for ch in mine), default=0),
            unchecked_saved_per_microbatch=sum(ch.saved_outside_layers for ch in mine),
        )
        memories.append(breakdown(weights, grads, opt, acts))

    pipe = pipeline_time(stage_times, m, v)
    step = pipe + max(dp_sync) + max(opt_step)
    bubble = bubble_fraction(stage_times, m, v)
    slowest = max(range(p), key=lambda s: stage_times[s])
    comm_exposed = stage_comm[slowest] * m + max(dp_sync)
    flops_per_step = graph.train_flops * (training.global_batch_size // mbs)
    devices = cluster.num_devices
    tflops = flops_per_step / step / devices / 1e12
    peak_mem = max(mem.total for mem in memories)
    capacity = cluster.device.memory_bytes
    tokens = tokens_per_sample if tokens_per_sample is not None else graph.data.seq

    # One Stage entry per pipeline chunk, in pipeline order (with interleaving, a device
    # holds chunks s, s + p, ...; its entries repeat its ranks and its memory).
    stages = []
    for c, (a, b) in enumerate(ranges):
        s = c % p
        nodes = [n for n in graph.nodes if chunk_of[n.name] == c]
        ch = chunks[c]
        stages.append(
            Stage(
                index=c,
                modules=_modules(nodes),
                layers=[a, b],
                ranks=[r for row in ranks[s] for r in row],
                logical_mesh=LogicalMeshSpec(dp=config.dp, tp=config.tp),
                zero=config.zero,
                activation_checkpointing=config.checkpointing,
                shardings=(
                    [_sharding(n, layouts[n.name], config.zero) for n in nodes] if detail else []
                ),
                predicted=StagePrediction(
                    compute_s=ch.fwd + ch.bwd + ch.recompute if v > 1 else stage_compute[s],
                    comm_s=ch.comm_fwd + ch.comm_bwd + ch.p2p if v > 1 else stage_comm[s],
                    memory=MemoryPrediction(**memories[s].as_dict()),
                ),
            )
        )
    predicted = Predicted(
        step_time_s=step,
        samples_per_s=training.global_batch_size / step,
        tokens_per_s=training.global_batch_size * tokens / step,
        tflops_per_device=tflops,
        mfu=tflops * 1e12 / cm.peak,
        peak_memory_bytes=peak_mem,
        bubble_fraction=min(1.0, bubble),
        comm_s=comm_exposed,
        fits_in_memory=peak_mem <= capacity,
        breakdown={
            "pipeline_s": pipe,
            "dp_sync_s": max(dp_sync),
            "optimizer_s": max(opt_step),
            "stage_compute_s": max(stage_compute),
            "stage_comm_s": stage_comm[slowest],
        },
    )
    request = PlanRequest(
        model=model,
        cluster=ClusterRef(
            name=cluster.name,
            content_hash=cluster.content_hash,
            nodes=cluster.nodes,
            devices_per_node=cluster.devices_per_node,
            device=cluster.device.name,
            device_memory_bytes=cluster.device.memory_bytes,
        ),
        training=training,
    )
    styles = all(executable(n.kind, layouts[n.name].strategy) for n in graph.nodes)
    mode = executor_mode(model.family, p * v, tp_layout == "megatron", styles)
    plan = Plan(
        executable=mode is not None,
        tp_layout=tp_layout,
        autopar_version=__version__,
        request=request,
        mesh=MeshSpec(shape=[p, config.dp, config.tp], ranks=ranks),
        schedule=ScheduleSpec(name=config.schedule, microbatches=m, virtual_stages=v),
        stages=stages,
        predicted=predicted,
        search=SearchInfo(
            time_s=time.perf_counter() - started, solver=solver, candidates_evaluated=1
        ),
        explanation=_explain(predicted, stages, config, capacity, slowest),
    )
    return plan


def same_tp_placements(node: OpNode, a: NodeLayout, b: NodeLayout) -> bool:
    """Whether two layouts place this node's parameters, inputs and outputs alike on tp."""

    def padded(xs: list[str], n: int) -> list[str]:
        return list(xs) + ["R"] * (n - len(xs))

    return (
        all(a.params.get(p, "R") == b.params.get(p, "R") for p in node.params)
        and padded(a.inputs, len(node.inputs)) == padded(b.inputs, len(node.inputs))
        and padded(a.outputs, len(node.outputs)) == padded(b.outputs, len(node.outputs))
    )


def _owned_params(
    node: OpNode, owner_chunk: dict[str, int], chunk: int, lay: NodeLayout, tp: int
) -> int:
    """Parameter elements this node adds to one device of its chunk. A tied parameter used
    again in another chunk needs its own copy there (the tied LM head on the last stage)."""
    count = 0
    for name, meta in node.params.items():
        first = owner_chunk.setdefault(name, chunk)
        if name not in node.shared_params or first != chunk:
            sharded = lay.params.get(name, "R").startswith("S")
            count += meta.numel // tp if sharded else meta.numel
            if name in node.shared_params:
                owner_chunk[name] = chunk
    return count


def _modules(nodes: list[OpNode]) -> list[str]:
    out: list[str] = []
    for n in nodes:
        if n.kind == "input" or not n.module:
            continue
        parts = n.module.split(".")
        top = ".".join(parts[:2]) if len(parts) > 1 and parts[1].isdigit() else parts[0]
        if top not in out:
            out.append(top)
    return out


def _sharding(node: OpNode, lay: NodeLayout, zero: int) -> NodeSharding:
    dp_param = "S(0)" if zero == 3 else "R"
    dp_act = "R" if node.kind == "constant" else "S(0)"
    return NodeSharding(
        node=node.name,
        strategy=lay.strategy,
        module=node.module,
        kind=node.kind,
        params={name: [dp_param, lay.params.get(name, "R")] for name in node.params},
        inputs=[[dp_act, s] for s in lay.inputs],
        outputs=[[dp_act, s] for s in lay.outputs],
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _explain(pred: Predicted, stages: list[Stage], cfg: ParallelConfig, cap: int, slowest: int):
    lines = [
        f"Predicted step {pred.step_time_s:.3f} s: {pred.tflops_per_device:.1f} TFLOP/s per "
        f"device ({pred.mfu:.0%} of peak).",
        f"Pipeline bubble: {pred.bubble_fraction:.1%} of the pipeline time with "
        f"{cfg.microbatches} micro-batches over {cfg.pp} stages ({cfg.schedule}).",
        f"Stage {slowest} is the slowest; communication not hidden by compute is "
        f"{pred.comm_s:.3f} s per step.",
    ]
    worst = max(stages, key=lambda st: st.predicted.memory.total)
    mem = worst.predicted.memory
    verdict = "fits" if mem.total <= cap else "does NOT fit"
    lines.append(
        f"Peak memory {_gib(mem.total)} on stage {worst.index} {verdict} in {_gib(cap)} "
        f"(params {_gib(mem.params)}, grads {_gib(mem.grads)}, optimizer {_gib(mem.optimizer)}, "
        f"activations {_gib(mem.activations)})."
    )
    return lines


def model_ref(resolved, seq: int) -> ModelRef:
    """ModelRef for a planner.models.ResolvedModel trained at `seq`."""
    model = resolved.with_seq(seq)
    cfg = model.config_dict()
    return ModelRef(
        name=model.name,
        family=model.family.name,
        config=cfg,
        params=model.param_count,
        content_hash=_hash({"name": model.name, "config": cfg}),
    )
