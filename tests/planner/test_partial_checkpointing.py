"""Partial checkpointing: full checkpointing of the fewest layers per pipeline stage that fit.
It is chosen where memory lies just above full checkpointing's (stage 0, holding the most
micro-batches, checkpoints the most layers), never costs more than full checkpointing or none,
and loses to no checkpointing where memory is ample."""

import pytest

from planner.evaluate.config import ParallelConfig
from planner.evaluate.predict import predict
from planner.search.search import search
from planner.search.space import SearchOptions
from tests.conftest import planning_inputs

ALL = (False, "selective", "partial", True)


def _inputs(memory_gib=None):
    training = {"global_batch_size": 16, "seq_len": 1024, "dtype": "bf16"}
    return planning_inputs({"name": "gpt-350m"}, training, memory_gib=memory_gib)


def _plan(inputs, checkpointing):
    options = SearchOptions(
        mesh=(4, 1, 2),
        layouts=("megatron",),
        checkpointing=checkpointing,
        microbatch_sizes=(1,),
        schedules=("1f1b",),
    )
    return search(inputs, options).plan


def _gib(nbytes: int) -> float:
    return nbytes / 2**30


def test_partial_wins_just_above_full_checkpointings_memory():
    full_peak = _gib(_plan(_inputs(), (True,)).predicted.peak_memory_bytes)
    capacity = full_peak * 1.013
    tight = _inputs(capacity)
    plan = _plan(tight, ALL)
    full = _plan(tight, (True,))
    counts = [
        (
            st.checkpointed_layers
            if st.checkpointed_layers is not None
            else st.layers[1] - st.layers[0]
        )
        if st.activation_checkpointing
        else 0
        for st in plan.stages
    ]
    assert any(st.checkpointed_layers is not None for st in plan.stages) or len(set(counts)) > 1
    assert plan.predicted.step_time_s < full.predicted.step_time_s
    assert all(st.checkpoint_policy == "full" for st in plan.stages)
    assert counts[0] >= counts[1] >= counts[2]  # stage s holds pp - s micro-batches in flight
    for st in plan.stages:
        assert st.predicted.memory.total <= capacity * 2**30
    # Where a stage checkpoints nothing, it fits without checkpointing; where it checkpoints
    # some layers, it would not.
    mesh = plan.mesh.shape
    ranges = [tuple(st.layers) for st in plan.stages]
    bare = ParallelConfig(mesh[1], mesh[2], mesh[0], plan.schedule.microbatches)
    graph = tight.at(1)
    none = predict(graph, tight.cluster, tight.training, bare, ranges=ranges)
    for k, figures in zip(counts, none.stages, strict=True):
        assert (figures.memory.total > capacity * 2**30) == (k > 0)


def test_partial_loses_to_none_where_memory_is_ample_and_covers_full_where_it_is_not():
    ample = _inputs()
    assert not any(st.activation_checkpointing for st in _plan(ample, ALL).stages)
    assert _plan(ample, ("partial",)).predicted.step_time_s == pytest.approx(
        _plan(ample, (False,)).predicted.step_time_s, rel=1e-12
    )
    # With every layer checkpointed, partial is full checkpointing, to the byte.
    inputs = _inputs()
    graph = inputs.at(1)
    args = (graph, inputs.cluster, inputs.training)
    tiny = inputs.cluster.model_copy(
        update={"device": inputs.cluster.device.model_copy(update={"memory_bytes": 1})}
    )
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2)):
        full = predict(*args, ParallelConfig(1, 2, 4, 16, schedule, v, 1, True))
        partial = predict(
            graph, tiny, inputs.training, ParallelConfig(1, 2, 4, 16, schedule, v, 1, "partial")
        )
        assert partial.step_time_s == pytest.approx(full.step_time_s, rel=1e-12)
        assert partial.peak_memory_bytes == full.peak_memory_bytes
        assert [st.checkpointed for st in partial.stages] == [
            sum(b - a for a, b in full.ranges[s::4]) for s in range(4)
        ]


