"""to_plan(): the Plan for a Prediction: mesh and ranks, one Stage per pipeline chunk with
per-node shardings, the predicted figures and their explanation. Run once per plan shown
(the search's winner, a baseline's best, `autopar estimate`), never per candidate."""

from __future__ import annotations

import time

from planner import __version__
from planner.cluster.profile import ClusterProfile
from planner.cost.model import CostModel
from planner.cost.schedule_v import chunks_of_device, device_of_chunk
from planner.evaluate.config import assign_chunks
from planner.evaluate.explain import explain
from planner.evaluate.ledger import stage_ledgers
from planner.evaluate.predict import Prediction
from planner.executable import (
    executor_mode_and_reason,
    graph_mode_refusal,
    not_executable_reason,
)
from planner.graph.opgraph import OpGraph, OpNode
from planner.intra_op.megatron import tensor_parallel_layout
from planner.intra_op.node_layout import NodeLayout, same_tp_placements
from planner.parallel import context, expert, fp8
from planner.parallel.checkpointing import (
    PARTIAL,
    policy_name,
    recomputes,
    schedule_refusal,
)
from planner.parallel.registry import store_of
from planner.placements import REPLICATE, shard
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
from planner.vocab import TpLayoutName


def to_plan(
    pred: Prediction,
    graph: OpGraph,
    cluster: ClusterProfile,
    training: TrainingSettings,
    model: ModelRef,
    *,
    tokens_per_sample: int | None = None,
    layouts: dict[str, NodeLayout] | None = None,
    detail: bool = True,
    solver: str = "none: evaluated a given configuration",
    started: float | None = None,
    tp_layout: TpLayoutName | None = None,
    sequence_parallel: bool = False,
) -> Plan:
    """`layouts` as given to predict (default Megatron's); `detail=False` leaves out per-node
    shardings; `tp_layout` says whether given layouts are Megatron's (by default they are
    compared with it)."""
    started = time.perf_counter() if started is None else started
    config = pred.config
    if layouts is None or config.tp == 1:
        tp_layout = "megatron"
    elif tp_layout is None:
        megatron = tensor_parallel_layout(graph, config.tp)
        same = all(same_tp_placements(n, layouts[n.name], megatron[n.name]) for n in graph.nodes)
        tp_layout = "megatron" if same else "per_node"
    layouts = layouts or tensor_parallel_layout(graph, config.tp)
    p, v, m = config.pp, config.virtual_stages, config.microbatches
    ranks = config.ranks()
    sequence_parallel = sequence_parallel and config.tp > 1
    nodes = [(n.name, n.kind, layouts[n.name].strategy, n.module_type) for n in graph.nodes]
    graph_mode = (
        executor_mode_and_reason(model.family, tp_layout == "megatron", nodes)[0] == "graph"
    )
    stages = _stages(
        pred, graph, layouts, ranks, detail, training, sequence_parallel, cluster, graph_mode
    )
    predicted = predicted_figures(pred, cluster, training, graph, tokens_per_sample)
    why = _not_executable(config, graph, layouts, model, tp_layout, training.seq_len)
    return Plan(
        executable=why is None,
        not_executable_reason=why,
        tp_layout=tp_layout,
        sequence_parallel=sequence_parallel,
        fp8=config.fp8,
        autopar_version=__version__,
        request=PlanRequest(model=model, cluster=cluster_ref(cluster), training=training),
        mesh=MeshSpec(
            shape=[p, config.dp, config.tp],
            ranks=ranks,
            dp_shard=config.dp_shard if config.hybrid else None,
            cp=config.cp if config.cp > 1 else None,
            cp_comm=config.cp_comm if config.cp > 1 and config.cp_comm != "all_gather" else None,
            ep=config.ep if config.ep > 1 else None,
            etp=1 if config.folded else None,
        ),
        schedule=ScheduleSpec(name=config.schedule, microbatches=m, virtual_stages=v),
        stages=stages,
        predicted=predicted,
        search=SearchInfo(
            time_s=time.perf_counter() - started, solver=solver, candidates_evaluated=1
        ),
        explanation=explain(predicted, stages, config, cluster, pred.slowest_stage)
        + _technique_lines(pred, graph, cluster, training),
    )


def _technique_lines(pred: Prediction, graph: OpGraph, cluster, training) -> list[str]:
    """Sentences a technique adds to the explanation (expert parallelism's exchanges)."""
    config = pred.config
    cm = CostModel(cluster, training.dtype, attention=training.attention)
    devices = [
        [
            pred.ranges[c]
            for c in chunks_of_device(config.schedule, s, config.pp, config.virtual_stages)
        ]
        for s in range(config.pp)
    ]
    line = expert.explanation(graph, cm, config, training, devices)
    return [line] if line else []


