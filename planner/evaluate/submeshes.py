"""A pipeline whose stages run on different submeshes (planner.inter_op.submesh_dp): each
stage priced on its own (dp, tp) mesh with its own layout's LayerTable, then one pipeline.

A stage's terms are predict()'s for that stage (planner.evaluate.predict.stage_figures: its
chunk's compute and tensor-parallel communication, recomputation, its ZeRO group's memory
and gradient sync on its own dp ranks); the pipeline micro-batch is the same for every stage,
split over each stage's dp (`microbatch_size` samples per rank = pipeline micro-batch / dp).
Between two stages the boundary activation is resharded from one submesh's layout to the
other's (Alpa's cross-mesh resharding): a receiving rank takes the rows its dp rank owns,
1/tp of them from each sender it maps to, so the send per rank is the larger of the two
sides' per-rank shares, over the link between the two submeshes' first ranks. For every stage
on the same (dp, tp) this is predict() to the bit (tests/planner/test_submesh_search.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.cluster.mesh import MeshAxis
from planner.cluster.profile import ClusterProfile
from planner.cost.model import CostModel
from planner.evaluate.chunk_costs import add_overhead, chunk_costs
from planner.evaluate.config import ParallelConfig
from planner.evaluate.explain import explain
from planner.evaluate.layer_table import LayerTable
from planner.evaluate.predict import (
    GraphFacts,
    Prediction,
    pipeline_prediction,
    predict,
    stage_figures,
)
from planner.evaluate.to_plan import predicted_figures, to_plan
from planner.executable import plan_executor_mode
from planner.parallel import data, pipeline
from planner.parallel.tensor import is_sequence_parallel, tp_layout_name
from planner.plan import (
    LedgerEntry,
    MemoryPrediction,
    MeshSpec,
    Plan,
    ScheduleSpec,
    StageLedger,
    StagePrediction,
    TrainingSettings,
)


@dataclass(frozen=True)
class StageMesh:
    """Stage s of a per-stage plan: its submesh (consecutive ranks from `first_rank`), its
    configuration (dp and tp of the submesh, its own ZeRO level, HSDP and checkpointing; pp,
    micro-batches and schedule the plan's), its layout kind and its table, priced at its
    micro-batch."""

    first_rank: int
    config: ParallelConfig
    layout: str
    microbatch_size: int
    table: LayerTable

    @property
    def devices(self) -> int:
        return self.config.dp * self.config.tp

    @property
    def ranks(self) -> list[list[int]]:
        """[dp][tp], tp fastest, as ParallelConfig.ranks lays out a stage."""
        dp, tp = self.config.dp, self.config.tp
        return [[self.first_rank + d * tp + t for t in range(tp)] for d in range(dp)]


@dataclass(frozen=True)
class PerStagePrediction:
    prediction: Prediction  # config: stage 0's; stages: each its own
    meshes: tuple[StageMesh, ...]

    @property
    def step_time_s(self) -> float:
        return self.prediction.step_time_s

    @property
    def uniform(self) -> bool:
        return uniform(self.meshes)


def uniform(meshes) -> bool:
    """Every stage the same: mesh, layout, ZeRO level, HSDP and checkpointing (such a plan
    is a one-mesh plan, run by torch's pipeline schedules)."""
    shapes = {(m.config.dp, m.config.tp, m.layout) for m in meshes}
    settings = {(m.config.zero, m.config.dp_shard, m.config.checkpointing) for m in meshes}
    return len(shapes) == 1 and len(settings) == 1


def boundary_sends(cm: CostModel, meshes, ranges) -> list[float]:
    """Per stage, the time of its boundary sends: the activation forward and its gradient
    back at each end shared with a neighbour. Stages on their own submeshes: each rank's
    piece point to point, then the receiving rank's tp group gathering its rows
    (executor.submesh_pipeline); one mesh for all: as predict() prices torch's pipeline."""
    gather = not uniform(meshes)
    out = [0.0] * len(meshes)
    for s in range(len(meshes) - 1):
        a, b = meshes[s], meshes[s + 1]
        cut = ranges[s][1]
        rows_a, rows_b = a.table.cut_bytes[cut], b.table.cut_bytes[cut]  # a dp rank's
        per_rank = max(rows_a / a.config.tp, rows_b / b.config.tp)
        cost = cm.send_recv(per_rank, cm.p2p_axis(a.first_rank, b.first_rank))
        out[s] += cost + (_tp_gather(cm, a, rows_a) if gather else 0.0)  # the gradient's
        out[s + 1] += cost + (_tp_gather(cm, b, rows_b) if gather else 0.0)
    return out


def _tp_gather(cm: CostModel, mesh: StageMesh, nbytes: float) -> float:
    tp = mesh.config.tp
    if tp == 1:
        return 0.0
    ranks = list(range(mesh.first_rank, mesh.first_rank + tp))
    bandwidth, latency, crosses = cm.cluster.group_link(ranks)
    return cm.all_gather(nbytes, MeshAxis("tp", tp, bandwidth, latency, crosses))


def reshard_ledger(ledger: StageLedger, s: int, meshes, cuts: list[float]) -> StageLedger:
    """Stage s's ledger with its boundary messages as executor.submesh_pipeline sends them,
    per micro-batch at each end shared with a neighbour: its piece of the boundary tensor
    (1/tp of its dp rank's rows) in as many messages as the neighbour's pieces it meets,
    received forward and its gradient sent back (or the reverse at its output end), and
    the rows its tp group gathers. `cuts[s]`: the whole pipeline micro-batch's boundary
    bytes after stage s. The one-mesh ledger's pipeline sends are replaced, and its grad-norm
    all-reduce is over every rank ("world"; one mesh of single-device stages names it pp)."""
    cfg, m = meshes[s].config, meshes[0].config.microbatches
    mine = cfg.dp * cfg.tp
    totals: dict[tuple[str, str], list[int]] = {}
    for e in ledger.comm:
        if e.axis == "pp" and e.kind in ("send", "recv"):
            continue
        axis = "world" if e.axis == "pp" and e.kind == "all_reduce" else e.axis
        entry = totals.setdefault((e.kind, axis), [0, 0])
        entry[0] += e.calls
        entry[1] += e.bytes
    ends = []
    if s > 0:
        ends.append((meshes[s - 1].config, cuts[s - 1]))
    if s + 1 < len(meshes):
        ends.append((meshes[s + 1].config, cuts[s]))
    for other, whole in ends:
        piece = int(whole) // mine
        messages = -(-(other.dp * other.tp) // mine)  # their pieces meeting this rank's
        for kind in ("send", "recv"):
            entry = totals.setdefault((kind, "pp"), [0, 0])
            entry[0] += messages * m
            entry[1] += piece * m
        if cfg.tp > 1:
            entry = totals.setdefault(("all_gather", "tp"), [0, 0])
            entry[0] += m
            entry[1] += int(whole) // cfg.dp * m
    comm = [
        LedgerEntry(kind=k, axis=a, calls=c, bytes=b) for (k, a), (c, b) in sorted(totals.items())
    ]
    return ledger.model_copy(update={"comm": comm})


def predict_per_stage(
    facts: GraphFacts,
    cluster: ClusterProfile,
    training: TrainingSettings,
    meshes: list[StageMesh],
    ranges: list[tuple[int, int]],
) -> PerStagePrediction:
    """Step time and memory of the pipeline with stage s on meshes[s] holding ranges[s]."""
    first = meshes[0].config
    cm = CostModel.of_training(cluster, training, first.fp8)
    p, m, schedule = len(meshes), first.microbatches, first.schedule
    sends = boundary_sends(cm, meshes, ranges)
    chunks, stages, syncs, opts = [], [], [], []
    for s, mesh in enumerate(meshes):
        cfg, table = mesh.config, mesh.table
        kept = pipeline.kept_outputs(table.layer_inputs, ranges, schedule, p)
        own = chunk_costs(table, cfg.checkpointing, ranges, kept)
        add_overhead(own, cluster, cfg, ranges)
        own[s].p2p += sends[s]
        dp_axes = data.data_axes(cluster, mesh.first_rank, cfg)
        figures, sync, opt = stage_figures(
            s, own, ranges, dp_axes, cm, cluster, training, cfg, table
        )
        chunks.append(own[s])
        stages.append(figures)
        syncs.append(sync)
        opts.append(opt)
    microbatch = meshes[0].microbatch_size
    assert first.dp * microbatch * m == training.global_batch_size, "one pipeline micro-batch"
    prediction = pipeline_prediction(
        first, microbatch, list(ranges), chunks, stages, syncs, opts, cluster, facts, training
    )
    return PerStagePrediction(prediction, tuple(meshes))


def stage_config(
    dp: int,
    tp: int,
    stages: int,
    microbatches: int,
    schedule: str,
    zero: int,
    checkpointing,
    fp8: str | None,
    dp_shard: int = 0,
) -> ParallelConfig:
    """A stage's configuration: ZeRO has nothing to shard over one dp rank (level 0 there);
    `dp_shard` HSDP's shard group (0: all of dp)."""
    base = ParallelConfig(dp, tp, stages, microbatches, schedule, 1, zero, checkpointing)
    return replace(base, zero=zero if dp > 1 else 0, fp8=fp8, dp_shard=dp_shard)


# What executor.submesh_pipeline does not run (it takes the module path's stages, whose
# boundary tensors are whole on every tp rank)
TIED_ACROSS_SUBMESHES = (
    "its parameters are tied to another stage's (tied embeddings) on another submesh; the "
    "executor sums tied gradients only between stages on one mesh"
)
GRAPH_MODE = (
    "its layout runs in graph mode, whose pipeline takes one mesh for every stage (plan "
    "with Megatron's layout: tp_layout megatron)"
)
SEQUENCE_PARALLEL = (
    "sequence parallelism with stages on their own submeshes: the executor reshards boundary "
    "tensors that are whole on every tp rank"
)


def to_plan_per_stage(
    found: PerStagePrediction,
    graph_at,
    layouts_of,
    cluster: ClusterProfile,
    training: TrainingSettings,
    model,
    *,
    tokens_per_sample: int | None,
    solver: str,
    uniform_best_s: float | None = None,
) -> Plan:
    """The Plan of a per-stage prediction: each stage as to_plan() lays it out on its own
    mesh (shardings, and the ledger of its own collectives from its layout at its
    micro-batch; its pipeline sends as that mesh would make them, not the cross-mesh
    resharding), its ranks its submesh's, its figures the per-stage prediction's.
    `graph_at(mbs)` and `layouts_of(kind, mbs, tp)` are the search's
    (planner.search.layout_cache)."""
    pred, meshes = found.prediction, found.meshes
    ranges = pred.ranges
    cuts = [
        graph_at(mesh.microbatch_size).cut_bytes[b] * mesh.config.dp
        for mesh, (_, b) in zip(meshes, ranges, strict=True)
    ]
    stages, kinds, refusals = [], set(), []
    laid_out: dict[tuple, object] = {}  # one to_plan per distinct stage setting
    for s, mesh in enumerate(meshes):
        graph = graph_at(mesh.microbatch_size)
        kinds.add(mesh.layout if mesh.config.tp > 1 else None)
        setting = (mesh.config, mesh.layout, mesh.microbatch_size)
        if setting not in laid_out:
            own = predict(graph, cluster, training, mesh.config, table=mesh.table, ranges=ranges)
            laid_out[setting] = to_plan(
                own,
                graph,
                cluster,
                training,
                model,
                tokens_per_sample=tokens_per_sample,
                layouts=layouts_of(mesh.layout, mesh.microbatch_size, mesh.config.tp),
                tp_layout=tp_layout_name(mesh.layout),
                sequence_parallel=is_sequence_parallel(mesh.layout),
            )
        plan_s = laid_out[setting]
        if not plan_s.executable:
            refusals.append(f"stage {s}: {plan_s.not_executable_reason}")
        elif plan_executor_mode(plan_s) != "modules":
            refusals.append(f"stage {s}: {GRAPH_MODE}")
        figures, chunk = pred.stages[s], pred.chunks[s]
        stage = plan_s.stages[s]
        ledger = reshard_ledger(stage.predicted.ledger, s, meshes, cuts)
        if any(e.axis == "tied" for e in ledger.comm):
            refusals.append(f"stage {s}: {TIED_ACROSS_SUBMESHES}")
        stages.append(
            stage.model_copy(
                update={
                    "ranks": [r for row in mesh.ranks for r in row],
                    "predicted": StagePrediction(
                        compute_s=figures.compute,
                        comm_s=figures.comm,
                        p2p_s=chunk.p2p,
                        memory=MemoryPrediction(**figures.memory.as_dict()),
                        ledger=ledger,
                    ),
                }
            )
        )
        if s == 0:
            base = plan_s
    kinds.discard(None)
    layout = kinds.pop() if len(kinds) == 1 else "megatron"
    graph0 = graph_at(meshes[0].microbatch_size)
    predicted = predicted_figures(pred, cluster, training, graph0, tokens_per_sample)
    cfg = pred.config
    lines = explain(predicted, stages, cfg, cluster, pred.slowest_stage)
    lines[1] = (
        f"Pipeline bubble: {predicted.bubble_fraction:.1%} of the pipeline time with "
        f"{cfg.microbatches} micro-batches over {len(meshes)} stages ({cfg.schedule})."
    )
    per = "; ".join(
        f"stage {s} layers [{a}, {b}) on {m.devices} devices as dp {m.config.dp} x tp "
        f"{m.config.tp} (micro-batch {m.microbatch_size} per rank)"
        for s, (m, (a, b)) in enumerate(zip(meshes, ranges, strict=True))
    )
    lines.append(f"Each stage on its own submesh (Alpa's inter-operator pass): {per}.")
    if uniform_best_s is not None:
        gain = 1 - pred.step_time_s / uniform_best_s
        lines.append(
            f"The best plan with every stage on one mesh takes {uniform_best_s:.3f} s "
            + (
                f"({gain:.1%} slower than this one)."
                if gain >= 0
                else f"(this one takes {-gain:.1%} longer: stage_meshes per_stage was pinned)."
            )
        )
    if is_sequence_parallel(layout):
        refusals.append(SEQUENCE_PARALLEL)
    return base.model_copy(
        update={
            "executable": not refusals,
            "not_executable_reason": "; ".join(refusals) or None,
            "tp_layout": tp_layout_name(layout),
            "sequence_parallel": is_sequence_parallel(layout),
            "mesh": MeshSpec(
                shape=[len(meshes), 0, 0],
                ranks=[m.ranks for m in meshes],
                stage_meshes=[_stage_mesh(m.config) for m in meshes],
            ),
            "schedule": ScheduleSpec(name=cfg.schedule, microbatches=cfg.microbatches),
            "stages": stages,
            "predicted": predicted,
            "explanation": lines,
            "search": base.search.model_copy(update={"solver": solver}),
        }
    )


def _stage_mesh(cfg: ParallelConfig) -> list[int]:
    """[dp, tp], with HSDP [dp, tp, dp_shard]."""
    return [cfg.dp, cfg.tp, cfg.dp_shard] if cfg.hybrid else [cfg.dp, cfg.tp]
