"""Megatron-LM command-line arguments (pretrain_gpt.py's flags, one per line). Megatron runs
1F1B, interleaved 1F1B (`--num-layers-per-virtual-pipeline-stage`) and shards only optimizer
state (`--use-distributed-optimizer`, ZeRO-1); ZeRO-3 is its FSDP2 path (`--use-torch-fsdp2`);
sequence parallelism is `--sequence-parallel`; expert parallelism is
`--expert-model-parallel-size` with capacity-padded all-to-all dispatch."""

from __future__ import annotations

from dataclasses import replace

from api.export.common import ExportError, cp_comm_value, degrees, even_layers
from planner.parallel.expert import expert_count
from planner.plan import Plan
from planner.search.space import SearchOptions

TARGET = "megatron"


def restrict(options: SearchOptions) -> SearchOptions:
    """What Megatron-LM's arguments say, as the search's options: its two pipeline schedules,
    no HSDP or CPU offload, full recomputation or none (the rest of its refusals, export()
    below, are checked on the plans found: a pinned rowwise fp8 among them)."""
    schedules = tuple(s for s in options.schedules if s in ("1f1b", "interleaved_1f1b"))
    return replace(
        options,
        executable_only=False,
        schedules=schedules or ("1f1b",),
        dp_shard=0,
        offload=False,
        checkpointing=tuple(c for c in options.checkpointing if c in (False, True)),
    )


def export(plan: Plan) -> str:
    d = degrees(plan, TARGET)
    if d.pp > 1 and d.schedule not in ("1f1b", "interleaved_1f1b"):
        raise ExportError(TARGET, "schedule.name", "Megatron-LM runs 1f1b and interleaved_1f1b")
    if d.zero == 2:
        raise ExportError(
            TARGET,
            "stages[].zero",
            "ZeRO-1 (--use-distributed-optimizer) or ZeRO-3 "
            "(--use-torch-fsdp2); its gradient buffers are not sharded on their own",
        )
    if d.optimizer not in ("adamw", "adam", "sgd"):
        raise ExportError(TARGET, "request.training.optimizer", "adam(w) or sgd")
    args = [
        f"--tensor-model-parallel-size {d.tp}",
        f"--pipeline-model-parallel-size {d.pp}",
        f"--micro-batch-size {d.microbatch_size}",
        f"--global-batch-size {d.global_batch}",
        f"--seq-length {d.seq_len}",
        f"--num-layers {d.layers}",
        "--optimizer " + ("sgd" if d.optimizer == "sgd" else "adam"),
        "--clip-grad 1.0",
    ]
    if d.virtual_stages > 1:
        args.append(f"--num-layers-per-virtual-pipeline-stage {even_layers(plan, TARGET, d)}")
    elif d.pp > 1:
        even_layers(plan, TARGET, d)
    if d.dtype == "bf16":
        args.append("--bf16")
    elif d.dtype == "fp16":
        args.append("--fp16")
    if d.dp_shard < d.dp:
        raise ExportError(TARGET, "mesh.dp_shard", "ZeRO over all data-parallel ranks")
    if d.cpu_offload:
        raise ExportError(
            TARGET,
            "stages[].cpu_offload",
            "no parameter offload (its --optimizer-cpu-offload keeps weights on the GPU)",
        )
    if d.cp > 1:  # its dp excludes the cp ranks, as the plan's micro-batch size does
        comm = cp_comm_value(d, TARGET, "megatron")
        args += [f"--context-parallel-size {d.cp}", f"--cp-comm-type {comm}"]
    if d.ep > 1:
        args += _expert_parallel(plan, d)
    if d.zero == 1:
        args.append("--use-distributed-optimizer")
    elif d.zero == 3:
        args.append("--use-torch-fsdp2")
    if d.sequence_parallel:
        # the megatron runtime prices the layers' TP collectives overlapped with their GEMMs
        # (planner/runtime/megatron.py); Transformer Engine's userbuffers run them so
        args += ["--sequence-parallel", "--tp-comm-overlap"]
    if d.fp8 == "rowwise":
        raise ExportError(TARGET, "fp8", "tensorwise fp8 scaling (no rowwise --fp8-recipe)")
    if d.fp8:  # Transformer Engine: e4m3 forward, e5m2 gradients, as torchao's recipes
        args += ["--fp8-format hybrid", "--fp8-recipe tensorwise"]
    if d.checkpointing and d.checkpoint_policy != "full":
        raise ExportError(
            TARGET,
            "stages[].checkpoint_policy",
            "full recompute; its --recompute-granularity selective recomputes the core "
            "attention only, not the plan's policy (keep matmul outputs)",
        )
    if d.checkpointing:
        args += [
            "--recompute-granularity full",
            "--recompute-method uniform",
            "--recompute-num-layers 1",
        ]
    return "\n".join(args) + "\n"


def _expert_parallel(plan: Plan, d) -> list[str]:
    """Megatron-Core's MoE with the plan's expert parallelism and dispatch: experts split over
    ep data-parallel ranks, tokens exchanged by all-to-all, each expert's input padded to its
    capacity (the fixed-size buffers the plan priced: planner.parallel.expert)."""
    if d.zero == 3:
        raise ExportError(
            TARGET,
            "stages[].zero",
            "expert parallelism with DDP (ZeRO-0): how its --use-torch-fsdp2 path shards "
            "expert weights over the expert data-parallel group is not what autopar prices",
        )
    config = plan.request.model.config or {}
    experts, top_k = expert_count(config), config.get("top_k", 2)
    capacity = config.get("capacity_factor", 1.0)
    return [
        f"--num-experts {experts}",
        f"--moe-router-topk {top_k}",
        f"--expert-model-parallel-size {d.ep}",
        "--moe-token-dispatcher-type alltoall",
        f"--moe-expert-capacity-factor {capacity}",
        "--moe-pad-expert-input-to-capacity",
    ]