def _not_executable(config, graph, layouts, model, tp_layout: str, seq_len: int):
    """Why the executor cannot run this configuration with these layouts, or None."""
    family = model.family
    nodes = [(n.name, n.kind, layouts[n.name].strategy, n.module_type) for n in graph.nodes]
    why = not_executable_reason(family, tp_layout == "megatron", nodes)
    if why is None and config.cp > 1:
        why = context.refusal(
            family, seq_len, config.cp, config.dp, tp_layout, config.cp_comm, model.config
        )
    if why is None and config.ep > 1:
        why = expert.refusal(
            family, model.config, config.ep, config.dp, config.tp, config.cp, etp=config.etp
        )
    if why is None:
        why = schedule_refusal(config.schedule, config.checkpointing)
    if why is None:
        why = fp8.schedule_refusal(config.fp8, config.schedule)
    if why is not None:
        return why
    if executor_mode_and_reason(family, tp_layout == "megatron", nodes)[0] == "modules":
        return None
    return graph_mode_refusal(
        config.dp,
        config.zero,
        config.hybrid,
        cpu_offload=config.offload,
        checkpointing=config.checkpointing,
        fp8=config.fp8,
        expert_parallel=config.ep > 1,
    )


def cluster_ref(cluster: ClusterProfile) -> ClusterRef:
    return ClusterRef(
        name=cluster.name,
        content_hash=cluster.content_hash,
        nodes=cluster.nodes,
        devices_per_node=cluster.devices_per_node,
        device=cluster.device.name,
        device_memory_bytes=cluster.device.memory_bytes,
        memory_headroom_bytes=cluster.memory_headroom_bytes,
    )


def predicted_figures(pred: Prediction, cluster, training, graph, tokens_per_sample) -> Predicted:
    step = pred.step_time_s
    tflops = pred.train_flops / step / cluster.num_devices / 1e12
    peak = CostModel(cluster, training.dtype, attention=training.attention).peak
    tokens = tokens_per_sample if tokens_per_sample is not None else graph.data.seq
    slowest = pred.stages[pred.slowest_stage]
    return Predicted(
        step_time_s=step,
        samples_per_s=training.global_batch_size / step,
        tokens_per_s=training.global_batch_size * tokens / step,
        tflops_per_device=tflops,
        mfu=tflops * 1e12 / peak,
        peak_memory_bytes=pred.peak_memory_bytes,
        bubble_fraction=pred.bubble_fraction,
        comm_s=pred.comm_s,
        fits_in_memory=pred.fits_in_memory,
        breakdown={
            "pipeline_s": pred.pipeline_s,
            "dp_sync_s": pred.dp_sync_s,
            "optimizer_s": pred.optimizer_s,
            "stage_compute_s": max(st.compute for st in pred.stages),
            "stage_comm_s": slowest.comm,
        },
    )


def _stages(
    pred: Prediction,
    graph,
    layouts,
    ranks,
    detail: bool,
    training,
    sequence_parallel: bool,
    cluster: ClusterProfile,
    graph_mode: bool = False,
) -> list[Stage]:
    """One Stage entry per pipeline chunk, in pipeline order (with interleaving, a device
    holds chunks s, s + p, ...; with ZB-V s and 2p - 1 - s; its entries repeat its ranks
    and its memory)."""
    config = pred.config
    p, v = config.pp, config.virtual_stages
    out = []
    chunk_of = assign_chunks(graph, pred.ranges)
    counts = _checkpointed_per_chunk(pred)
    resharded = _resharded_per_chunk(pred)
    batched = _batched(graph) if detail else {}
    ledgers = (
        stage_ledgers(
            config,
            graph,
            layouts,
            pred.ranges,
            training.dtype,
            training.optimizer,
            counts,
            sequence_parallel,
            cluster.device.kernels,
            graph_mode,
            resharded,
            training.runtime,
        )
        if detail
        else [None] * len(pred.ranges)
    )
    store = store_of(config.checkpointing)  # its stage field on, where one is used
    stored = {store.stage_field: True} if store is not None else {}
    for c, (a, b) in enumerate(pred.ranges):
        s = device_of_chunk(config.schedule, c, p)
        nodes = [n for n in graph.nodes if chunk_of[n.name] == c]
        ch, figures = pred.chunks[c], pred.stages[s]
        count = counts[c]
        out.append(
            Stage(
                index=c,
                modules=_modules(nodes),
                layers=[a, b],
                ranks=[r for row in ranks[s] for r in row],
                logical_mesh=LogicalMeshSpec(dp=config.dp, tp=config.tp),
                zero=config.zero,
                resharded_layers=resharded[c],
                activation_checkpointing=recomputes(config.checkpointing) and count != 0,
                **stored,
                checkpoint_policy=policy_name(config.checkpointing),
                checkpointed_layers=count if count is not None and 0 < count < b - a else None,
                cpu_offload=config.offload,
                shardings=(
                    [_sharding(n, layouts[n.name], config.zero, batched) for n in nodes]
                    if detail
                    else []
                ),
                predicted=StagePrediction(
                    compute_s=ch.fwd + ch.bwd + ch.recompute if v > 1 else figures.compute,
                    comm_s=ch.comm_fwd + ch.comm_bwd + ch.p2p if v > 1 else figures.comm,
                    p2p_s=ch.p2p,
                    memory=MemoryPrediction(**figures.memory.as_dict()),
                    ledger=ledgers[c],
                ),
            )
        )
    return out


