"""The interleaved zero-bubble schedule (planner/cost/schedules.py): the search takes it where
the bubble costs time and memory is ample, and leaves it where its later stages, which hold
as many micro-batches as the first, do not fit. The executor runs it against the
single-process reference (tests/executor/test_execute.py, case pp2xdp2-zero-bubble-v2); its
step time and in-flight counts are checked against torch's own action lists
(tests/executor/test_schedule_orders.py)."""

from planner.cluster.profile import load_cluster
from planner.request import resolve_request
from planner.search.search import search
from planner.search.space import SearchOptions

GPT = {"name": "gpt-350m"}  # 24 layers, hidden 1024, a 51,200-token vocabulary


def _inputs(memory_gib: float | None = None):
    profile = load_cluster("dgx-a100-80g")
    if memory_gib is not None:
        device = profile.device.model_copy(update={"memory_bytes": int(memory_gib * 2**30)})
        profile = profile.model_copy(update={"device": device})
    training = {"global_batch_size": 64, "seq_len": 1024, "dtype": "bf16"}
    return resolve_request(GPT, profile, training).trace()


def _plan(inputs, schedules, checkpointing=(False,)):
    options = SearchOptions(
        mesh=(4, 2, 1),
        schedules=schedules,
        layouts=("megatron",),
        checkpointing=checkpointing,
        microbatch_sizes=(4,),
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
    # schedule's holds pp = 4: with the memory between the two peaks only 1F1B fits.
    ample = _inputs()
    one_f = _plan(ample, ("1f1b",)).predicted.peak_memory_bytes
    zb = _plan(ample, ("interleaved_zero_bubble",)).predicted.peak_memory_bytes
    assert zb > one_f
    tight = _inputs(memory_gib=(one_f + zb) / 2 / 2**30)
    chosen = _plan(tight, ("1f1b", "interleaved_zero_bubble"))
    assert chosen.schedule.name == "1f1b"
