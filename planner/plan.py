"""The Plan: the JSON contract between planner, service, viewer and executor.

Field names follow ../shared/DESIGN.md ("The plan"); add fields freely, rename none without
bumping SCHEMA_VERSION. Placements are one string per mesh axis: "R" (replicate), "S(d)"
(shard tensor dim d), "P" (partial sum). No torch import here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from planner import __version__
from planner.errors import input_error_from
from planner.limits import (
    CLUSTER_NAME,
    MAX_EXPERT_IMBALANCE,
    MAX_GLOBAL_BATCH,
    MAX_SEQ,
    MODEL_NAME,
)
from planner.parallel.registry import exchanges, stage_fields, stores
from planner.parallel_dims import ParallelDims
from planner.placements import PATTERN as PLACEMENT_PATTERN
from planner.placements import shard_dim
from planner.vocab import (
    ZERO_LEVELS,
    AttentionKernel,
    CheckpointPolicyName,
    DTypeName,
    Fp8Recipe,
    OptimizerName,
    RuntimeName,
    ScheduleName,
    TpLayoutName,
)

SCHEMA_VERSION = "1"

Placement = Annotated[str, Field(pattern=PLACEMENT_PATTERN)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


EXPERT_IMBALANCE_HELP = (
    "expert parallelism with dropless routing: the busiest rank's routed rows over its group's "
    "mean (1: balanced, as an auxiliary load-balancing loss aims; DeepSeek-V3's MaxVio + 1; "
    "measure yours from the router's per-expert counts). That rank's expert GEMMs and token "
    "exchanges take this much longer; capacity dispatch pads instead"
)


class TrainingSettings(_Frozen):
    global_batch_size: int = Field(gt=0, le=MAX_GLOBAL_BATCH, examples=[64])
    seq_len: int = Field(gt=0, le=MAX_SEQ, examples=[1024])
    dtype: DTypeName = "bf16"
    optimizer: OptimizerName = "adamw"
    attention: AttentionKernel = Field(
        "flash",
        description="attention kernel: flash/memory-efficient (O(s) memory) or math "
        "(materialises the s x s scores, as pre-FlashAttention Megatron and V100 runs did)",
    )
    runtime: RuntimeName = Field(
        "autopar",
        description="what executes the plan, whose memory layout it is predicted for "
        "(planner.runtime): autopar's executor, or torchtitan, megatron or deepspeed for a "
        "plan exported there; written where not autopar",
        exclude_if=lambda name: name == "autopar",
    )
    expert_imbalance: float = Field(
        1.0,
        ge=1.0,
        le=MAX_EXPERT_IMBALANCE,
        description=EXPERT_IMBALANCE_HELP,
        exclude_if=lambda factor: factor == 1.0,
    )


class ModelRef(_Frozen):
    name: str = Field(pattern=MODEL_NAME.pattern)
    family: str
    config: dict[str, Any]
    params: int = Field(ge=0)
    content_hash: str


class ClusterRef(_Frozen):
    name: str = Field(pattern=CLUSTER_NAME.pattern)
    content_hash: str
    nodes: int = Field(gt=0)
    devices_per_node: int = Field(gt=0)
    device: str
    device_memory_bytes: int | None = Field(None, gt=0, description="capacity per device")
    memory_headroom_bytes: int = Field(
        0, ge=0, description="of that, kept free per device (the request's memory headroom)"
    )


class PlanRequest(_Frozen):
    model: ModelRef
    cluster: ClusterRef
    training: TrainingSettings


class MeshSpec(_Frozen):
    shape: list[int] = Field(
        description="the rank grid [pp, dp x cp, tp]: context-parallel groups are neighbouring "
        "ranks of its middle axis (planner.parallel_dims; `dims` names the degrees)"
    )
    axis_names: list[str] = ["pp", "dp", "tp"]
    ranks: list[list[list[int]]] = Field(description="ranks[pp][dp][tp]")
    dp_shard: int | None = Field(
        None,
        gt=0,
        description="HSDP: ZeRO shards over groups of this many neighbouring dp ranks and "
        "replicates across dp / dp_shard groups (torchtitan's data_parallel_shard_degree); "
        "null: over all of dp",
    )
    cp: int | None = Field(
        None,
        gt=0,
        description="context parallelism: groups of this many neighbouring dp ranks split each "
        "sample's sequence (2 x cp load-balanced chunks; cp_comm says how attention's inputs "
        "are exchanged); the batch is split over dp / cp replicas; null: 1",
    )
    cp_comm: str | None = Field(
        None,
        description="how a cp group exchanges what attention needs of the others' tokens "
        "(planner.parallel.registry.exchanges: e.g. ulysses, all-to-all from sequence to "
        "heads); null: all_gather",
        exclude_if=lambda v: v is None,
    )
    ep: int | None = Field(
        None,
        gt=0,
        description="expert parallelism: groups of this many neighbouring dp ranks split each "
        "MoE layer's experts and exchange tokens with all-to-alls (Megatron-LM's "
        "expert_model_parallel_size; within dp, not a factor of the world); null: 1",
        exclude_if=lambda v: v is None,
    )
    etp: int | None = Field(
        None,
        description="expert tensor parallelism beside ep (Megatron-LM's "
        "expert_tensor_parallel_size, torchtitan's etp): null: tp where the tp layout splits "
        "each expert's features (transformers' experts); 1 with tp > 1: every expert whole on "
        "its rank, the MoE blocks on each tp rank's sequence shard and the ep groups drawn "
        "from the dp x tp ranks, tp innermost (Megatron-Core's MoE parallel folding)",
        exclude_if=lambda v: v is None,
    )

    stage_meshes: list[list[int]] | None = Field(
        None,
        description="per pipeline stage, [dp, tp] of the submesh it runs on (Alpa's "
        "inter-operator pass: stages on different submeshes), [dp, tp, dp_shard] under HSDP; "
        "shape is then [pp, 0, 0] and ranks[s] is stage s's [dp][tp] grid; null: every stage "
        "on shape's [dp, tp]",
        exclude_if=lambda v: v is None,
    )

    @field_validator("shape")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if len(v) != 3 or v[0] <= 0 or any(d < 0 for d in v) or (0 in v[1:] and v[1:] != [0, 0]):
            raise ValueError(
                "shape must be three positive integers [pp, dp, tp], or [pp, 0, 0] with "
                "stage_meshes"
            )
        return v

    @model_validator(mode="after")
    def _per_stage(self) -> MeshSpec:
        per_stage = self.shape[1:] == [0, 0]
        if per_stage != (self.stage_meshes is not None):
            raise ValueError("shape [pp, 0, 0] goes with stage_meshes, and only with it")
        if self.stage_meshes is not None:
            if len(self.stage_meshes) != self.shape[0]:
                raise ValueError(
                    f"stage_meshes has {len(self.stage_meshes)} entries, pp is {self.shape[0]}"
                )
            for m in self.stage_meshes:
                if len(m) not in (2, 3) or min(m) < 1 or (len(m) == 3 and m[0] % m[2]):
                    raise ValueError(
                        f"stage_meshes entry {m}: [dp, tp] or [dp, tp, dp_shard], positive "
                        "integers, dp_shard dividing dp"
                    )
            others = [k for k in ("dp_shard", "cp", "cp_comm", "ep", "etp") if getattr(self, k)]
            if others:
                raise ValueError(f"stage_meshes with {', '.join(others)} is not planned")
        return self

    @model_validator(mode="after")
    def _shard_divides_dp(self) -> MeshSpec:
        if self.dp_shard is not None and self.shape[1] % self.dp_shard:
            raise ValueError(f"dp_shard {self.dp_shard} must divide dp {self.shape[1]}")
        if self.cp is not None and self.shape[1] % self.cp:
            raise ValueError(f"cp {self.cp} must divide dp {self.shape[1]}")
        if self.cp_comm is not None and self.cp_comm not in exchanges():
            raise ValueError(f"cp_comm {self.cp_comm!r} is not one of {', '.join(exchanges())}")
        dp, tp = self.shape[1], self.shape[2]
        if self.etp is not None and (self.etp != 1 or tp == 1 or (self.ep or 1) == 1):
            raise ValueError(f"etp {self.etp}: 1 with tp > 1 and ep > 1, or null")
        if self.etp == 1 and (self.ep % tp or dp * tp % self.ep):
            raise ValueError(f"ep {self.ep} over dp x tp: a multiple of tp {tp} dividing {dp * tp}")
        if self.etp is None and self.ep is not None and dp % self.ep:
            raise ValueError(f"ep {self.ep} must divide dp {dp}")
        return self

    def stage_shape(self, index: int) -> tuple[int, int]:
        """(dp, tp) of pipeline stage `index`'s mesh (one chunk per device)."""
        if self.stage_meshes is not None:
            dp, tp = self.stage_meshes[index][:2]
            return dp, tp
        return self.shape[1], self.shape[2]

    @property
    def processes(self) -> int:
        """The ranks the plan runs on: pp x dp x tp, or every stage's submesh."""
        if self.stage_meshes is not None:
            return sum(m[0] * m[1] for m in self.stage_meshes)
        return self.dims.world

    @property
    def dims(self) -> ParallelDims:
        """The degrees as torchtitan and Megatron-LM count them (world = pp x dp x cp x tp);
        with stage_meshes dp and tp are 0 (they differ per stage: summary() names them)."""
        shape, cp, comm = self.shape, self.cp, self.cp_comm
        return ParallelDims.of_grid(shape, cp, self.dp_shard, comm, self.ep, self.etp)

    def summary(self) -> str:
        """'pp4 dp8 tp8' as ParallelDims.summary, or per stage where stages have their own
        submeshes: 'pp3 on submeshes dp2 tp2 | dp1 tp2 | dp2 tp1'."""
        if self.stage_meshes is None:
            return self.dims.summary()
        per = " | ".join(
            f"dp{m[0]} tp{m[1]}" + (f" (HSDP over {m[2]})" if len(m) == 3 else "")
            for m in self.stage_meshes
        )
        return f"pp{self.shape[0]} on submeshes {per}"


