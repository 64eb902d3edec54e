"""Request and response bodies of the REST API (with the worked examples the docs page shows)."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    PlainValidator,
    WithJsonSchema,
    create_model,
    model_validator,
)

from api.service.strict import (
    ProfileInput,
    Strict,
    cluster_schema,
    model_schema,
    no_nulls,
    strict,
)
from planner.cluster.headroom import HEADROOM_PATTERN
from planner.limits import (
    CLUSTER_NAME,
    MAX_DEVICES,
    MAX_EXPERT_IMBALANCE,
    MAX_GLOBAL_BATCH,
    MAX_NODES,
    MAX_SEQ,
    MODEL_NAME,
)
from planner.pins import PINS, Pin
from planner.plan import EXPERT_IMBALANCE_HELP, Plan, Predicted
from planner.search.sizing import (
    DURATION_PATTERN,
    GOODPUT_HELP,
    MAX_DEADLINE_S,
    MAX_PRICE,
    MAX_TRAIN_TOKENS,
    TOKENS_PATTERN,
    Sizing,
)
from planner.vocab import (
    AttentionKernel,
    DTypeName,
    OptimizerName,
    RuntimeName,
)

PlanStatus = Literal["queued", "running", "done", "infeasible", "failed", "cancelled"]
ExecutionStatus = Literal["queued", "running", "succeeded", "failed", "timed_out", "cancelled"]
# Every string a request carries has a length bound in the schema: the body limit alone
# would let one field hold megabytes that parsers then walk.
ConfigText = Annotated[str, Field(max_length=1000)]
Scalar = int | float | ConfigText | bool


def _stated(**rules: Any) -> Any:
    """Rules the schema states and the field's parser enforces (planner.search.sizing,
    planner.cluster.headroom: the same patterns), whose errors name the field and say what
    is expected ("4GiB", "15T") where pydantic's would only quote the pattern."""
    return Field(json_schema_extra=rules)


# Quantities as people write them: "15T" tokens, "30d", "5%" or "4GiB" of headroom; the
# value's bounds with its unit are the parser's (a rule across the number and its unit).
TokensText = Annotated[str, Field(max_length=64), _stated(pattern=TOKENS_PATTERN)]
DurationText = Annotated[str, Field(max_length=64), _stated(pattern=DURATION_PATTERN)]
HeadroomText = Annotated[str, Field(max_length=64), _stated(pattern=HEADROOM_PATTERN)]
Tokens = Annotated[float, _stated(minimum=1, maximum=MAX_TRAIN_TOKENS)] | TokensText
Deadline = Annotated[float, _stated(exclusiveMinimum=0, maximum=MAX_DEADLINE_S)] | DurationText
Headroom = Annotated[float, _stated(minimum=0, maximum=0.9)] | HeadroomText


PLAN_EXAMPLE = {
    "model": {"name": "gpt-1.3b", "config": {}},
    "cluster": {"name": "dgx-a100-80g", "nodes": 1},
    "training": {"global_batch_size": 64, "seq_len": 1024},
}


class ErrorMessage(BaseModel):
    detail: str = Field(description="what went wrong, naming the field where one is at fault")


class ModelInput(Strict):
    """One of: a zoo `name` (with `config` overrides), a Hugging Face `hf_config` (Llama
    family), or an OpGraph `graph` written by `autopar trace`."""

    model_config = strict(model_schema)

    name: str | None = Field(None, pattern=MODEL_NAME.pattern, examples=["gpt-1.3b"])
    config: dict[str, Scalar] = Field(
        default_factory=dict, max_length=64, examples=[{"layers": 12}]
    )
    hf_config: dict[str, Any] | None = Field(None, max_length=1000)
    graph: dict[str, Any] | None = None

    _refuse_nulls = model_validator(mode="before")(no_nulls)

    @model_validator(mode="after")
    def _one_source(self) -> ModelInput:
        sources = [k for k in ("hf_config", "graph") if getattr(self, k) is not None]
        if self.name is not None and not self.hf_config:
            sources.append("name")
        if len(sources) != 1:
            raise ValueError(
                f"give exactly one of name, hf_config or graph (got {', '.join(sources) or 'none'})"
            )
        if self.graph is not None and self.config:
            raise ValueError("config overrides apply to a zoo model, not to a graph")
        return self


