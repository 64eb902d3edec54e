"""The interleaved zero-bubble schedule (planner/cost/schedules.py): the search takes it where
the bubble costs time and memory is ample, and leaves it where its later stages, which hold
as many micro-batches as the first, do not fit. The executor runs it against the
single-process reference (tests/executor/test_execute.py, case pp2xdp2-zero-bubble-v2); its
step time and in-flight counts are checked against torch's own action lists
(tests/executor/test_schedule_orders.py)."""

from planner.cluster.mesh import LogicalMesh
from planner.cost.model import CostModel
from planner.evaluate.config import ParallelConfig
from planner.evaluate.layer_table import build_table
from planner.evaluate.predict import predict
from planner.inter_op.stage_inputs import dp_ranges
from planner.intra_op.megatron import tensor_parallel_layout
from planner.search.search import search
from planner.search.space import SearchOptions
from tests.conftest import planning_inputs

GPT = {"name": "gpt-350m"}  # 24 layers, hidden 1024, a 51,200-token vocabulary


def _inputs(memory_gib: float | None = None):
    training = {"global_batch_size": 64, "seq_len": 1024, "dtype": "bf16"}
    return planning_inputs(GPT, training, memory_gib=memory_gib)


def _plan(inputs, schedules, checkpointing=(False,), virtual_stages=None, zeros=(0, 1, 2, 3)):
    options = SearchOptions(
        mesh=(4, 2, 1),
        zero_stages=zeros,
        schedules=schedules,
        layouts=("megatron",),
        checkpointing=checkpointing,
        microbatch_sizes=(4,),
        virtual_stages=virtual_stages,
    )
    return search(inputs, options).plan


def test_zero_bubble_wins_where_memory_is_ample():
    inputs = _inputs()
    chosen = _plan(inputs, ("1f1b", "interleaved_1f1b", "interleaved_zero_bubble"))
    interleaved = _plan(inputs, ("1f1b", "interleaved_1f1b"))
    assert chosen.schedule.name == "interleaved_zero_bubble"
    assert chosen.predicted.step_time_s < interleaved.predicted.step_time_s
    assert chosen.predicted.bubble_fraction < interleaved.predicted.bubble_fraction


def test_zero_bubble_loses_where_its_last_stages_do_not_fit():
    # 1F1B's last stage holds one micro-batch of the LM head's logits, the zero-bubble
    # schedule's holds pp = 4: with the memory between the two peaks only 1F1B fits (one ZeRO
    # level for both: the zero-bubble schedule runs no ZeRO-3).
    ample = _inputs()
    one_f = _plan(ample, ("1f1b",), zeros=(1,)).predicted.peak_memory_bytes
    zb = _plan(ample, ("interleaved_zero_bubble",), virtual_stages=(1,), zeros=(1,)).predicted
    zb = zb.peak_memory_bytes
    assert zb > one_f
    tight = _inputs(memory_gib=(one_f + zb) / 2 / 2**30)
    both = ("1f1b", "interleaved_zero_bubble")
    chosen = _plan(tight, both, virtual_stages=(1,), zeros=(1,))
    assert chosen.schedule.name == "1f1b"


def test_uneven_chunks_fit_where_even_ones_do_not():
    """With two chunks per device the stage DP (over pp x v chunks) moves layers off the last
    chunk, which holds the LM head's logits for pp micro-batches: between the two peaks only
    its uneven split fits, and the search takes it."""
    ample = _inputs()
    graph = ample.at(4)
    config = ParallelConfig(2, 1, 4, 8, "interleaved_zero_bubble", 2, 1)
    cm = CostModel(ample.cluster, "bf16")
    mesh = LogicalMesh.contiguous(ample.cluster, 0, (1, 1))
    table, _ = build_table(graph, tensor_parallel_layout(graph, 1), cm, mesh)
    uneven = dp_ranges(table, config, ample.training, ample.cluster, cm)
    assert len({b - a for a, b in uneven}) > 1 and uneven[-1][1] - uneven[-1][0] < 3
    args = (graph, ample.cluster, ample.training, config)
    low = predict(*args, ranges=uneven).peak_memory_bytes
    high = predict(*args).peak_memory_bytes
    assert low < high
    tight = _inputs(memory_gib=(low + high) / 2 / 2**30)
    plan = _plan(tight, ("interleaved_zero_bubble",), virtual_stages=(2,))
    sizes = [st.layers[1] - st.layers[0] for st in plan.stages]
    assert len(set(sizes)) > 1 and plan.predicted.fits_in_memory
