"""Cluster profiles: devices, nodes, link tiers, efficiency factors, optional measurements.

Link semantics (what the cost model assumes):
- `links.intra_node.bandwidth`: bytes/s one device can send to its peers inside a node, in one
  direction (NVLink per-GPU figure), `latency` in seconds per message hop.
- `links.inter_node.bandwidth`: bytes/s of one node's network interfaces together, one
  direction. Groups that cross nodes share it: a group with g devices on each node, while all
  dpn/g such groups communicate at once, gets g/dpn of it per device.
A mesh axis whose group stays inside one node uses the intra-node tier, otherwise the
inter-node tier (the slowest link on the ring bounds a ring collective).
"""

from __future__ import annotations

import functools
import hashlib
import json
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from planner.errors import InputError, input_error_from
from planner.limits import (
    CLUSTER_NAME,
    MAX_BANDWIDTH,
    MAX_DEVICES,
    MAX_DEVICES_PER_NODE,
    MAX_FLOPS,
    MAX_LATENCY_S,
    MAX_MEASURED_DIM,
    MAX_MEASURED_POINTS,
    MAX_MEMORY_BYTES,
    MAX_NODES,
    check_int,
)

DType = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]
Tier = Literal["intra_node", "inter_node"]
Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]
Flops = Annotated[float, Field(gt=0, le=MAX_FLOPS, allow_inf_nan=False)]


class DeviceSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(max_length=200)
    memory_bytes: PositiveInt = Field(le=MAX_MEMORY_BYTES)
    peak_flops: dict[DType, Flops] = Field(description="dense FLOP/s per dtype")
    memory_bandwidth: PositiveFloat = Field(le=MAX_BANDWIDTH, description="bytes/s")
    kernels: Literal["cuda", "cpu"] = Field(
        "cuda",
        description="whose kernels torch dispatches to there: what some ops keep for backward "
        "differs (planner.cost.model.CostModel.saved_bytes)",
    )


class HostSpec(BaseModel):
    """What each device's host offers CPU offload (planner.parallel.offload): the device's
    own host link (PCIe, one direction) and its share of the host's memory bandwidth."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    link_bandwidth: PositiveFloat = Field(le=MAX_BANDWIDTH, description="bytes/s, one way")
    memory_bandwidth: PositiveFloat = Field(
        le=MAX_BANDWIDTH, description="bytes/s: the host's memory bandwidth / devices per node"
    )
    memory_bytes: PositiveInt = Field(
        le=MAX_MEMORY_BYTES, description="the host's memory / devices per node"
    )


class LinkTier(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    bandwidth: PositiveFloat = Field(le=MAX_BANDWIDTH, description="bytes/s, one direction")
    latency: float = Field(ge=0, le=MAX_LATENCY_S, description="seconds per message hop")


class Links(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    intra_node: LinkTier
    inter_node: LinkTier


class Efficiency(BaseModel):
    """Fractions of datasheet peaks that real kernels reach (calibrated in bench/)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    matmul: float = Field(0.75, gt=0, le=1, description="of peak FLOP/s, large GEMMs")
    memory: float = Field(0.7, gt=0, le=1, description="of peak memory bandwidth")
    comm: float = Field(0.8, gt=0, le=1, description="of link bandwidth, large messages")
    # 1.0 is the ideal (no contention); profile-cluster measures it. Lee et al. 2025
    # (arXiv:2507.03114) measured compute 18.9% slower on average (40% at most) while
    # collectives ran under it, on A100, H100, MI250 and MI210: not applied to the bundled
    # profiles, whose calibrations (bench/) were made at 1.0.
    overlap: float = Field(
        1.0,
        ge=0,
        le=1,
        description="share of data-parallel communication hidden under compute (exposed: "
        "(1 - overlap) x the part run under compute, planner.parallel.data.exposed)",
    )


