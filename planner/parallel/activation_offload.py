"""Activation offload: instead of recomputing a layer's forward in backward,
each layer's saved activations are copied to host memory as its forward saves them and back
as its backward needs them (torch.autograd.graph.saved_tensors_hooks, as torch's own
save_on_cpu; parameters stay where they are). A choice beside checkpointing: it trades the
host link's time for recomputation's.

Memory on the device: what lies outside the layers (embeddings, the head's logits) stays,
for every in-flight micro-batch; of the layers, what one op's backward holds at the peak
(transit_bytes, once the head's backward is done: checkpointing.rebuild_peak): each saved
tensor comes back as backward unpacks it, one op at a time (measured on gloo: the peak is an
elementwise op's backward on the largest tensor, its input brought back beside the gradient
arriving and the one it makes).
Time: every saved byte crosses the device's host link twice per micro-batch (out in forward,
back in backward) at the profile's host.link_bandwidth. The copies run on the compute stream
(save_on_cpu's copy_ is issued where the tensor is saved), so they are not hidden: forward
and backward each take their half.
Host memory: the saved activations of every in-flight micro-batch, in the device's share of
the host's DRAM (host.memory_bytes).
Search: a checkpointing mode ("offload"), tried with partial checkpointing where neither
selective policy fits, on profiles with a host link, on the executor's module path. Plan
field: stages[].activation_offload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from planner.parallel.choice import Choice
from planner.parallel.technique import (
    MODULES_ONLY,
    ActivationStore,
    Capability,
    PinValues,
    Technique,
)

if TYPE_CHECKING:
    from planner.cluster.profile import ClusterProfile

MODE = "offload"  # the checkpointing pin's value
STAGE_FIELD = "activation_offload"
_EXEC = "executor.activation_offload:apply_activation_offload"
_TEST = "tests/executor/test_activation_offload.py::test_offloaded_plan_matches_the_reference"
_KEPT = "tests/executor/test_execute.py::test_plan_matches_single_process_reference"
CHOICES = (
    Choice(
        f"stages[].{STAGE_FIELD}",
        False,
        "executor.parallelize:parallelize",
        f"{_KEPT}[pp2xtp2-1f1b]",
    ),
    Choice(f"stages[].{STAGE_FIELD}", True, _EXEC, f"{_TEST}[pp2xdp2-activation-offload]"),
)


def refusal(cluster: ClusterProfile) -> str | None:
    if cluster.host is None:
        return f"the cluster profile {cluster.name} gives no host link (host.link_bandwidth)"
    return None


def transfer_time(cluster: ClusterProfile, layer_bytes: float) -> float:
    """One micro-batch's copies of a device's layer activations: out and back."""
    assert cluster.host is not None
    return 2 * layer_bytes / cluster.host.link_bandwidth


def transit_bytes(layer_input: int, largest_output: int) -> int:
    """A layer's backward under activation offload on the device: the gradient of its input
    held across it, and for its largest op the saved input brought back, the gradient
    arriving and the one it makes (three of the largest output's size)."""
    return layer_input + 3 * largest_output


def host_bytes(layer_bytes_per_microbatch: float, inflight: float) -> int:
    return int(layer_bytes_per_microbatch * inflight)


TECHNIQUE = Technique(
    "activation_offload",
    order=55,
    pins=(),
    extends=(
        PinValues(
            "checkpointing",
            (MODE,),
            "offload (no recompute: every layer's activations to host memory and back)",
        ),
    ),
    stage_fields={
        STAGE_FIELD: (
            bool,
            Field(
                False,
                description="each layer's saved activations copied to host memory in forward "
                "and back in backward, instead of recomputing them (not with "
                "activation_checkpointing); written only where true",
                exclude_if=lambda on: not on,
            ),
        )
    },
    store=ActivationStore(
        MODE,
        label="activation offload",
        stage_field=STAGE_FIELD,
        capability="activation_offload",
        refusal=refusal,
        transfer_time=transfer_time,
        transit_bytes=transit_bytes,
        host_bytes=host_bytes,
        apply=_EXEC,
    ),
    choices=CHOICES,
    terms=(
        "planner.parallel.activation_offload:transfer_time",
        "planner.parallel.activation_offload:transit_bytes",
        "planner.parallel.activation_offload:host_bytes",
    ),
    capabilities=(
        Capability(
            "activation_offload",
            MODULES_ONLY,
            "plan.stages[].activation_offload: graph mode does not offload activations; plan "
            "on the module path (tp_layout megatron)",
        ),
    ),
)