def _resharded_per_chunk(pred: Prediction) -> list[int | None]:
    """Per chunk, how many of its first layers layer-wise ZeRO keeps at ZeRO-3 (only without
    a pipeline: one chunk a device); None where every layer is at the stage's level."""
    out: list[int | None] = []
    for c, (a, b) in enumerate(pred.ranges):
        k = pred.stages[device_of_chunk(pred.config.schedule, c, pred.config.pp)].resharded
        out.append(k if pred.config.layerwise_zero and k is not None and k < b - a else None)
    return out


def _checkpointed_per_chunk(pred: Prediction) -> list[int | None]:
    """Per chunk, how many of its layers partial checkpointing checkpoints (a device's first
    k layers, chunk by chunk in order); None for the other modes (all or none)."""
    config = pred.config
    if config.checkpointing != PARTIAL:
        return [None] * len(pred.ranges)
    left = [st.checkpointed for st in pred.stages]
    out = []
    for c, (a, b) in enumerate(pred.ranges):
        s = device_of_chunk(config.schedule, c, config.pp)
        out.append(min(left[s], b - a))
        left[s] -= out[-1]
    return out


def _modules(nodes: list[OpNode]) -> list[str]:
    """The stage's modules: each layer block by its path up to its index ("blocks.3",
    transformers' "model.layers.3"), the rest by their top-level name. Graph mode finds the
    blocks it checkpoints and reduces gradients by here."""
    out: list[str] = []
    for n in nodes:
        if n.kind == "input" or not n.module:
            continue
        parts = n.module.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        top = ".".join(parts[: index + 1]) if index is not None else parts[0]
        if top not in out:
            out.append(top)
    return out


def _batched(graph) -> dict[str, list[bool]]:
    """Per node, whether each of its inputs, then its output, carries the batch: what is
    computed from the model's inputs does (their dim 0 is the samples'), what comes from
    constants and parameters only does not (a position embedding's (seq, hidden) rows)."""
    sources: dict[str, dict[int, str]] = {}
    for e in graph.edges:
        sources.setdefault(e.dst, {})[e.dst_input] = e.src
    batched: set[str] = set()
    for n in graph.nodes:  # in graph order: a node's producers come before it
        ins = sources.get(n.name, {}).values()
        if n.kind == "input" or (n.kind != "constant" and any(s in batched for s in ins)):
            batched.add(n.name)
    return {
        n.name: [sources.get(n.name, {}).get(i) in batched for i in range(len(n.inputs))]
        + [n.name in batched]
        for n in graph.nodes
    }


def _sharding(node: OpNode, lay: NodeLayout, zero: int, batched: dict) -> NodeSharding:
    """Placements on (dp, tp): the data split on dp (tensors that carry the batch),
    parameters sharded there under ZeRO-3."""
    dp_param = shard(0) if zero == 3 else REPLICATE
    flags = batched.get(node.name)
    dp_in = [shard(0) if flags is None or f else REPLICATE for f in (flags or [])[:-1]]
    dp_act = REPLICATE if node.kind == "constant" or (flags and not flags[-1]) else shard(0)
    # Built from layouts the planner made (valid placements, today's strategy names): not
    # validated again, which for every node of an 80-layer model costs a warm search ~10%.
    return NodeSharding.model_construct(
        node=node.name,
        strategy=lay.strategy,
        module=node.module,
        kind=node.kind,
        params={name: [dp_param, lay.params.get(name, REPLICATE)] for name in node.params},
        inputs=[[dp_in[i] if i < len(dp_in) else dp_act, s] for i, s in enumerate(lay.inputs)],
        outputs=[[dp_act, s] for s in lay.outputs],
    )
