"""Megatron-LM command-line arguments (pretrain_gpt.py's flags, one per line). Megatron runs
1F1B, interleaved 1F1B (`--num-layers-per-virtual-pipeline-stage`) and shards only optimizer
state (`--use-distributed-optimizer`, ZeRO-1); ZeRO-3 is its FSDP2 path (`--use-torch-fsdp2`);
sequence parallelism is `--sequence-parallel`; expert parallelism is
`--expert-model-parallel-size` with all-to-all dispatch (capacity-padded for the zoo's
GShard MoE, dropless for transformers' Mixtral)."""

from __future__ import annotations

from dataclasses import replace

from api.export.common import ExportError, cp_comm_value, degrees, even_layers
from planner.plan import Plan
from planner.search.space import SearchOptions

TARGET = "megatron"
# the zoo's families and transformers' model types its GPT model's flags build
ARCHITECTURES = ("gpt", "moe", "llama", "mistral", "qwen2", "mixtral")


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
        *architecture(plan),
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
    if d.tp > 1 and plan.request.model.family == "moe":
        raise ExportError(
            TARGET,
            "mesh.tp",
            "its MoE layers split each expert's features over tp (expert tp = tp) or route "
            "each tp rank's sequence shard (expert tp 1); this plan runs the zoo's GShard "
            "experts whole on every tp rank, on every token: plan with tp 1 for this model",
        )
    if d.tp > 1 and plan.request.model.family == "hf" and plan.request.model.config.get("experts"):
        # each expert's features over tp, as the plan's layout splits them (Megatron-Core's
        # default, stated: planner.intra_op.expert_layout), or whole with the ep groups over
        # the tp ranks too (expert tp 1: its MoE parallel folding, the expert rank order
        # tp-ep-dp-pp with expert tp 1 putting the tp ranks in the ep groups first)
        args.append(f"--expert-tensor-parallel-size {1 if d.etp == 1 else d.tp}")
    if d.zero == 1:
        args.append("--use-distributed-optimizer")
    elif d.zero == 3:
        args += _torch_fsdp2(plan, d)
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