class ClusterInput(Strict):
    """A bundled or stored profile by `name`, or an inline `profile`; `nodes` overrides the
    node count."""

    model_config = strict(cluster_schema)

    name: str | None = Field(None, pattern=CLUSTER_NAME.pattern, examples=["dgx-a100-80g"])
    profile: ProfileInput | None = None
    nodes: int | None = Field(None, gt=0, le=MAX_NODES, examples=[1])
    memory_headroom: Annotated[float, _stated(minimum=0, maximum=0.9)] | HeadroomText | None = (
        Field(
            None,
            description='device memory every plan leaves free: a share of it (0.05, "5%") or '
            'an amount ("4GiB"); 0 plans to the last byte; default 5%',
            examples=[0.05],
        )
    )

    _refuse_nulls = model_validator(mode="before")(no_nulls)

    @model_validator(mode="after")
    def _one_source(self) -> ClusterInput:
        if (self.name is None) == (self.profile is None):
            raise ValueError("give exactly one of name or profile")
        return self


class TrainingInput(Strict):
    global_batch_size: int = Field(gt=0, le=MAX_GLOBAL_BATCH, examples=[64])
    seq_len: int | None = Field(
        None, gt=0, le=MAX_SEQ, examples=[1024], description="default: the model's (or graph's)"
    )
    dtype: DTypeName | None = Field(
        None, description="default: the best the device supports (bf16, else fp16)"
    )
    optimizer: OptimizerName = "adamw"
    attention: AttentionKernel = "flash"
    runtime: RuntimeName = Field(
        "autopar",
        description="what will execute the plan, whose memory layout and ZeRO levels it is "
        "planned for: autopar's executor, or torchtitan, megatron or deepspeed",
    )
    expert_imbalance: float = Field(
        1.0,
        ge=1.0,
        le=MAX_EXPERT_IMBALANCE,
        description=EXPERT_IMBALANCE_HELP,
    )


class _SearchSettings(Strict):
    executable_only: bool = Field(
        True,
        description="only plans the executor runs; false: the best plan under the cost model, "
        "whatever runs it (the plan then says why it is not executable)",
    )
    top_k: int = Field(5, ge=1, le=20, description="alternatives kept in the plan")
    baselines: bool = Field(True, description="also evaluate Megatron, DP and FSDP baselines")
    export_to: Literal["torchtitan", "megatron", "deepspeed"] | None = Field(
        None,
        description="the best plan this framework can express, predicted for its runtime; "
        "the explanation says how much faster the best without that restriction would be",
    )


def _pin_field(pin: Pin) -> tuple[Any, Any]:
    """A pin of planner.pins as an optional request field (None: searched)."""
    described = f"pin {pin.help}"
    if pin.kind == "mesh":
        cell = Annotated[int, Field(gt=0, le=MAX_DEVICES)]
        return list[cell] | None, Field(  # type: ignore[valid-type]
            None, min_length=3, max_length=3, description=described
        )
    if pin.kind == "count":
        return int | None, Field(None, ge=pin.low, le=pin.high, description=described)
    if pin.kind == "switch":
        return bool | None, Field(None, description=described)
    choice = Literal[pin.choices] | None  # type: ignore[valid-type]
    return Annotated[choice, BeforeValidator(_exactly_one_of(pin.choices))], Field(
        None, description=described
    )


def _exactly_one_of(choices: tuple):
    """A choice pin's value as the JSON says it: pydantic's Literal takes false for 0 and 1
    for true (equal in Python), which a request means as neither."""

    def check(value):
        if value is None or any(type(value) is type(c) and value == c for c in choices):
            return value
        raise ValueError(f"expected one of {', '.join(json.dumps(c) for c in choices)}")

    return check


# The request's `search`: its settings, then one optional field per pin (planner.pins).
SearchInput = create_model(
    "SearchInput",
    __base__=_SearchSettings,
    __doc__="What the search may choose, and what the request pins.",
    **{pin.name: _pin_field(pin) for pin in PINS},
)


class RunInput(Strict):
    """The whole run, priced at the plan's throughput (the plan's `run`)."""

    train_tokens: Tokens = Field(
        description='tokens the run trains on: a number or "15T", "300B"', examples=["15T"]
    )
    gpu_hour_price: float | None = Field(
        None, ge=0, le=MAX_PRICE, description="price of one GPU-hour"
    )
    goodput: float | None = Field(None, gt=0, le=1, description=GOODPUT_HELP)


BATCH_RANGE = r"^(auto|[0-9]{1,8}\s*-\s*[0-9]{1,8})$"
BATCH_EXPECTED = f'an integer 1-{MAX_GLOBAL_BATCH:,}, "LO-HI" or "auto"'


def _global_batch(value: Any) -> int | str:
    """A number, or a range the planner searches (planner.search.batch reads its bounds);
    one check, so that an error names the field itself."""
    if isinstance(value, int) and not isinstance(value, bool):
        if 1 <= value <= MAX_GLOBAL_BATCH:
            return value
    elif isinstance(value, str) and re.fullmatch(BATCH_RANGE, value):
        return value
    raise ValueError(f"expected {BATCH_EXPECTED}")


