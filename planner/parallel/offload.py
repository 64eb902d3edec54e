"""CPU offload of the sharded model state (ZeRO-Offload, Ren et al., USENIX ATC 2021; FSDP2's
CPUOffloadPolicy): under ZeRO-3 each device's shards of the fp32 weights, the gradients and
the optimizer state live in host memory, and the optimizer steps on the host's CPUs.

Memory on the device: only the layer being computed, its gathered weights and its gradients
before they are reduced (planner.cost.memory.model_state_bytes).
Time: every gather first copies the weight shard to the device (forward and backward, each
micro-batch) and every reduce-scatter copies the gradient shard back (FSDP2 accumulates them on
the host), over the device's own host link (the profile's host.link_bandwidth, one way);
these copies run beside compute as ZeRO-3's gathers do (planner.parallel.data.exposed). The
optimizer step reads and writes its state in host memory (data.OPTIMIZER_STEP_BYTES per
parameter at host.memory_bandwidth x efficiency.memory: memory-bound, as the device's step is
priced; torch's CPU AdamW may run below it).
Host memory: a configuration fits only where each device's shards fit in its share of the
host's memory (host.memory_bytes: the node's DRAM / devices per node).
Search: tried, at ZeRO-3, only where no configuration of the (mesh, micro-batch, schedule)
fits without it: it only adds time. Plan field: stages[].cpu_offload.
"""

from __future__ import annotations

from planner.cluster.profile import ClusterProfile
from planner.cost.memory import ParamBytes
from planner.parallel.choice import Choice
from planner.parallel.data import OPTIMIZER_STEP_BYTES
from planner.parallel.technique import MODULES_ONLY, Capability, Pin, Technique

_EXEC = "executor.data_parallel:apply_data_parallel"
_TEST = "tests/executor/test_execute.py::test_plan_matches_single_process_reference"
CHOICES = (
    Choice("stages[].cpu_offload", False, _EXEC, f"{_TEST}[pp2xdp2-gpipe-zero3]"),
    Choice("stages[].cpu_offload", True, _EXEC, f"{_TEST}[dp4-zero3-cpu-offload]"),
)


def refusal(zero: int, dp: int, cluster: ClusterProfile) -> str | None:
    """Why CPU offload cannot run at this ZeRO level and dp on this cluster, or None."""
    if zero != 3:
        return f"CPU offload moves ZeRO-3's shards to the host; ZeRO is {zero}"
    if dp < 2:
        return "CPU offload runs through FSDP2, which the executor applies where dp > 1"
    if cluster.host is None:
        return f"the cluster profile {cluster.name} gives no host link (host.link_bandwidth)"
    return None


def transfer_time(cluster: ClusterProfile, params: int, shards: int, per: ParamBytes) -> float:
    """One micro-batch's host-device copies of a device's `params` (sharded over `shards`):
    the weight shards in for forward and backward, the gradient shards out."""
    assert cluster.host is not None
    local = -(-params // shards)
    return local * (2 * per.weights + per.grads) / cluster.host.link_bandwidth


def host_bytes(params: int, shards: int, per: ParamBytes) -> int:
    """The host memory a device's shards take: its weights, gradients and optimizer state."""
    return -(-params // shards) * (per.weights + per.grads + per.optimizer)


def optimizer_step_time(cluster: ClusterProfile, params: int, shards: int, optimizer: str):
    """The optimizer step on the host, over this device's shard."""
    assert cluster.host is not None
    rate = cluster.host.memory_bandwidth * cluster.efficiency.memory
    return -(-params // shards) * OPTIMIZER_STEP_BYTES[optimizer] / rate


PINS: tuple[Pin, ...] = (
    Pin(
        "cpu_offload",
        "switch",
        "ZeRO-3's shards of weights, gradients and optimizer state in host memory, the "
        "optimizer on the CPU (default: only where nothing fits without it)",
    ),
)


TECHNIQUE = Technique(
    "offload",
    order=70,
    pins=PINS,
    choices=CHOICES,
    terms=(
        "planner.parallel.offload:transfer_time",
        "planner.parallel.offload:host_bytes",
        "planner.parallel.offload:optimizer_step_time",
    ),
    capabilities=(
        Capability(
            "cpu_offload",
            MODULES_ONLY,
            "CPU offload runs through FSDP2 on the executor's module path; this plan runs in "
            "graph mode",
        ),
    ),
)