def environment(plan: Plan) -> dict[str, str]:
    """The environment Megatron-LM's validate_args asks of this run: with tensor or context
    parallelism on GPUs before Blackwell, CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue,
    so that its communication kernels are scheduled before the GEMMs they overlap), except
    under torch FSDP2, which wants more than one."""
    d = degrees(plan, TARGET)
    if (d.tp > 1 or d.cp > 1) and d.zero != 3:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def architecture(plan: Plan) -> list[str]:
    """The model as Megatron-Core's GPT model flags (its arguments.py's network-size and
    tokenizer groups): Llama-family models (the zoo's, transformers' llama, mistral and
    qwen2: RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases but
    Qwen2's q/k/v; mixtral: the same with every MLP a top-k MoE of SwiGLU experts, as
    Megatron-LM's Mixtral recipe writes it), the zoo's GPT (LayerNorm, GELU, learned
    positions, tied embeddings) and its GShard MoE (the GPT with top-k experts on every other
    layer, from the first).
    The tokenizer is Megatron's NullTokenizer over the model's vocabulary (the data's
    tokenizer is the user's to name)."""
    model, config = plan.request.model, plan.request.model.config or {}
    settings = config.get("settings") or {}
    kind = model.family if model.family != "hf" else config.get("model_type")
    seq = plan.request.training.seq_len
    hidden, heads, layers = config.get("hidden"), config.get("heads"), config.get("layers")
    vocab = config.get("vocab")
    if kind not in ARCHITECTURES or None in (hidden, heads, vocab):
        raise ExportError(
            TARGET,
            "request.model",
            "GPT and Llama-family architectures as its GPT model's flags (the zoo's gpt, moe "
            f"and llama; transformers' llama, mistral, qwen2 and mixtral); this is a {kind} model",
        )
    args = [
        f"--hidden-size {hidden}",
        f"--num-attention-heads {heads}",
        f"--max-position-embeddings {max(seq, config.get('seq_len') or seq)}",
        "--tokenizer-type NullTokenizer",
        f"--vocab-size {vocab}",
    ]
    if kind in ("gpt", "moe"):
        ffn = config.get("ffn_hidden") or (8 if kind == "moe" else 4) * hidden
        args += [f"--ffn-hidden-size {ffn}", "--position-embedding-type learned_absolute"]
        if not config.get("tie_embeddings", True):
            args.append("--untie-embeddings-and-output-weights")
        if kind == "moe":
            period = f"([1]*1+[0]*1)*{-(-layers // 2)}"  # MoE on even layers
            args += [f"--moe-layer-freq {period}", f"--moe-ffn-hidden-size {ffn}"]
            args += [f"--num-experts {config['experts']}", f"--moe-router-topk {config['top_k']}"]
        return args
    kv = config.get("kv_heads") or heads
    ffn = config.get("ffn_hidden") or settings.get("intermediate_size")
    theta = config.get("rope_theta") or settings.get("rope_theta") or 10000.0
    eps = config.get("norm_eps") or settings.get("rms_norm_eps") or 1e-5
    tied = config.get("tie_embeddings", settings.get("tie_word_embeddings", False))
    args += [
        f"--ffn-hidden-size {ffn}",
        "--swiglu",
        "--normalization RMSNorm",
        f"--norm-epsilon {eps}",
        "--position-embedding-type rope",
        f"--rotary-base {int(theta) if float(theta).is_integer() else theta}",
        "--disable-bias-linear",
    ]
    if kind == "qwen2":  # biases on q, k and v only
        args.append("--add-qkv-bias")
    if kv != heads:
        args += ["--group-query-attention", f"--num-query-groups {kv}"]
    if not tied:
        args.append("--untie-embeddings-and-output-weights")
    if kind == "mixtral":  # every layer's MLP: top-k of E SwiGLU experts, router without bias
        args += [
            f"--num-experts {settings['num_local_experts']}",
            f"--moe-router-topk {settings['num_experts_per_tok']}",
            f"--moe-ffn-hidden-size {ffn}",
            "--moe-grouped-gemm",
        ]
    return args


def _torch_fsdp2(plan: Plan, d) -> list[str]:
    """ZeRO-3 as Megatron-LM's torch FSDP2 path, within what its validate_args allows
    (megatron/training/arguments.py: no pipeline or expert parallelism, no fp16, untied
    embeddings, and no gradient-accumulation fusion, which is on by default)."""
    if d.pp > 1:
        raise ExportError(TARGET, "mesh.pp", "no pipeline stages with --use-torch-fsdp2")
    if d.ep > 1:
        raise ExportError(TARGET, "mesh.ep", "no expert parallelism with --use-torch-fsdp2")
    if d.dtype == "fp16":
        raise ExportError(TARGET, "request.training.dtype", "bf16 or fp32 with --use-torch-fsdp2")
    if "--untie-embeddings-and-output-weights" not in architecture(plan):
        raise ExportError(
            TARGET, "request.model", "untied embeddings and output weights with --use-torch-fsdp2"
        )
    return ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]


def _expert_parallel(plan: Plan, d) -> list[str]:
    """Megatron-Core's MoE with the plan's expert parallelism and dispatch: experts split over
    ep data-parallel ranks, tokens exchanged by all-to-all; for the zoo's GShard MoE each
    expert's input padded to its capacity (the fixed-size buffers the plan priced:
    planner.parallel.expert), for transformers' MoE models dropless (each token's rows sent
    by count, as the plan priced them: Megatron's default without a capacity factor)."""
    if d.zero == 3:
        raise ExportError(
            TARGET,
            "stages[].zero",
            "expert parallelism with DDP (ZeRO-0): how its --use-torch-fsdp2 path shards "
            "expert weights over the expert data-parallel group is not what autopar prices",
        )
    args = [f"--expert-model-parallel-size {d.ep}", "--moe-token-dispatcher-type alltoall"]
    if plan.request.model.family == "hf":
        return args
    capacity = (plan.request.model.config or {}).get("capacity_factor", 1.0)
    return [*args, f"--moe-expert-capacity-factor {capacity}", "--moe-pad-expert-input-to-capacity"]
