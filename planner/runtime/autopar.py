"""autopar's own executor (executor/): DDP or FSDP2 (fully_shard with MixedPrecisionPolicy,
as torchtitan applies it), torch's pipeline schedules, torchao fp8.

Layout: the ZeRO paper's bytes (declaration.zero_paper). Without FSDP2 (ZeRO-0, or dp 1)
the weights stay fp32 and autocast casts them, each cast copy saved for backward: 2 bytes
more per parameter, seen on an H100 (bench/results/h100_execute.md: a 1.9B-parameter plan
peaked 3.6 GiB over a prediction without them)."""

from __future__ import annotations

from planner.runtime.declaration import Runtime, zero_paper

RUNTIME = Runtime(
    "autopar",
    summary="autopar's executor: DDP or FSDP2, torch's schedules, torchao fp8",
    sources=(
        "Rajbhandari et al., ZeRO, SC'20, section 3.1 (2 + 2 + 12 bytes per parameter)",
        "bench/results/h100_execute.md (autocast's cast copies, measured on an H100)",
    ),
    zero_levels=(0, 1, 2, 3),
    zero_names="ZeRO 0-3",
    state_bytes=zero_paper,
    autocast_copies=True,
    tp_layouts=("megatron", "per_node"),
)
