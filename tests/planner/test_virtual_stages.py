"""Interleaved 1F1B with any number of chunks per device (planner/parallel/pipeline.py): the
search takes more chunks where the bubble dominates and keeps two where every extra chunk
adds sends over slow links; pins are checked. The executor runs three chunks per device
against the single-process reference (tests/executor/test_execute.py, case
pp2xdp2-interleaved-v3)."""

import pytest

from planner.cluster.profile import load_cluster
from planner.errors import InputError
from planner.request import resolve_request, search_options
from planner.search.search import search
from planner.search.space import SearchOptions

GPT = {"name": "gpt-1.3b"}  # 24 layers


def _inputs(cluster: str, nodes: int, batch: int, dtype: str):
    profile = load_cluster(cluster).with_nodes(nodes)
    training = {"global_batch_size": batch, "seq_len": 1024, "dtype": dtype}
    return resolve_request(GPT, profile, training).trace()


def _plan(inputs, mesh, v=None):
    options = SearchOptions(
        mesh=mesh,
        schedules=("interleaved_1f1b",),
        virtual_stages=None if v is None else (v,),
        layouts=("megatron",),
    )
    return search(inputs, options).plan


def test_more_chunks_win_where_the_bubble_dominates():
    # 4 stages in one NVLink node, 8 micro-batches: the bubble shrinks as 1/v, sends are cheap.
    inputs = _inputs("dgx-a100-80g", 1, 16, "bf16")
    chosen = _plan(inputs, (4, 2, 1))
    two = _plan(inputs, (4, 2, 1), v=2)
    assert chosen.schedule.virtual_stages > 2
    assert len(chosen.stages) == 4 * chosen.schedule.virtual_stages
    assert chosen.predicted.step_time_s < two.predicted.step_time_s
    assert chosen.predicted.bubble_fraction < two.predicted.bubble_fraction


def test_more_chunks_lose_where_every_send_crosses_nodes():
    # 8 stages, one per node of 8 V100s: each extra chunk adds two sends between nodes.
    inputs = _inputs("aws-p3.16xlarge", 8, 64, "fp16")
    chosen = _plan(inputs, (8, 8, 1))
    three = _plan(inputs, (8, 8, 1), v=3)
    assert chosen.schedule.virtual_stages == 2
    assert chosen.predicted.step_time_s < three.predicted.step_time_s


def test_pins_are_checked_and_name_the_field():
    with pytest.raises(InputError) as err:
        search_options({"schedule": "1f1b", "virtual_stages": 3})
    assert err.value.field == "search.virtual_stages"
    with pytest.raises(InputError) as err:
        search_options({"schedule": "interleaved_1f1b", "virtual_stages": 1})
    assert err.value.field == "search.virtual_stages"
    assert search_options({"virtual_stages": 3}).virtual_stages == (3,)
    zb = search_options({"schedule": "interleaved_zero_bubble", "virtual_stages": 1})
    assert zb.schedules == ("interleaved_zero_bubble",) and zb.virtual_stages == (1,)
    with pytest.raises(InputError) as err:  # the executor's FSDP2 does not run under it
        search_options({"schedule": "interleaved_zero_bubble", "zero": 3})
    assert err.value.field == "search.zero"
    inputs = _inputs("dgx-a100-80g", 1, 16, "bf16")
    with pytest.raises(InputError) as err:
        _plan(inputs, (8, 1, 1), v=4)  # 32 chunks, 24 layers
    assert err.value.field == "search.virtual_stages" and "at most 3" in err.value.expected
