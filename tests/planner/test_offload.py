"""CPU offload (planner/parallel/offload.py): ZeRO-3's shards of weights, gradients and
optimizer state in host memory, the optimizer on the CPU. The search takes it only where
nothing fits on the device; where something fits it is pure cost. Its terms are checked
against figures computed here from the profile's YAML. The executor runs it (FSDP2's
CPUOffloadPolicy) against the single-process reference: tests/executor/test_execute.py,
case dp4-zero3-cpu-offload."""

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from planner.cluster.profile import load_cluster
from planner.errors import InputError
from planner.evaluate.config import ParallelConfig
from planner.evaluate.estimate import evaluate
from planner.graph.tracing import trace_model
from planner.models import ModelSpec, resolve
from planner.parallel import offload
from planner.plan import TrainingSettings
from planner.request import model_ref, resolve_request
from planner.search.search import NoFeasiblePlan, search
from planner.search.space import SearchOptions, pinned_options

ROOT = Path(__file__).resolve().parents[2]
# GPT-1.3B on one p3.16xlarge node of 8 V100 16 GB, fp16 with Adam: 16 B/param of state
MODEL = {"name": "gpt-1.3b"}


def _inputs(memory_gib: float | None = None, gpus: int = 8):
    profile = load_cluster("aws-p3.16xlarge")
    profile = profile.model_copy(update={"devices_per_node": gpus})
    if memory_gib is not None:
        device = profile.device.model_copy(update={"memory_bytes": int(memory_gib * 2**30)})
        profile = profile.model_copy(update={"device": device})
    training = {"global_batch_size": 8, "seq_len": 1024, "dtype": "fp16"}
    return resolve_request(MODEL, profile, training).trace()


def _options(**pins) -> SearchOptions:
    return SearchOptions(mesh=(1, 8, 1), layouts=("megatron",), executable_only=True, **pins)


def test_offload_is_taken_only_where_nothing_fits_on_the_device():
    roomy = search(_inputs(), _options()).plan
    assert not any(st.cpu_offload for st in roomy.stages)
    forced = search(_inputs(), _options(offload=True)).plan
    assert all(st.cpu_offload for st in forced.stages) and forced.executable
    assert forced.predicted.step_time_s > roomy.predicted.step_time_s  # it loses where all fit
    # 1.3B x 16 B / 8 = 2.6 GB of state per device even under ZeRO-3, plus activations:
    # a device too small for that fits only with the state on the host
    tight = _inputs(memory_gib=2.0)
    with pytest.raises(NoFeasiblePlan):
        search(tight, _options(offload=False))
    plan = search(tight, _options()).plan
    assert all(st.cpu_offload and st.zero == 3 for st in plan.stages)
    assert plan.predicted.fits_in_memory
    # ... as long as the host holds the shards (2.6 GB per device here)
    host = tight.cluster.host.model_copy(update={"memory_bytes": 2 * 10**9})
    no_room = tight.cluster.model_copy(update={"host": host})
    with pytest.raises(NoFeasiblePlan):
        search(replace(tight, cluster=no_room), _options())


def _host() -> tuple[float, float, float]:
    """(host link, host memory bandwidth, memory efficiency) from the profile's YAML (YAML 1.1
    reads 16.0e9 as a string)."""
    profile = yaml.safe_load((ROOT / "cluster_profiles" / "aws-p3.16xlarge.yaml").read_text())
    host = profile["host"]
    efficiency = float(profile["efficiency"]["memory"])
    return float(host["link_bandwidth"]), float(host["memory_bandwidth"]), efficiency


def test_offloads_copies_and_host_optimizer_step_are_priced_from_the_host_link():
    resolved = resolve(ModelSpec(**MODEL))
    cluster = load_cluster("aws-p3.16xlarge")
    training = TrainingSettings(global_batch_size=8, seq_len=1024, dtype="fp16")
    graph = trace_model(resolved, 1, 1024, "fp16")
    ref = model_ref(resolved, 1024)
    on_device = evaluate(graph, cluster, training, ParallelConfig(8, 1, 1, 1, zero=3), ref)
    offloaded = ParallelConfig(8, 1, 1, 1, zero=3, offload=True)
    host = evaluate(graph, cluster, training, offloaded, ref)
    link, memory, efficiency = _host()
    local = -(-ref.params // 8)
    # Adam's 28 bytes per parameter read and written in host memory, over the shard
    step = local * 28 / (memory * efficiency)
    assert host.predicted.breakdown["optimizer_s"] == pytest.approx(step, rel=1e-3)
    # fp32 weight shards in for forward and backward, fp32 gradient shards out, beside the
    # micro-batch's compute: the step grows by at least what compute cannot hide, at most
    # by the copies themselves
    copies = local * (4 + 4 + 4) / link
    compute = host.stages[0].predicted.compute_s
    extra = host.predicted.breakdown["pipeline_s"] - on_device.predicted.breakdown["pipeline_s"]
    assert copies - compute - 1e-9 <= extra <= copies + 1e-9
    assert extra > 0.01  # 162M parameters over a 16 GB/s PCIe link: not hidden here
    # the device keeps no state shard: optimizer state gone, weights and grads one layer's
    mem_on, mem_host = on_device.stages[0].predicted.memory, host.stages[0].predicted.memory
    assert mem_host.optimizer == 0 and mem_on.optimizer > 0
    assert mem_host.params < mem_on.params and mem_host.grads < mem_on.grads


def test_offload_is_refused_where_it_cannot_run():
    cluster = load_cluster("aws-p3.16xlarge")
    assert "ZeRO is 2" in offload.refusal(2, 8, cluster)
    assert "dp > 1" in offload.refusal(3, 1, cluster)
    no_host = cluster.model_copy(update={"host": None})
    assert "no host link" in offload.refusal(3, 8, no_host)
    with pytest.raises(InputError, match=r"stages\[\]\.cpu_offload"):
        ParallelConfig(8, 1, 1, 1, zero=1, offload=True).validate(cluster, 8, 4)
    with pytest.raises(InputError, match=r"search\.cpu_offload"):
        pinned_options(zero=2, cpu_offload=True)