class ScheduleSpec(_Frozen):
    name: ScheduleName
    microbatches: int = Field(gt=0)
    virtual_stages: int = Field(1, gt=0)


# Megatron-layout strategy names of plans written before one vocabulary (the sharding rules')
# was used everywhere; read as today's names so such plans still run.
LEGACY_STRATEGIES = {
    "replicated": "replicate",
    "column_parallel": "col",
    "row_parallel": "row",
    "vocab_parallel": "vocab",
    "vocab_parallel_loss": "vocab",
    "head_parallel": "heads",
}


class NodeSharding(_Frozen):
    node: str
    strategy: str = Field(description="the sharding rules' name, e.g. col, row, heads, dim1")
    module: str = Field("", description="module path of the call (what the executor wraps)")
    kind: str = Field("", description="node kind (linear, embedding, attention, ...)")
    params: dict[str, list[Placement]] = Field(default_factory=dict)
    inputs: list[list[Placement]] = Field(default_factory=list)
    outputs: list[list[Placement]] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _today_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("strategy") in LEGACY_STRATEGIES:
            return {**data, "strategy": LEGACY_STRATEGIES[data["strategy"]]}
        if isinstance(data, dict) and data.get("strategy") == "sharded":
            tp_inputs = [p[-1] for p in data.get("inputs") or [] if p]
            dims = [d for d in map(shard_dim, tp_inputs) if d is not None]
            return {**data, "strategy": f"dim{dims[0] if dims else 0}"}
        return data


