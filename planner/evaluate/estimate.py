"""One hand-written configuration as a Plan: predict() then to_plan() (`autopar estimate`,
the calibration benches, tests)."""

from __future__ import annotations

import time

from planner.cluster.profile import ClusterProfile
from planner.evaluate.config import ParallelConfig
from planner.evaluate.predict import predict
from planner.evaluate.to_plan import to_plan
from planner.graph.opgraph import OpGraph
from planner.intra_op.node_layout import NodeLayout
from planner.plan import ModelRef, Plan, TrainingSettings


def evaluate(
    graph: OpGraph,
    cluster: ClusterProfile,
    training: TrainingSettings,
    config: ParallelConfig,
    model: ModelRef,
    *,
    tokens_per_sample: int | None = None,
    layouts: dict[str, NodeLayout] | None = None,
    ranges: list[tuple[int, int]] | None = None,
    started: float | None = None,
    detail: bool = True,
) -> Plan:
    """`graph` is traced at the configuration's micro-batch size; layouts default to
    Megatron's, ranges to balanced layer counts. Checks `config` first."""
    started = time.perf_counter() if started is None else started
    layers = max(graph.num_layers, 1)
    config.validate(
        cluster, training.global_batch_size, layers, model.config, training.dtype, training.runtime
    )
    pred = predict(graph, cluster, training, config, layouts=layouts, ranges=ranges)
    return to_plan(
        pred,
        graph,
        cluster,
        training,
        model,
        tokens_per_sample=tokens_per_sample,
        layouts=layouts,
        detail=detail,
        started=started,
    )
