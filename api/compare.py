"""The baseline families (Megatron grid, FSDP2 + TP grid, DP, FSDP) evaluated beside a plan,
as table rows."""

from __future__ import annotations

from typing import Any

from planner.parallel.registry import stores


def baseline_entries(results) -> list[dict[str, Any]]:
    """The rows of the best of each baseline family (planner.search.baselines.BaselineResult)
    that the CLI's table, the service and the plan viewer show."""
    rows = []
    for result in results:
        kind, plan = result.kind, result.plan
        if plan is None:
            rows.append({"kind": kind, "fits": False})
            continue
        rows.append(
            {
                "kind": kind,
                "fits": True,
                "step_time_s": plan.predicted.step_time_s,
                "tflops_per_device": plan.predicted.tflops_per_device,
                "peak_memory_bytes": plan.predicted.peak_memory_bytes,
                "mesh": plan.mesh.shape,
                "summary": describe(plan),
            }
        )
    return rows


def describe(plan) -> str:
    st = plan.stages[0]
    ckpt = ""
    if any(s.checkpointed_layers is not None for s in plan.stages):
        ckpt = ", checkpointing of some layers"
    elif st.activation_checkpointing:
        names = {"selective": "selective", "selective_alternate": "alternating selective"}
        name = names.get(st.checkpoint_policy)
        ckpt = f", {name} checkpointing" if name else ", checkpointing"
    elif (mode := st.activation_store) is not None:
        ckpt = f", {stores()[mode].label}"
    sp = ", sequence parallel" if plan.sequence_parallel else ""
    sp += f", fp8 {plan.fp8}" if plan.fp8 else ""
    shard = plan.mesh.dims.dp_shard
    hsdp = f", HSDP over {shard}" if shard else ""
    hsdp += ", CPU offload" if any(s.cpu_offload for s in plan.stages) else ""
    zero = st.zero_label
    if len({s.zero for s in plan.stages}) > 1:
        zero = "ZeRO " + "/".join(str(s.zero) for s in plan.stages) + " by stage"
    return (
        f"{plan.mesh.summary()}, {plan.schedule.name}, {plan.schedule.microbatches} "
        f"micro-batches, {zero}{hsdp}{ckpt}{sp}"
    )
