"""What every exporter reads from a plan, with the checks they share."""

from __future__ import annotations

from dataclasses import dataclass

from planner.parallel.registry import exchange_of, exchanges, stores
from planner.plan import Plan


class ExportError(ValueError):
    """A plan field the target framework cannot express."""

    def __init__(self, target: str, field: str, reason: str):
        super().__init__(f"{field}: {target} cannot express this plan: {reason}")
        self.field = field


@dataclass(frozen=True)
class Degrees:
    pp: int
    dp: int
    tp: int
    microbatches: int
    microbatch_size: int
    global_batch: int
    seq_len: int
    layers: int
    zero: int
    checkpointing: bool
    checkpoint_policy: str  # planner.vocab.CheckpointPolicyName (with checkpointing)
    schedule: str
    virtual_stages: int
    dtype: str
    optimizer: str
    sequence_parallel: bool
    dp_shard: int  # ZeRO's shard group (dp without HSDP)
    cp: int = 1  # context parallelism: dp ranks that split each sample's sequence (of dp)
    cp_comm: str | None = None  # its sequence exchange (None: all-gather)
    cpu_offload: bool = False  # ZeRO-3's shards in host memory (FSDP2's CPUOffloadPolicy)
    fp8: str | None = None  # torchao's float8 recipe (planner.parallel.fp8)
    ep: int = 1  # expert parallelism: dp ranks that split each MoE layer's experts (of dp)
    etp: int = 0  # expert tp: 1 with the ep groups over dp x tp, 0 each expert split over tp


def degrees(plan: Plan, target: str) -> Degrees:
    """The plan's choices, refusing what no exporter expresses: a per-node tp layout (the
    frameworks apply Megatron's pattern) and choices that differ between stages."""
    if plan.mesh.stage_meshes is not None:
        raise ExportError(
            target,
            "mesh.stage_meshes",
            "one (dp, tp) mesh for every pipeline stage; this plan's stages each run on their "
            "own submesh (plan with --stage-meshes uniform)",
        )
    pp, dp, tp = plan.mesh.shape
    training = plan.request.training
    if tp > 1 and plan.tp_layout != "megatron":
        raise ExportError(
            target,
            "tp_layout",
            "its tensor parallelism is Megatron's pattern; this plan's is chosen node by node",
        )
    zero = {st.zero for st in plan.stages}
    ckpt = {st.activation_checkpointing for st in plan.stages}
    policy = {st.checkpoint_policy for st in plan.stages if st.activation_checkpointing}
    if len(zero) > 1:
        raise ExportError(target, "stages[].zero", f"one ZeRO level for all stages, not {zero}")
    if any(st.resharded_layers is not None for st in plan.stages):
        raise ExportError(
            target,
            "stages[].resharded_layers",
            "one ZeRO level for all of a stage's layers (the plan has ZeRO-3 on some layers, "
            "ZeRO-2 on the others)",
        )
    if any(st.checkpointed_layers is not None for st in plan.stages):
        raise ExportError(
            target,
            "stages[].checkpointed_layers",
            "all of a stage's layers checkpointed or none (the plan checkpoints some layers, a "
            "number per stage)",
        )
    if (mode := next((m for st in plan.stages if (m := st.activation_store)), None)) is not None:
        raise ExportError(
            target,
            f"stages[].{stores()[mode].stage_field}",
            f"activations kept on the device or recomputed (no {stores()[mode].label} setting "
            "is exported)",
        )
    if len(ckpt) > 1:
        raise ExportError(
            target, "stages[].activation_checkpointing", "checkpointing on all stages or none"
        )
    if len(policy) > 1:
        raise ExportError(target, "stages[].checkpoint_policy", "one policy for all stages")
    m = plan.schedule.microbatches
    layers = max(st.layers[1] for st in plan.stages)
    return Degrees(
        pp=pp,
        dp=dp,
        tp=tp,
        microbatches=m,
        microbatch_size=training.global_batch_size // (dp // (plan.mesh.cp or 1) * m),
        global_batch=training.global_batch_size,
        seq_len=training.seq_len,
        layers=layers,
        zero=zero.pop(),
        checkpointing=ckpt.pop(),
        checkpoint_policy=policy.pop() if len(policy) == 1 else "full",
        schedule=plan.schedule.name,
        virtual_stages=plan.schedule.virtual_stages,
        dtype=training.dtype,
        optimizer=training.optimizer,
        sequence_parallel=plan.sequence_parallel,
        dp_shard=plan.mesh.dp_shard or dp,
        cp=plan.mesh.cp or 1,
        cp_comm=plan.mesh.cp_comm,
        cpu_offload=any(st.cpu_offload for st in plan.stages),
        fp8=plan.fp8,
        ep=plan.mesh.ep or 1,
        etp=plan.mesh.etp or 0,
    )


def even_layers(plan: Plan, target: str, d: Degrees) -> int:
    """Layers per pipeline chunk when the plan splits them evenly (what the frameworks'
    uniform splits give); uneven splits are refused."""
    chunks = d.pp * d.virtual_stages
    sizes = {st.layers[1] - st.layers[0] for st in plan.stages}
    if d.layers % chunks or len(sizes) > 1:
        raise ExportError(
            target,
            "stages[].layers",
            f"layers split evenly over {chunks} chunks; the plan's "
            f"chunks hold {sorted(sizes)} layers",
        )
    return d.layers // chunks


def cp_comm_value(d: Degrees, target: str, framework: str) -> str:
    """The framework's name for the plan's sequence exchange (its SequenceExchange's), or
    an ExportError where it has none."""
    exchange = exchange_of(d.cp_comm)
    value = getattr(exchange, framework)
    if value is None:
        ours = [e.name for e in exchanges().values() if getattr(e, framework) is not None]
        raise ExportError(
            target, "mesh.cp_comm", f"context parallelism by {', '.join(ours)}, not {exchange.name}"
        )
    return value
