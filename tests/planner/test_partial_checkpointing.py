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