GlobalBatch = Annotated[
    int | str,
    PlainValidator(_global_batch),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": MAX_GLOBAL_BATCH},
                {"type": "string", "pattern": BATCH_RANGE},
            ]
        }
    ),
]


class PlanTrainingInput(TrainingInput):
    global_batch_size: GlobalBatch = Field(
        examples=[64, "64-1024", "auto"],
        description="samples per step, or a range LO-HI or auto (1 to 16 per device) searched "
        "for the most tokens/s (the plan's explanation lists each batch tried)",
    )


class PlanCreate(Strict):
    model_config = strict({"examples": [PLAN_EXAMPLE]})

    model: ModelInput
    cluster: ClusterInput
    training: PlanTrainingInput
    search: SearchInput = Field(default_factory=SearchInput)
    run: RunInput | None = None


class SizingInput(Strict):
    """The sweep: node counts doubling from min_nodes to max_nodes, the run's tokens, and
    the constraints the answer is chosen under."""

    min_nodes: int = Field(1, ge=1, le=MAX_NODES)
    max_nodes: int = Field(16, ge=1, le=MAX_NODES)
    train_tokens: Tokens = Field(examples=["15T"])
    gpu_hour_price: float | None = Field(None, ge=0, le=MAX_PRICE)
    goodput: float | None = Field(None, gt=0, le=1, description=GOODPUT_HELP)
    deadline: (
        Annotated[float, _stated(exclusiveMinimum=0, maximum=MAX_DEADLINE_S)] | DurationText | None
    ) = Field(None, description='the run must end within it: seconds, or "30d", "12h"')
    budget: float | None = Field(None, gt=0, description="the run must cost at most this much")


class SizingCreate(Strict):
    """A sizing: the model planned on each cluster size, with the run's time and cost."""

    model: ModelInput
    cluster: ClusterInput
    training: TrainingInput
    search: SearchInput = Field(default_factory=SearchInput)
    sizing: SizingInput


class Progress(BaseModel):
    step: str | None = None
    done: int = 0
    total: int = 0


class BaselineEntry(BaseModel):
    kind: str
    fits: bool
    step_time_s: float | None = None
    tflops_per_device: float | None = None
    peak_memory_bytes: int | None = None
    mesh: list[int] | None = None
    summary: str | None = None


class PlanListItem(BaseModel):
    id: str
    status: PlanStatus
    model: str
    cluster: str
    created_at: float
    step_time_s: float | None = None


class PlanJob(PlanListItem):
    cached: bool = Field(False, description="an identical earlier request answered this one")
    started_at: float | None = None
    finished_at: float | None = None
    progress: Progress = Field(default_factory=Progress)
    error: str | None = None
    explanation: list[str] = Field(default_factory=list, description="why nothing fits")
    predicted: Predicted | None = None
    plan: Plan | None = None
    baselines: list[BaselineEntry] = Field(default_factory=list)
    links: dict[str, str] = Field(default_factory=dict)


class SizingJob(BaseModel):
    id: str
    status: PlanStatus
    model: str
    cluster: str
    created_at: float
    cached: bool = False
    started_at: float | None = None
    finished_at: float | None = None
    progress: Progress = Field(default_factory=Progress)
    error: str | None = None
    sizing: Sizing | None = None
    links: dict[str, str] = Field(default_factory=dict)


class PlanList(BaseModel):
    items: list[PlanListItem]
    total: int
    limit: int
    offset: int


class ModelInfo(BaseModel):
    name: str
    family: str
    params: int
    config: dict[str, Any]


class ConfigField(BaseModel):
    type: str
    default: Any = None


class ModelDetail(ModelInfo):
    config_schema: dict[str, ConfigField] = Field(description="overridable config keys")


class ClusterInfo(BaseModel):
    name: str
    source: Literal["bundled", "custom"]
    device: str
    nodes: int
    devices_per_node: int
    memory_bytes: int


class ExecutionCreate(Strict):
    model_config = strict({"examples": [{"plan_id": "0123456789abcdef", "steps": 3}]})

    plan_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    target: Literal["local", "slurm", "k8s"] = Field(
        "local", description="local: torchrun on this host; slurm/k8s: render launch files"
    )
    steps: int = Field(3, ge=1, le=1000)


class Execution(BaseModel):
    id: str
    plan_id: str
    target: str
    status: ExecutionStatus
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    result: dict[str, Any] | None = Field(
        None, description="per-rank outcome, measured vs predicted step time and memory"
    )
    files: dict[str, str] = Field(default_factory=dict, description="rendered launch files")
