"""What to change when a configuration does not fit: each single change a user
would reach for (ZeRO-3, full checkpointing, a smaller micro-batch, more tensor or pipeline
parallelism, CPU offload, twice the nodes) priced under the same cost model; the ones that
fit are listed fastest first, with the flag that makes them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.cluster.profile import ClusterProfile
from planner.errors import InputError
from planner.evaluate.config import ParallelConfig
from planner.evaluate.predict import predict
from planner.graph.batch import rescale_batch
from planner.graph.opgraph import OpGraph
from planner.intra_op.megatron import tensor_parallel_layout
from planner.parallel.registry import stores
from planner.plan import TrainingSettings
from planner.units import human_bytes


@dataclass(frozen=True)
class Remedy:
    change: str  # what to change, with the flag
    config: ParallelConfig
    cluster: ClusterProfile
    step_time_s: float = 0.0
    peak_memory_bytes: int = 0


def _changes(cfg: ParallelConfig, cluster: ClusterProfile, batch: int) -> list[Remedy]:
    out = []
    if cfg.dp > 1 and cfg.zero < 3:
        out.append(Remedy("ZeRO-3 (--zero 3)", replace(cfg, zero=3), cluster))
    if cfg.checkpointing is not True:
        out.append(
            Remedy(
                "full checkpointing (--checkpointing)", replace(cfg, checkpointing=True), cluster
            )
        )
    mbs = cfg.microbatch_size(batch)
    for smaller in sorted({m for m in (mbs // 2, 1) if 1 <= m < mbs}, reverse=True):
        count = cfg.microbatches * mbs // smaller
        out.append(
            Remedy(
                f"micro-batch {smaller} (--microbatches {count})",
                replace(cfg, microbatches=count),
                cluster,
            )
        )
    if cfg.dp % 2 == 0:
        more_tp = replace(cfg, tp=cfg.tp * 2, dp=cfg.dp // 2, microbatches=cfg.microbatches * 2)
        out.append(Remedy(f"tp {cfg.tp * 2}, dp {cfg.dp // 2} (--tp, --dp)", more_tp, cluster))
        more_pp = replace(cfg, pp=cfg.pp * 2, dp=cfg.dp // 2, microbatches=cfg.microbatches * 2)
        out.append(Remedy(f"pp {cfg.pp * 2}, dp {cfg.dp // 2} (--pp, --dp)", more_pp, cluster))
    for mode, store in stores().items():
        if cfg.checkpointing is False and store.refusal(cluster) is None:
            stored = replace(cfg, checkpointing=mode)
            out.append(Remedy(f"{store.label} (--checkpointing {mode})", stored, cluster))
    if cfg.zero == 3 and cfg.dp > 1 and not cfg.offload and cluster.host is not None:
        out.append(Remedy("CPU offload (--cpu-offload)", replace(cfg, offload=True), cluster))
    if cfg.microbatches % 2 == 0:
        doubled = cluster.with_nodes(cluster.nodes * 2)
        twice = replace(cfg, dp=cfg.dp * 2, microbatches=cfg.microbatches // 2)
        out.append(
            Remedy(f"{doubled.nodes} nodes, dp {cfg.dp * 2} (--nodes, --dp)", twice, doubled)
        )
    return out


def remedies(
    graph: OpGraph,
    cluster: ClusterProfile,
    training: TrainingSettings,
    cfg: ParallelConfig,
    layers: int,
    model_config: dict | None = None,
    sequence_parallel: bool = False,
) -> list[Remedy]:
    """The single changes to `cfg` that fit, fastest first. `graph` is traced at `cfg`'s
    micro-batch size (a smaller one is rescaled from it: exact for work proportional to the
    batch, which every layer's activations are)."""
    batch = training.global_batch_size
    fitting = []
    for remedy in _changes(cfg, cluster, batch):
        try:
            remedy.config.validate(
                remedy.cluster, batch, layers, model_config, training.dtype, training.runtime
            )
        except InputError:
            continue  # the change is not a valid configuration here (heads, batch, schedule)
        mbs = remedy.config.microbatch_size(batch)
        g = graph if mbs == cfg.microbatch_size(batch) else rescale_batch(graph, mbs)
        tp = remedy.config.tp
        layouts = tensor_parallel_layout(g, tp, sequence_parallel=sequence_parallel and tp > 1)
        pred = predict(g, remedy.cluster, training, remedy.config, layouts=layouts)
        if pred.fits_in_memory:
            fitting.append(
                replace(
                    remedy, step_time_s=pred.step_time_s, peak_memory_bytes=pred.peak_memory_bytes
                )
            )
    return sorted(fitting, key=lambda r: r.step_time_s)


def remedy_lines(found: list[Remedy], usable_bytes: int) -> list[str]:
    """The explanation's lines: what to change, or that no single change is enough."""
    if not found:
        return [
            "What to change: no single change (ZeRO-3, full checkpointing, activation "
            "offload, a smaller micro-batch, more tp or pp, CPU offload, twice the nodes) "
            "makes it fit in "
            f"{human_bytes(usable_bytes)}; `autopar plan` searches them together."
        ]
    return [
        f"To fit: {r.change}: {human_bytes(r.peak_memory_bytes)}, {r.step_time_s:.3f} s per step."
        for r in found[:5]
    ]