class MemoryPrediction(_Frozen):
    params: int = Field(ge=0)
    grads: int = Field(ge=0)
    optimizer: int = Field(ge=0)
    activations: int = Field(ge=0)
    total: int = Field(ge=0)


class LedgerEntry(_Frozen):
    kind: str = Field(
        description="all_reduce, all_gather, reduce_scatter, all_to_all, send, recv, ..."
    )
    axis: str = Field(description="mesh axis: pp, dp, tp, cp, dp_shard, dp_replicate, tied, world")
    calls: int = Field(ge=0)
    bytes: int = Field(
        ge=0, description="summed over the calls, each its collective's logical size"
    )
    routed: bool = Field(
        False,
        description="the bytes are the mean of the axis's group: the router decides each "
        "rank's share (expert parallelism's dropless token exchange), the group's total is "
        "exact",
        exclude_if=lambda v: not v,
    )


class HeldBytes(_Frozen):
    params: int = Field(ge=0)
    grads: int = Field(ge=0)
    optimizer: int = Field(ge=0)


class StageLedger(_Frozen):
    """What one rank of the stage sends and holds per step (planner.evaluate.ledger); the
    executor measures the same (executor.ledger)."""

    comm: list[LedgerEntry] = Field(default_factory=list)
    held: list[HeldBytes] = Field(
        default_factory=list,
        description="per rank of the stage, in the order of its ranks; one entry where "
        "every rank holds the same",
    )


class StagePrediction(_Frozen):
    compute_s: float = Field(ge=0, description="per micro-batch, forward + backward")
    comm_s: float = Field(ge=0, description="per micro-batch tensor-parallel + p2p comm")
    p2p_s: float = Field(
        0.0,
        ge=0,
        description="of comm_s: the pipeline sends per micro-batch (activations "
        "out in forward, their gradients out in backward)",
    )
    memory: MemoryPrediction
    ledger: StageLedger | None = None


