"""ZB-V and DualPipeV (planner/cost/schedule_v.py): two chunks per device in a V, so the
first device runs the embedding's chunk and the head's. The search takes ZB-V where the
model's ends are light (a small vocabulary) and leaves it where they make the first device the
slowest; its split gives the two end chunks fewer layers. DualPipeV wins or loses against it
as the forward, input- and weight-gradient times compare. The executor runs both against the
single-process reference (tests/executor/test_execute.py, cases pp2xdp2-zbv and
pp2xdp2-dualpipe-v); their orders, step times and in-flight counts are checked against
torch's own (tests/executor/test_schedule_orders.py)."""

import itertools

import pytest

from planner.evaluate.config import ParallelConfig
from planner.evaluate.predict import predict
from planner.parallel.pipeline import SEARCHED_SCHEDULES
from planner.search.search import search
from planner.search.space import SearchOptions
from tests.conftest import planning_inputs

ALL = ("1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble")
TRAINING = {"global_batch_size": 64, "seq_len": 1024, "dtype": "bf16"}


def _plan(inputs, schedules):
    options = SearchOptions(
        mesh=(4, 2, 1),
        schedules=schedules,
        layouts=("megatron",),
        checkpointing=(False,),
        microbatch_sizes=(4,),
    )
    return search(inputs, options).plan


def test_zbv_wins_where_the_ends_are_light():
    # 8 layers on 4 stages: the interleaved schedules get at most 2 chunks per device too,
    # and ZB-V's turn on the last device saves a send each way.
    inputs = planning_inputs({"name": "gpt-350m", "config": {"layers": 8, "vocab": 1024}}, TRAINING)
    chosen = _plan(inputs, ALL)
    without = _plan(inputs, ALL[:-1])
    assert chosen.schedule.name == "zbv_zero_bubble"
    assert chosen.schedule.virtual_stages == 2
    assert chosen.predicted.step_time_s < without.predicted.step_time_s
    ranks = [st.ranks for st in chosen.stages]
    assert ranks == ranks[:4] + ranks[:4][::-1]  # device d runs chunks d and 7 - d


def test_zbv_loses_where_the_first_device_holds_a_large_head():
    # GPT's 51,200-token vocabulary: the embedding and the LM head both on device 0.
    inputs = planning_inputs({"name": "gpt-350m", "config": {"layers": 16}}, TRAINING)
    chosen = _plan(inputs, ALL)
    zbv = _plan(inputs, ("zbv_zero_bubble",))
    assert chosen.schedule.name != "zbv_zero_bubble"
    assert zbv.predicted.step_time_s > chosen.predicted.step_time_s
    # Its split moves layers off the first device's two chunks, and that is faster.
    sizes = [st.layers[1] - st.layers[0] for st in zbv.stages]
    assert sizes[0] + sizes[-1] < 2 * max(sizes[1:-1])
    m, zero = zbv.schedule.microbatches, zbv.stages[0].zero
    config = ParallelConfig(2, 1, 4, m, "zbv_zero_bubble", 2, zero, False)
    args = (inputs.at(4), inputs.cluster, inputs.training, config)
    balanced = predict(*args).step_time_s
    split = predict(*args, ranges=[tuple(st.layers) for st in zbv.stages]).step_time_s
    assert split < balanced
    assert zbv.predicted.step_time_s == split


def test_the_viewers_gantt_runs_zbv_chunks_in_a_v():
    from api.gantt import timeline

    p, m = 4, 8
    blocks = timeline("zbv_zero_bubble", [1.0] * p, m, 2)
    assert len(blocks) == 2 * 2 * p * m  # F and B of each device's two chunks
    end = {(b.device, b.chunk, b.kind, b.microbatch): b.end for b in blocks}
    for b in blocks:
        if b.kind == "F" and b.chunk == 1:  # chunk 2p - 1 - d follows chunk 2p - 2 - d
            before = (b.device + 1, 1) if b.device < p - 1 else (b.device, 0)
            assert b.start >= end[(*before, "F", b.microbatch)]


def test_in_flight_counts_are_those_of_the_order():
    from planner.cost.schedule_v import zbv_inflight, zbv_order

    for pp, m in itertools.product(range(1, 10), range(1, 45)):
        for device, actions in enumerate(zbv_order(pp, m)):
            held = peak = 0
            for _, kind, _ in actions:
                held += {"F": 1, "B": 0, "W": -1}[kind]
                peak = max(peak, held)
            assert zbv_inflight(device, pp, m) == peak / 2, (pp, m, device)


