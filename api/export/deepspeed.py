"""A DeepSpeed config JSON (keys as in DeepSpeed's configuration docs:
train_batch_size = micro-batch x gradient accumulation x dp). DeepSpeed's pipeline
parallelism is built in code (PipelineModule), not in the config, so pp > 1 is refused;
tensor parallelism is AutoTP training (`tensor_parallel.autotp_size`)."""

from __future__ import annotations

import json
from dataclasses import replace

from api.export.common import ExportError, degrees
from planner.plan import Plan
from planner.search.space import SearchOptions

TARGET = "deepspeed"


def restrict(options: SearchOptions) -> SearchOptions:
    """What a DeepSpeed config says, as the search's options: one pipeline stage (its
    schedule named 1f1b), no HSDP, context or expert parallelism, sequence parallelism or
    fp8, full recomputation or none (the rest is checked on the plans found)."""
    return replace(
        options,
        executable_only=False,
        schedules=("1f1b",),
        dp_shard=0,
        cp=1,
        ep=1,
        fp8=(None,),
        layouts=tuple(k for k in options.layouts if k == "megatron") or ("megatron",),
        checkpointing=tuple(c for c in options.checkpointing if c in (False, True)),
        max_pp=1,
    )


OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam"}


def export(plan: Plan) -> str:
    d = degrees(plan, TARGET)
    if d.pp > 1:
        raise ExportError(
            TARGET, "mesh.pp", "pipeline stages are a PipelineModule in the training code"
        )
    if d.optimizer not in OPTIMIZERS:
        raise ExportError(TARGET, "request.training.optimizer", "Adam or AdamW")
    config: dict = {
        "train_batch_size": d.global_batch,
        "train_micro_batch_size_per_gpu": d.microbatch_size,
        "gradient_accumulation_steps": d.microbatches,
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": OPTIMIZERS[d.optimizer],
            "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
        },
        "zero_optimization": {"stage": d.zero},
        "bf16": {"enabled": d.dtype == "bf16"},
        "fp16": {"enabled": d.dtype == "fp16"},
    }
    if d.checkpointing and d.checkpoint_policy != "full":
        raise ExportError(TARGET, "stages[].checkpoint_policy", "full activation checkpointing")
    if d.dp_shard < d.dp:
        raise ExportError(TARGET, "mesh.dp_shard", "ZeRO over all data-parallel ranks")
    if d.cp > 1:
        raise ExportError(
            TARGET,
            "mesh.cp",
            "no context parallelism (its Ulysses sequence parallelism splits heads, not chunks)",
        )
    if d.ep > 1:
        raise ExportError(
            TARGET,
            "mesh.ep",
            "no expert parallelism in its config (DeepSpeed-MoE takes ep_size in the model "
            "code, deepspeed.moe.layer.MoE)",
        )
    if d.fp8:
        raise ExportError(TARGET, "fp8", "bf16 or fp16 matmuls (no fp8 training setting)")
    if d.sequence_parallel:
        raise ExportError(
            TARGET, "sequence_parallel", "AutoTP does not shard norms on the sequence"
        )
    if d.tp > 1:
        config["tensor_parallel"] = {"autotp_size": d.tp}
    if d.cpu_offload:  # ZeRO-Infinity's CPU targets: parameters and optimizer state
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if d.checkpointing:
        config["activation_checkpointing"] = {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
        }
    return json.dumps(config, indent=2) + "\n"