class MeasuredPoint(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    group_size: int = Field(ge=2, le=MAX_DEVICES)
    bytes: PositiveInt = Field(le=MAX_MEMORY_BYTES)
    seconds: PositiveFloat = Field(le=1e6)


Points = Annotated[list[MeasuredPoint], Field(max_length=MAX_MEASURED_POINTS)]


class LinkFit(BaseModel):
    """Alpha-beta fit of one collective's timings: t = hops x latency + volume x B / bandwidth."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    group_size: int = Field(ge=2, le=MAX_DEVICES)
    latency: float = Field(ge=0, le=MAX_LATENCY_S, description="seconds per hop (alpha)")
    bandwidth: PositiveFloat = Field(le=MAX_BANDWIDTH, description="bytes/s (1 / beta)")
    rel_residual: float = Field(ge=0, le=1e6, description="RMS of (fit - measured) / measured")
    points: int = Field(ge=2, le=MAX_MEASURED_POINTS)


class MatmulPoint(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    dtype: DType
    shape: list[Annotated[int, Field(ge=1, le=MAX_MEASURED_DIM)]] = Field(
        min_length=3, max_length=3, description="m, k, n"
    )
    flops_per_s: Flops


class AttentionPoint(BaseModel):
    """Causal scaled_dot_product_attention timed at one (batch x heads, sequence, head dim)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    dtype: DType
    batch_heads: int = Field(ge=1, le=MAX_MEASURED_DIM)
    seq: int = Field(ge=1, le=MAX_MEASURED_DIM)
    head_dim: int = Field(ge=1, le=MAX_MEASURED_DIM)
    fwd_s: PositiveFloat = Field(le=1e6)
    bwd_s: PositiveFloat = Field(le=1e6)


class OpTimeRow(BaseModel):
    """One measured operator: forward and backward seconds at one shape signature."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    dtype: DType
    op: str = Field(max_length=200, description="e.g. aten.mm.default")
    signature: str = Field(max_length=2000, description="input and parameter shapes")
    work: float = Field(ge=0, le=1e30, description="FLOPs, or bytes moved for ops without")
    fwd_s: float = Field(ge=0, le=1e6)
    bwd_s: float = Field(ge=0, le=1e6)


class ExecutorOverhead(BaseModel):
    """Time the executor's machinery adds beyond operators and collectives, measured by
    `autopar profile-executor` on small calibration runs (seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    fsdp_layer_step_s: float = Field(0.0, ge=0, description="per layer per step, dp > 1")
    fsdp_layer_microbatch_s: float = Field(
        0.0, ge=0, description="per layer per micro-batch (FSDP's hooks), dp > 1"
    )
    tp_layer_microbatch_s: float = Field(0.0, ge=0, description="per layer per micro-batch, tp > 1")
    pp_microbatch_s: float = Field(0.0, ge=0, description="per micro-batch per stage, pp > 1")
    calibrated_with: str = Field("", max_length=2000)


class Measured(BaseModel):
    """Optional measurements; where present the cost model prefers them over formulas."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    when: str | None = Field(None, max_length=200)
    where: str | None = Field(None, max_length=200)
    # tier -> collective -> timings at (group size, message bytes)
    collectives: dict[Tier, dict[Collective, Points]] = Field(default_factory=dict)
    # tier -> collective -> alpha-beta fit (with its residual)
    fits: dict[Tier, dict[Collective, LinkFit]] = Field(default_factory=dict)
    # achievable dense matmul FLOP/s per dtype (replaces peak x efficiency.matmul)
    achieved_flops: dict[DType, Flops] = Field(default_factory=dict)
    matmuls: list[MatmulPoint] = Field(default_factory=list, max_length=MAX_MEASURED_POINTS)
    attention_flops: dict[DType, Flops] = Field(
        default_factory=dict, description="achieved FLOP/s of scaled_dot_product_attention"
    )
    attention_times: list[AttentionPoint] = Field(
        default_factory=list,
        max_length=MAX_MEASURED_POINTS,
        description="causal attention forward and backward seconds by shape",
    )
    memory_bandwidth: PositiveFloat | None = Field(
        None, le=MAX_BANDWIDTH, description="bytes/s of a large copy"
    )
    overlap: float | None = Field(
        None, ge=0, le=1, description="measured share of an all-reduce hidden under matmuls"
    )
    op_times: list[OpTimeRow] = Field(
        default_factory=list,
        max_length=MAX_MEASURED_POINTS,
        description="measured operator times inline (rows of an autopar profile-ops database)",
    )
    executor_overhead: ExecutorOverhead | None = None


class ClusterProfile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(pattern=CLUSTER_NAME.pattern, description="letters, digits, . _ -")
    description: str = Field("", max_length=2000)
    sources: list[Annotated[str, Field(max_length=2000)]] = Field(
        default_factory=list, max_length=100, description="where the figures come from"
    )
    device: DeviceSpec
    nodes: PositiveInt = Field(le=MAX_NODES, description=f"at most {MAX_NODES:,}")
    devices_per_node: PositiveInt = Field(le=MAX_DEVICES_PER_NODE)
    links: Links
    efficiency: Efficiency = Efficiency()
    host: HostSpec | None = None
    measured: Measured | None = None
    memory_headroom_bytes: int = Field(
        0,
        ge=0,
        le=MAX_MEMORY_BYTES,
        description="device memory every plan leaves free (the request's memory headroom, "
        "planner.cluster.headroom); plans must fit in the rest",
    )

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def usable_memory_bytes(self) -> int:
        """What a plan may use of each device: its memory less the headroom (none when the
        headroom is all of it: then nothing fits, and the search says why)."""
        return max(0, self.device.memory_bytes - self.memory_headroom_bytes)

    @model_validator(mode="after")
    def _bounded_devices(self) -> ClusterProfile:
        if self.nodes * self.devices_per_node > MAX_DEVICES:
            raise ValueError(
                f"nodes x devices_per_node = {self.nodes * self.devices_per_node:,} devices; "
                f"at most {MAX_DEVICES:,}"
            )
        return self

    def with_nodes(self, nodes: int | None, field: str = "cluster.nodes") -> ClusterProfile:
        if nodes is None:
            return self
        check_int(field, nodes, 1, MAX_NODES, "no cluster has that many nodes")
        total = nodes * self.devices_per_node
        if total > MAX_DEVICES:
            raise InputError(
                field, f"{nodes} nodes make {total:,} devices", f"at most {MAX_DEVICES:,}"
            )
        return self.model_copy(update={"nodes": nodes})

    def peak_flops(self, dtype: str) -> float:
        table = self.device.peak_flops
        if dtype in table:
            return table[dtype]
        raise InputError(
            "dtype",
            f"device {self.device.name} has no peak FLOP/s for {dtype!r}",
            "one of " + ", ".join(table),
        )

    def model_copy(self, *, update=None, deep: bool = False) -> ClusterProfile:
        """A copy that hashes its own content (pydantic copies cached properties along)."""
        copy = super().model_copy(update=update, deep=deep)
        copy.__dict__.pop("content_hash", None)
        return copy

    @cached_property
    def content_hash(self) -> str:
        content = self.model_dump(mode="json")
        if not content["memory_headroom_bytes"]:  # hashes as before the field existed
            del content["memory_headroom_bytes"]
        blob = json.dumps(content, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def group_link(self, ranks: list[int]) -> tuple[float, float, bool]:
        """(effective bandwidth per device, latency, crosses nodes) for a device group."""
        nodes: dict[int, int] = {}
        for r in ranks:
            nodes[self.node_of(r)] = nodes.get(self.node_of(r), 0) + 1
        if len(nodes) <= 1:
            tier = self.links.intra_node
            return tier.bandwidth, tier.latency, False
        tier = self.links.inter_node
        per_node = min(nodes.values())
        share = tier.bandwidth * per_node / self.devices_per_node
        return min(share, self.links.intra_node.bandwidth), tier.latency, True


def bundled_names() -> list[str]:
    files = resources.files("cluster_profiles")
    return sorted(p.name.removesuffix(".yaml") for p in files.iterdir() if p.name.endswith(".yaml"))


def parse_profile(obj: object, field: str = "cluster") -> ClusterProfile:
    if not isinstance(obj, dict):
        raise InputError(field, "not a mapping", "a cluster profile (YAML mapping)")
    try:
        return ClusterProfile.model_validate(obj)
    except ValidationError as err:
        raise input_error_from(err, prefix=field) from None


# libyaml's parser where PyYAML was built with it: the bundled H100/H200 profiles carry ~1,000
# measured points (0.5 s with the pure-Python parser).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=16)
def _bundled(name: str) -> ClusterProfile:
    """A bundled profile, parsed once per process (they are read-only package data)."""
    text = (resources.files("cluster_profiles") / f"{name}.yaml").read_text()
    return parse_profile(yaml.load(text, Loader=_LOADER), field="cluster")


def load_cluster(
    name_or_path: str, nodes: int | None = None, field: str = "--cluster", nodes_field="--nodes"
):
    """A bundled profile by name, or a YAML file by path; `nodes` overrides the node count."""
    path = Path(name_or_path)
    if name_or_path.endswith((".yaml", ".yml")) or path.is_file():
        try:
            text = path.read_text()
        except OSError as err:
            raise InputError(field, f"cannot read {name_or_path}: {err.strerror}") from None
    else:
        if name_or_path not in bundled_names():
            raise InputError(
                field,
                f"unknown cluster {name_or_path!r}",
                "a YAML path or one of " + ", ".join(bundled_names()),
            )
        return _bundled(name_or_path).with_nodes(nodes, field=nodes_field)
    try:
        obj = yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as err:
        raise InputError(field, f"{name_or_path} is not valid YAML: {err}") from None
    # A profile file on the user's machine may name its operator database (profile-cluster
    # writes `measured.op_db`); its rows are read now, relative to the file.
    op_db = None
    if isinstance(obj, dict) and isinstance(obj.get("measured"), dict):
        op_db = obj["measured"].pop("op_db", None)
    profile = parse_profile(obj, field="cluster").with_nodes(nodes, field=nodes_field)
    if op_db:
        from planner.cluster.profiling import inline_op_db

        profile = inline_op_db(profile, path.parent / op_db, field=f"{field}: measured.op_db")
    return profile