class LogicalMeshSpec(_Frozen):
    dp: int = Field(gt=0)
    tp: int = Field(gt=0)


class _StageCore(_Frozen):
    index: int = Field(ge=0)
    modules: list[str]
    layers: list[int] = Field(description="[start, end)")
    ranks: list[int]
    logical_mesh: LogicalMeshSpec
    zero: Literal[ZERO_LEVELS] = Field(description="ZeRO level on dp (planner.vocab)")  # type: ignore[valid-type]
    resharded_layers: int | None = Field(
        None,
        ge=0,
        description="with zero 3, layer-wise ZeRO (planner.parallel.data): how many of this "
        "stage's layers, the first ones, are at ZeRO-3 (weights gathered for each "
        "micro-batch's forward and backward); the others keep their gathered weights from the "
        "step's first forward to its last backward and reduce their gradients once, as "
        "ZeRO-2; null (not written): every layer at the stage's level",
        exclude_if=lambda v: v is None,
    )
    activation_checkpointing: bool
    checkpoint_policy: CheckpointPolicyName = Field(
        "full",
        description="with activation_checkpointing: full (recompute each layer's forward), "
        "selective (keep matmul and attention outputs; recompute the rest) or "
        "selective_alternate (as selective, but every second linear layer's output is "
        "recomputed too: torchtitan's op-level policy)",
    )
    checkpointed_layers: int | None = Field(
        None,
        ge=0,
        description="with activation_checkpointing: how many of this stage's layers, the "
        "first ones, are checkpointed (partial checkpointing); null: all of them",
    )
    cpu_offload: bool = Field(
        False,
        description="ZeRO-3's shards of weights, gradients and optimizer state kept in host "
        "memory, the optimizer stepping on the CPU (FSDP2's CPUOffloadPolicy)",
    )
    shardings: list[NodeSharding] = Field(default_factory=list)
    predicted: StagePrediction

    @model_validator(mode="before")
    @classmethod
    def _unknown_techniques_off(cls, data: Any) -> Any:
        """A stage field this build does not know, off (false or null), says a technique
        this build lacks was not used: the plan loads without it. On, it is refused."""
        if isinstance(data, dict):
            return {
                k: v
                for k, v in data.items()
                if k in cls.model_fields or (v is not False and v is not None)
            }
        return data

    @model_validator(mode="after")
    def _resharded_layers_within(self) -> Any:
        layers = self.layers[1] - self.layers[0]
        if self.resharded_layers is not None and (
            self.zero != 3 or self.resharded_layers >= layers
        ):
            raise ValueError(
                f"resharded_layers {self.resharded_layers}: expected null, or with zero 3 fewer "
                f"than the stage's {layers} layers"
            )
        return self

    @property
    def zero_label(self) -> str:
        """ "ZeRO-n", or under layer-wise ZeRO "ZeRO-3 on k of n layers, 2 on the rest"
        (the stage's parameters outside its layers at ZeRO-3)."""
        if self.resharded_layers is None:
            return f"ZeRO-{self.zero}"
        layers = self.layers[1] - self.layers[0]
        if self.resharded_layers == 0:  # the stage's other parameters (embeddings, head) at 3
            return f"ZeRO-2 on all {layers} layers, 3 on the stage's other parameters"
        return f"ZeRO-3 on {self.resharded_layers} of {layers} layers, 2 on the rest"

    @property
    def activation_store(self) -> str | None:
        """The checkpointing mode of the activation store this stage uses (its stage field
        on: planner.parallel.registry.stores), or None."""
        for mode, store in stores().items():
            if getattr(self, store.stage_field, False):
                return mode
        return None

    @property
    def checkpointing_label(self) -> str:
        """ "no", "yes" (every layer; the policy's name under an op-level one), "k of n
        layers" or an activation store's mode ("offload": activations to the host)."""
        if (mode := self.activation_store) is not None:
            return mode
        if not self.activation_checkpointing:
            return "no"
        if self.checkpointed_layers is not None:
            return f"{self.checkpointed_layers} of {self.layers[1] - self.layers[0]} layers"
        return self.checkpoint_policy if self.checkpoint_policy != "full" else "yes"


