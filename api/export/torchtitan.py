"""A torchtitan job config (TOML, torchtitan 0.2's JobConfig sections: [job], [training],
[parallelism], [activation_checkpoint], [optimizer]). Field meanings, from torchtitan's
job_config.py: `training.local_batch_size` is the batch per data-parallel rank per optimizer
step's forward (with gradient accumulation, global_batch_size / (local x dp) steps of it);
`pipeline_parallel_microbatch_size` splits it for the pipeline schedule; FSDP's
`data_parallel_shard_degree` and DDP's `data_parallel_replicate_degree` make the dp axis."""

from __future__ import annotations

from dataclasses import replace

from api.export.common import ExportError, cp_comm_value, degrees, even_layers
from planner.plan import Plan
from planner.search.space import SearchOptions

TARGET = "torchtitan"
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "interleaved_zero_bubble": "InterleavedZeroBubble",
    "zbv_zero_bubble": "ZBVZeroBubble",  # torchtitan places the stages in a V for these two
    "dualpipe_v": "DualPipeV",
    "looped_bfs": "LoopedBFS",
}
PRECISION = {"bf16": "bfloat16", "fp32": "float32"}


def restrict(options: SearchOptions) -> SearchOptions:
    """What a torchtitan job config says, as the search's options: its schedules (the rest,
    e.g. its model flavors and its dropless expert dispatch, is checked on the plans found)."""
    schedules = tuple(s for s in options.schedules if s in SCHEDULES)
    return replace(options, executable_only=False, schedules=schedules)


RESHARD = {1: "never", 2: "never", 3: "always"}  # ZeRO-1/2 keep params gathered to backward
# torchtitan builds its models from registered flavors, not from the job config: the llama3
# flavors' shapes (torchtitan/models/llama3/__init__.py, torchtitan 0.2: dim, n_layers,
# n_heads, n_kv_heads; the FFN from ffn_dim_multiplier and multiple_of: 1.3 and 1024, 1.3 and
# 4096, 1.2 and 4096). Its vocabulary is its tokenizer's (128,256 for Llama 3's).
LLAMA3_FLAVORS = {
    "8B": (4096, 32, 32, 8, 14336),
    "70B": (8192, 80, 64, 8, 28672),
    "405B": (16384, 126, 128, 8, 53248),
}


# Its Qwen3 MoE flavors (torchtitan/models/qwen3/__init__.py, torchtitan 0.2), as
# transformers' Qwen3MoeConfig fields say them: hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, head_dim, moe_intermediate_size, num_experts,
# num_experts_per_tok, vocab_size, rope_theta; every layer a MoE layer with top-k weights
# renormalized (its route_norm: norm_topk_prob), no shared experts.
QWEN3_MOE_FLAVORS = {
    "30B-A3B": (2048, 48, 32, 4, 128, 768, 128, 8, 151936, 1000000),
    "235B-A22B": (4096, 94, 64, 4, 128, 1536, 128, 8, 151936, 5000000),
}
QWEN3_MOE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "vocab_size",
    "rope_theta",
)


def _qwen3_moe_flavor(settings: dict) -> str | None:
    """The torchtitan Qwen3 MoE flavor of a transformers Qwen3MoeConfig, or None."""
    every_layer = settings.get("decoder_sparse_step", 1) == 1 and not settings.get(
        "mlp_only_layers"
    )
    if not (every_layer and settings.get("norm_topk_prob")):
        return None
    shape = tuple(settings.get(k) for k in QWEN3_MOE_FIELDS)
    return next((f for f, dims in QWEN3_MOE_FLAVORS.items() if dims == shape), None)


def _toml(sections: dict[str, dict]) -> str:
    lines = ["# Written by `autopar export --to torchtitan` (torchtitan 0.2 job config)."]
    for name, values in sections.items():
        lines.append(f"\n[{name}]")
        for key, value in values.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = _string(value)
            elif isinstance(value, list):
                text = "[" + ", ".join(_string(v) for v in value) + "]"
            else:
                text = str(value)
            lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def _string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _fp8(d) -> dict[str, dict]:
    """torchtitan's float8 converter with the plan's recipe, its head left in bf16 as the
    plan's is, and the model compiled (the plan prices fused casts: planner.parallel.fp8)."""
    if d.fp8 is None:
        return {}
    return {
        "model": {"converters": ["quantize.linear.float8"]},
        "quantize.linear.float8": {"recipe_name": d.fp8, "filter_fqns": ["output"]},
        "compile": {"enable": True, "components": ["model"]},
    }


