"""HSDP (hybrid sharding, planner/parallel/data.py): ZeRO-3 sharded within a node and
replicated across nodes trades memory for inter-node traffic. The search takes it where the
network between nodes is slow and the node-local shards fit, and leaves it where they do not.
The executor runs it (FSDP2 on a 2-D mesh) against the single-process reference:
tests/executor/test_execute.py, case dp4-hsdp2-zero3."""

import pytest

from planner.cluster.profile import load_cluster
from planner.errors import InputError
from planner.evaluate.config import ParallelConfig
from planner.request import resolve_request
from planner.search.search import search
from planner.search.space import SearchOptions, pinned_options

# 2 nodes of 8 V100 joined by 25 Gbit/s Ethernet: ZeRO-3 over all 16 ranks gathers every
# layer across it, per micro-batch.
CLUSTER = "aws-p3.16xlarge"


def _inputs(memory_gib=None):
    profile = load_cluster(CLUSTER).with_nodes(2)
    if memory_gib is not None:
        device = profile.device.model_copy(update={"memory_bytes": int(memory_gib * 2**30)})
        profile = profile.model_copy(update={"device": device})
    training = {"global_batch_size": 32, "seq_len": 1024, "dtype": "fp16"}
    return resolve_request({"name": "gpt-1.3b"}, profile, training).trace()


@pytest.fixture(scope="module")
def inputs():
    return _inputs()


def _plan(inputs, dp_shard=None):
    options = SearchOptions(
        mesh=(1, 16, 1),
        zero_stages=(3,),
        checkpointing=(False,),
        layouts=("megatron",),
        microbatch_sizes=(2,),
        dp_shard=dp_shard,
        layerwise_zero=False,  # plain ZeRO-3 (layer-wise: tests/executor/test_layerwise_zero.py)
    )
    return search(inputs, options).plan


def test_hsdp_wins_over_a_slow_network_and_loses_where_its_shards_do_not_fit(inputs):
    full, hybrid, searched = _plan(inputs, 0), _plan(inputs, 8), _plan(inputs)
    assert full.mesh.dp_shard is None and hybrid.mesh.dp_shard == 8
    # Gathers on NVLink inside the node, 1/8 of the gradients across it: faster...
    assert hybrid.predicted.step_time_s < 0.5 * full.predicted.step_time_s
    assert searched.mesh.dp_shard == 8
    assert searched.predicted.step_time_s == pytest.approx(hybrid.predicted.step_time_s)
    # ...with each device holding 1/8 of the model state instead of 1/16.
    assert hybrid.stages[0].predicted.memory.optimizer == pytest.approx(
        2 * full.stages[0].predicted.memory.optimizer, rel=1e-3
    )
    between = (full.predicted.peak_memory_bytes + hybrid.predicted.peak_memory_bytes) / 2**31
    tight = _plan(_inputs(memory_gib=between))
    assert tight.mesh.dp_shard is None
    assert tight.predicted.step_time_s == pytest.approx(full.predicted.step_time_s)


def test_hsdp_is_refused_where_it_cannot_run():
    with pytest.raises(InputError, match="dp_shard 3 does not divide dp 8"):
        pinned_options(mesh=(1, 8, 1), zero=3, dp_shard=3)
    with pytest.raises(InputError, match="ZeRO-0 shards nothing"):
        pinned_options(mesh=(1, 8, 1), zero=0, dp_shard=4)
    cluster = load_cluster(CLUSTER).with_nodes(1)
    with pytest.raises(InputError, match=r"mesh\.dp_shard"):
        ParallelConfig(8, 1, 1, 1, zero=0, dp_shard=4).validate(cluster, 8, 4)
