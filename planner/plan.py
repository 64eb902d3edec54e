"""The Plan: the JSON contract between planner, service, viewer and executor.

Field names follow ../shared/DESIGN.md ("The plan"); add fields freely, rename none without
bumping SCHEMA_VERSION. Placements are one string per mesh axis: "R" (replicate), "S(d)"
(shard tensor dim d), "P" (partial sum). No torch import here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from planner import __version__
from planner.errors import input_error_from

SCHEMA_VERSION = "1"

Placement = Annotated[str, Field(pattern=r"^(R|P|S\(-?\d+\))$")]
ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b"]
DTypeName = Literal["fp32", "bf16", "fp16"]
OptimizerName = Literal["adamw", "adam", "sgd", "sgd_momentum"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TrainingSettings(_Frozen):
    global_batch_size: int = Field(gt=0, examples=[64])
    seq_len: int = Field(gt=0, examples=[1024])
    dtype: DTypeName = "bf16"
    optimizer: OptimizerName = "adamw"
    attention: Literal["flash", "math"] = Field(
        "flash",
        description="attention kernel: flash/memory-efficient (O(s) memory) or math "
        "(materialises the s x s scores, as pre-FlashAttention Megatron and V100 runs did)",
    )


class ModelRef(_Frozen):
    name: str
    family: str
    config: dict[str, Any]
    params: int = Field(ge=0)
    content_hash: str


class ClusterRef(_Frozen):
    name: str
    content_hash: str
    nodes: int = Field(gt=0)
    devices_per_node: int = Field(gt=0)
    device: str
    device_memory_bytes: int | None = Field(None, gt=0, description="capacity per device")


class PlanRequest(_Frozen):
    model: ModelRef
    cluster: ClusterRef
    training: TrainingSettings


class MeshSpec(_Frozen):
    shape: list[int] = Field(description="[pp, dp, tp]")
    axis_names: list[str] = ["pp", "dp", "tp"]
    ranks: list[list[list[int]]] = Field(description="ranks[pp][dp][tp]")

    @field_validator("shape")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if len(v) != 3 or any(d <= 0 for d in v):
            raise ValueError("shape must be three positive integers [pp, dp, tp]")
        return v


class ScheduleSpec(_Frozen):
    name: ScheduleName
    microbatches: int = Field(gt=0)
    virtual_stages: int = Field(1, gt=0)


class NodeSharding(_Frozen):
    node: str
    strategy: str
    module: str = Field("", description="module path of the call (what the executor wraps)")
    kind: str = Field("", description="node kind (linear, embedding, attention, ...)")
    params: dict[str, list[Placement]] = Field(default_factory=dict)
    inputs: list[list[Placement]] = Field(default_factory=list)
    outputs: list[list[Placement]] = Field(default_factory=list)


class MemoryPrediction(_Frozen):
    params: int = Field(ge=0)
    grads: int = Field(ge=0)
    optimizer: int = Field(ge=0)
    activations: int = Field(ge=0)
    total: int = Field(ge=0)


class StagePrediction(_Frozen):
    compute_s: float = Field(ge=0, description="per micro-batch, forward + backward")
    comm_s: float = Field(ge=0, description="per micro-batch tensor-parallel + p2p comm")
    memory: MemoryPrediction


class LogicalMeshSpec(_Frozen):
    dp: int = Field(gt=0)
    tp: int = Field(gt=0)


class Stage(_Frozen):
    """One pipeline stage; with an interleaved schedule one entry per virtual stage (chunk),
    in pipeline order, device d holding chunks d, d + pp, ... (its ranks and its per-device
    memory repeat on each of its entries)."""

    index: int = Field(ge=0)
    modules: list[str]
    layers: list[int] = Field(description="[start, end)")
    ranks: list[int]
    logical_mesh: LogicalMeshSpec
    zero: int = Field(ge=0, le=3)
    activation_checkpointing: bool
    shardings: list[NodeSharding] = Field(default_factory=list)
    predicted: StagePrediction


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


class Alternative(_Frozen):
    summary: str
    mesh: list[int]
    schedule: str
    microbatches: int
    step_time_s: float
    peak_memory_bytes: int = 0


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
    executable: bool = True
    tp_layout: Literal["megatron", "per_node"] = Field(
        "megatron",
        description="megatron: the tp placements follow Megatron's pattern (the executor "
        "applies module-level parallel styles); per_node: chosen node by node by the ILP "
        "(the executor runs single-stage plans in graph mode)",
    )

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str, field: str = "plan") -> Plan:
        try:
            return cls.model_validate_json(text)
        except ValidationError as err:
            raise input_error_from(err, prefix=field) from None