def _checkpointing(d) -> dict:
    """torchtitan's activation_checkpoint section: its op-level policy (selective_ac_option
    "op") is the plan's selective_alternate (every second matmul recomputed); the plan's
    selective policy (every matmul output kept) has no torchtitan setting."""
    if not d.checkpointing:
        return {"mode": "none"}
    if d.checkpoint_policy == "selective_alternate":
        return {"mode": "selective", "selective_ac_option": "op"}
    if d.checkpoint_policy == "selective":
        raise ExportError(
            TARGET,
            "stages[].checkpoint_policy",
            "full or selective_alternate checkpointing (its op-level policy recomputes every "
            "second matmul; the plan's selective keeps them all)",
        )
    return {"mode": "full"}


def _model(plan: Plan) -> dict:
    """torchtitan's [model] section: the llama3 or Qwen3 MoE flavor whose shape is the
    plan's model."""
    model = plan.request.model
    config = model.config
    if config.get("model_type") == "qwen3_moe":
        settings = config.get("settings") or {}
        flavor = _qwen3_moe_flavor(settings)
        if flavor is None:
            dims = ", ".join(f"{k} {settings.get(k)}" for k in QWEN3_MOE_FIELDS)
            raise ExportError(
                TARGET,
                "request.model",
                f"one of its Qwen3 MoE flavors ({', '.join(QWEN3_MOE_FLAVORS)}), every layer "
                f"a MoE layer with norm_topk_prob: this config has {dims} (register a flavor "
                "with these dimensions in torchtitan/models/qwen3 to train it)",
            )
        return {"name": "qwen3", "flavor": flavor}
    ffn = config.get("ffn_hidden") or (config.get("settings") or {}).get("intermediate_size")
    shape = (*(config.get(k) for k in ("hidden", "layers", "heads", "kv_heads")), ffn)
    llama = model.family == "llama" or config.get("model_type") == "llama"
    flavor = next((f for f, dims in LLAMA3_FLAVORS.items() if dims == shape), None)
    if not llama or flavor is None:
        dims = "hidden {}, layers {}, heads {}, kv_heads {}, ffn {}".format(*shape)
        raise ExportError(
            TARGET,
            "request.model",
            f"one of its llama3 flavors ({', '.join(LLAMA3_FLAVORS)}): it builds models from "
            f"registered flavors, and this is a {model.family} model with {dims} (register a "
            "flavor with these dimensions in torchtitan/models/llama3 to train it)",
        )
    return {"name": "llama3", "flavor": flavor}


def _check_expert_parallel(plan: Plan, d) -> None:
    """torchtitan's expert parallelism: dropless dispatch (tokens exchanged by count), the ep
    ranks drawn from FSDP's shard group (ParallelDims: its efsdp = dp_shard x cp x tp / ep)."""
    if plan.request.model.family != "hf":
        raise ExportError(
            TARGET,
            "mesh.ep",
            "no capacity-padded expert dispatch (its MoE is dropless: tokens are exchanged by "
            "count, not in the fixed-size buffers this plan's expert parallelism priced)",
        )
    if d.cp > 1 and d.ep % d.cp:
        raise ExportError(
            TARGET,
            "mesh.ep",
            f"expert parallelism over whole context-parallel groups (its ep mesh is "
            f"dp_shard_in_ep x cp): ep a multiple of cp {d.cp}, not {d.ep}",
        )
    # with expert tp 1 its ep groups take the tp ranks first (its sparse mesh's ep then etp 1
    # innermost), as the plan's do
    shard_ranks = d.dp_shard * (d.tp if d.etp == 1 else 1)
    if d.zero == 0 or shard_ranks % d.ep:
        raise ExportError(
            TARGET,
            "mesh.ep",
            f"expert parallelism within FSDP's shard group: ZeRO 1-3 with the shard group "
            f"(dp_shard {d.dp_shard}{' x tp' if d.etp == 1 else ''}) a multiple of ep {d.ep}",
        )