def test_partial_recompute_floor_is_below_every_prediction():
    """The search's step bound for partial checkpointing counts the fewest layers that must be
    checkpointed to fit; no prediction under any split that fits is below it, and with
    memory tight it is above the bound without it (so it prunes)."""
    import itertools

    from planner.cluster.mesh import LogicalMesh
    from planner.cost.model import CostModel
    from planner.evaluate.layer_table import build_table
    from planner.intra_op.megatron import tensor_parallel_layout
    from planner.search.bounds import partial_recompute_floor, step_lower_bound, table_work

    inputs = _inputs()
    graph, training = inputs.at(1), inputs.training
    cm = CostModel(inputs.cluster, training.dtype)
    table, _ = build_table(
        graph,
        tensor_parallel_layout(graph, 2),
        cm,
        LogicalMesh.contiguous(inputs.cluster, 0, (1, 2)),
    )
    none_peak = _gib(_plan(inputs, (False,)).predicted.peak_memory_bytes)
    full_peak = _gib(_plan(inputs, (True,)).predicted.peak_memory_bytes)
    layers, positive = graph.num_layers, 0
    splits = [  # balanced, and the first stages lighter or heavier
        [(0, 6), (6, 12), (12, 18), (18, 24)],
        [(0, 4), (4, 9), (9, 16), (16, 24)],
        [(0, 8), (8, 14), (14, 19), (19, 24)],
    ]
    assert all(r[-1][1] == layers for r in splits)
    for share, (schedule, v), zero in itertools.product(
        (0.3, 0.6, 0.9), (("1f1b", 1), ("interleaved_1f1b", 2)), (0, 1)
    ):
        capacity = (full_peak + share * (none_peak - full_peak)) * 2**30
        cluster = inputs.cluster.model_copy(
            update={
                "device": inputs.cluster.device.model_copy(update={"memory_bytes": int(capacity)})
            }
        )
        cfg = ParallelConfig(1, 2, 4, 16, schedule, v, zero, "partial")
        floor = partial_recompute_floor(table, cfg, training, capacity)
        positive += floor > 0
        bound = step_lower_bound(
            table, cfg, training.optimizer, cm.mem_rate, table_work(table, "partial") + floor
        )
        for ranges in splits if v == 1 else [None]:
            pred = predict(graph, cluster, training, cfg, ranges=ranges)
            if pred.fits_in_memory:
                assert bound <= pred.step_time_s * (1 + 1e-12), (share, schedule, zero, ranges)
    assert positive >= 4


def test_partial_recompute_floor_is_nearly_exact_on_one_stage():
    """One stage of identical layers: the floor counts the layers that must be checkpointed;
    the prediction checkpoints those and at most two more (it also rebuilds one layer)."""
    from planner.cluster.mesh import LogicalMesh
    from planner.cost.model import CostModel
    from planner.evaluate.layer_table import build_table
    from planner.intra_op.megatron import tensor_parallel_layout
    from planner.search.bounds import partial_recompute_floor

    training = {"global_batch_size": 16, "seq_len": 1024, "dtype": "bf16"}
    inputs = planning_inputs({"name": "gpt-350m", "config": {"vocab": 256}}, training)
    graph, training = inputs.at(1), inputs.training
    cm = CostModel(inputs.cluster, training.dtype)
    mesh = LogicalMesh.contiguous(inputs.cluster, 0, (1, 2))
    table, _ = build_table(graph, tensor_parallel_layout(graph, 2), cm, mesh)
    none = predict(graph, inputs.cluster, training, ParallelConfig(1, 2, 1, 16, zero=1))
    ckpt = ParallelConfig(1, 2, 1, 16, zero=1, checkpointing=True)
    full = predict(graph, inputs.cluster, training, ckpt)
    per_layer = (full.stages[0].compute - none.stages[0].compute) / graph.num_layers
    low, high = full.peak_memory_bytes, none.peak_memory_bytes
    checked = 0
    for share in (0.2, 0.5, 0.8):
        capacity = int(low + share * (high - low))
        device = inputs.cluster.device.model_copy(update={"memory_bytes": capacity})
        cluster = inputs.cluster.model_copy(update={"device": device})
        cfg = ParallelConfig(1, 2, 1, 16, zero=1, checkpointing="partial")
        pred = predict(graph, cluster, training, cfg)
        if not pred.fits_in_memory:
            continue
        actual = pred.stages[0].compute - none.stages[0].compute
        floor = partial_recompute_floor(table, cfg, training, capacity)
        assert actual - 2.01 * per_layer <= floor <= actual * (1 + 1e-9), share
        checked += 1
    assert checked >= 2