def _moe_plan(schedules, checkpointing):
    training = {"global_batch_size": 64, "seq_len": 1024, "dtype": "bf16"}
    inputs = planning_inputs({"name": "moe-380m"}, training)
    options = SearchOptions(
        mesh=(2, 4, 1),
        schedules=schedules,
        layouts=("megatron",),
        checkpointing=checkpointing,
        microbatch_sizes=(2,),
    )
    return search(inputs, options).plan


def test_dualpipe_v_loses_against_zbv_and_neither_runs_with_checkpointing():
    """DualPipeV's order (its paired forward and backward run one after the other, as torch
    runs them without an overlapping callback) is timed like ZB-V's: without checkpointing
    ZB-V beats it, and it holds one more chunk's activations per device. With full
    checkpointing neither is offered: the run would keep what it rebuilds for the input
    gradients until the weight gradients (planner.parallel.checkpointing.schedule_refusal)."""
    everything = (*ALL, "dualpipe_v")
    with_checkpointing = _moe_plan(everything, (True,))
    assert with_checkpointing.schedule.name in ("1f1b", "interleaved_1f1b")
    plain = _moe_plan(everything, (False,))
    dual, zbv = (_moe_plan((s,), (False,)).predicted for s in ("dualpipe_v", "zbv_zero_bubble"))
    assert plain.schedule.name != "dualpipe_v"
    assert dual.step_time_s > zbv.step_time_s and dual.peak_memory_bytes > zbv.peak_memory_bytes


def test_a_pinned_schedule_that_runs_with_no_micro_batch_count_is_named():
    from planner.search.search import NoFeasiblePlan

    inputs = planning_inputs({"name": "gpt-350m", "config": {"layers": 8}}, TRAINING)
    options = SearchOptions(
        mesh=(4, 2, 1), schedules=("dualpipe_v",), layouts=("megatron",), microbatch_sizes=(8,)
    )
    with pytest.raises(NoFeasiblePlan) as err:
        search(inputs, options)  # 64 / (2 x 8) = 4 micro-batches; DualPipeV needs 8
    assert err.value.reason == "schedule"
    assert "dualpipe_v needs at least 2 pp = 8 micro-batches (4)" in err.value.explanation[0]


def test_looped_bfs_loses_to_interleaved_1f1b_and_holds_every_micro_batch():
    """Looped BFS, pinned (it is not searched): with identical chunks its replay takes
    exactly interleaved 1F1B's step time; on a model whose first and last chunks carry the
    embedding and the head it is slower, and it holds every micro-batch's activations."""
    from planner.cost.schedule_v import v_time
    from planner.cost.schedules import pipeline_time

    for pp, v, m in ((2, 2, 4), (4, 2, 8), (4, 3, 8)):
        replayed = v_time("looped_bfs", [(1.0, 1.2, 0.8)] * (pp * v), m, pp)
        assert replayed == pytest.approx(pipeline_time([3.0 * v] * pp, m, v))
    inputs = planning_inputs({"name": "gpt-350m", "config": {"layers": 8}}, TRAINING)

    def pinned(schedule):
        options = SearchOptions(
            mesh=(4, 2, 1),
            schedules=(schedule,),
            layouts=("megatron",),
            checkpointing=(False,),
            microbatch_sizes=(4,),
            virtual_stages=(2,),
        )
        return search(inputs, options).plan

    bfs, interleaved = pinned("looped_bfs"), pinned("interleaved_1f1b")
    assert bfs.schedule.name == "looped_bfs" and bfs.schedule.virtual_stages == 2
    assert bfs.predicted.step_time_s > interleaved.predicted.step_time_s
    assert bfs.predicted.peak_memory_bytes > interleaved.predicted.peak_memory_bytes
    assert "looped_bfs" not in SEARCHED_SCHEDULES


def test_a_replay_past_its_limit_is_refused_naming_the_field():
    from planner.cluster.profile import load_cluster
    from planner.errors import InputError
    from planner.parallel.pipeline import virtual_stage_counts

    m = 2**20  # 3 x 4 stages x 2 chunks x m actions: far over the limit
    config = ParallelConfig(2, 1, 4, m, "zbv_zero_bubble", 2, 1, False)
    with pytest.raises(InputError, match=r"schedule\.microbatches.*replays its order"):
        config.validate(load_cluster("dgx-a100-80g"), 2 * m, 8, {})
    assert virtual_stage_counts("looped_bfs", 4, 8, (1, 2), microbatches=m) == []
    assert virtual_stage_counts("looped_bfs", 4, 8, (1, 2), microbatches=8) == [1, 2]