# The techniques' own stage fields (Technique.stage_fields) are added to the core ones.
Stage = create_model(
    "Stage",
    __base__=_StageCore,
    __module__=__name__,
    __doc__="""One pipeline stage; with an interleaved schedule one entry per virtual stage
    (chunk), in pipeline order, device d holding chunks d, d + pp, ... (ZB-V: d and 2 pp - 1
    - d; its ranks and its per-device memory repeat on each of its entries).""",
    **stage_fields(),
)


class Predicted(_Frozen):
    step_time_s: float = Field(gt=0)
    samples_per_s: float = Field(ge=0)
    tokens_per_s: float = Field(ge=0)
    tflops_per_device: float = Field(ge=0)
    mfu: float = Field(ge=0)
    peak_memory_bytes: int = Field(ge=0)
    bubble_fraction: float = Field(ge=0, le=1)
    comm_s: float = Field(ge=0, description="communication time per step not hidden by compute")
    fits_in_memory: bool = True
    breakdown: dict[str, float] = Field(default_factory=dict, description="step time parts, s")


class SearchInfo(_Frozen):
    time_s: float = Field(ge=0)
    solver: str
    ilp_calls: int = 0
    ilp_max_vars: int = 0
    candidates_evaluated: int = 0
    candidates_pruned: int = Field(0, description="skipped: their lower bound cannot win")
    complete: bool = Field(True, description="false when the time limit cut the search")


class Alternative(_Frozen):
    summary: str
    mesh: list[int]
    schedule: str
    microbatches: int
    step_time_s: float
    peak_memory_bytes: int = 0


class TrainingRun(_Frozen):
    """A whole training run at the plan's predicted throughput (`autopar plan --train-tokens`,
    planner.search.sizing): time = tokens / throughput / goodput, GPU-hours = devices x time,
    cost = GPU-hours x price. (Plans written before goodput was stated priced the steps
    alone: goodput 1.)"""

    train_tokens: float = Field(gt=0, description="tokens the run trains on")
    steps: int = Field(ge=1, description="optimizer steps: tokens / tokens per step, rounded up")
    steps_time_s: float | None = Field(
        None, gt=0, description="time of the steps alone: tokens / predicted tokens per second"
    )
    goodput: float = Field(
        1.0,
        gt=0,
        le=1,
        description="share of the wall-clock spent on steps that count (failures and restarts, "
        "checkpoints and evaluation take the rest); time_s = steps_time_s / goodput",
    )
    time_s: float = Field(gt=0, description="wall-clock time of the run, s")
    gpu_hours: float = Field(gt=0)
    gpu_hour_price: float | None = Field(None, ge=0, description="price of one GPU-hour")
    cost: float | None = Field(None, ge=0, description="gpu_hours x gpu_hour_price")


class Plan(_Frozen):
    schema_version: Literal["1"] = SCHEMA_VERSION
    autopar_version: str = __version__
    request: PlanRequest
    mesh: MeshSpec
    schedule: ScheduleSpec
    stages: list[Stage]
    predicted: Predicted
    search: SearchInfo
    alternatives: list[Alternative] = Field(default_factory=list)
    explanation: list[str] = Field(default_factory=list)
    run: TrainingRun | None = Field(
        None, description="the whole run's time and cost, when the request gave its tokens"
    )
    executable: bool = True
    not_executable_reason: str | None = Field(
        None, description="why the executor cannot run this plan (when executable is false)"
    )
    tp_layout: TpLayoutName = Field(
        "megatron",
        description="megatron: the tp placements follow Megatron's pattern (the executor "
        "applies module-level parallel styles); per_node: chosen node by node by the ILP "
        "(the executor runs them in graph mode, on any number of pipeline stages)",
    )
    sequence_parallel: bool = Field(
        False,
        description="Megatron's sequence parallelism (tp_layout megatron, tp > 1): norms, "
        "dropout and the residual stream sharded on the sequence across the tp group; "
        "reduce-scatter and all-gather replace the tp all-reduces",
    )
    fp8: Fp8Recipe | None = Field(
        None,
        description="fp8 matmuls in every eligible linear layer (torchao's float8 training, "
        "this scaling recipe; the LM head stays bf16), or null",
    )

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str, field: str = "plan") -> Plan:
        """Parse and check the plan's own invariants (a hand-edited plan fails here, naming
        the field, before anything is launched)."""
        try:
            plan = cls.model_validate_json(text)
        except ValidationError as err:
            raise input_error_from(err, prefix=field) from None
        from planner.plan_checks import check_invariants

        check_invariants(plan, field)
        return plan