def export(plan: Plan) -> str:
    d = degrees(plan, TARGET)
    if d.dtype not in PRECISION:
        raise ExportError(TARGET, "request.training.dtype", "bf16 or fp32 mixed precision only")
    if d.optimizer not in ("adamw", "adam"):
        raise ExportError(TARGET, "request.training.optimizer", "Adam and AdamW only")
    # pp > 1: one forward per step with every micro-batch pipelined; else the plan's
    # micro-batches are gradient accumulation steps.
    if d.tp > 1 and not d.sequence_parallel:
        raise ExportError(
            TARGET,
            "sequence_parallel",
            "its tensor parallelism always shards norms on the sequence (SequenceParallel); "
            "plan with sequence parallelism on",
        )
    if d.ep > 1:
        _check_expert_parallel(plan, d)
    if d.cp > 1 and d.zero == 0:
        raise ExportError(
            TARGET,
            "stages[].zero",
            "ZeRO 1-3 with context parallelism (it shards parameters over the cp ranks)",
        )
    if d.zero == 0 and d.dp > 1 and (d.tp > 1 or d.pp > 1):
        raise ExportError(  # torchtitan/models/llama3/infra/parallelize.py: apply_ddp
            TARGET,
            "stages[].zero",
            "ZeRO 1-3 (FSDP) with tensor or pipeline parallelism: its DDP (ZeRO-0) runs only "
            "where data parallelism is the whole mesh",
        )
    # torchtitan's data-parallel degrees exclude cp (FSDP shards over dp_shard x cp); the
    # plan's dp includes its cp ranks.
    replicas = d.dp // d.cp
    local = d.global_batch // replicas if d.pp > 1 else d.microbatch_size
    parallelism: dict = {
        "data_parallel_replicate_degree": d.dp if d.zero == 0 else d.dp // d.dp_shard,
        "data_parallel_shard_degree": 1 if d.zero == 0 else d.dp_shard // d.cp,
        "tensor_parallel_degree": d.tp,
        "pipeline_parallel_degree": d.pp,
    }
    if d.ep > 1 or (d.tp > 1 and plan.request.model.config.get("experts")):
        # experts split over ep ranks of the FSDP group, each expert's features over tp as
        # the plan's layout splits them (planner.intra_op.expert_layout), or whole with the
        # ep groups over the tp ranks too (expert tp 1)
        parallelism["expert_parallel_degree"] = d.ep
        parallelism["expert_tensor_parallel_degree"] = 1 if d.etp == 1 else d.tp
    if d.cp > 1:  # head-tail chunks and all-gathered keys/values, as the plan's executor
        parallelism["context_parallel_degree"] = d.cp
        parallelism["context_parallel_load_balancer"] = "headtail"
        parallelism["context_parallel_rotate_method"] = cp_comm_value(d, TARGET, "torchtitan")
    if d.zero:
        parallelism["fsdp_reshard_after_forward"] = RESHARD[d.zero]
    if d.pp > 1:
        parallelism["pipeline_parallel_schedule"] = SCHEDULES[d.schedule]
        parallelism["pipeline_parallel_microbatch_size"] = d.microbatch_size
        parallelism["pipeline_parallel_layers_per_stage"] = even_layers(plan, TARGET, d)
        # the plan splits the layers evenly; torchtitan's default counts the embedding and
        # the head as one layer each of the first and last stages
        parallelism["pipeline_parallel_first_stage_less_layers"] = 0
        parallelism["pipeline_parallel_last_stage_less_layers"] = 0
    model = _model(plan)
    fp8 = _fp8(d)
    if fp8:
        model["converters"] = fp8.pop("model")["converters"]
    sections = {
        "job": {"description": f"autopar plan for {plan.request.model.name}"},
        "model": model,
        "training": {
            "enable_cpu_offload": d.cpu_offload,
            "local_batch_size": local,
            "global_batch_size": d.global_batch,
            "seq_len": d.seq_len,
            "mixed_precision_param": PRECISION[d.dtype],
            "mixed_precision_reduce": "float32",
            "max_norm": 1.0,
        },
        "optimizer": {"name": "AdamW" if d.optimizer == "adamw" else "Adam"},
        "parallelism": parallelism,
        "activation_checkpoint": _checkpointing(d),
        **fp8,
    }
    return _toml(sections)
