"""A technique's declaration: what names the technique outside its own module's functions.

Each module of planner/parallel declares one `TECHNIQUE` (planner.parallel.registry lists them
in the order a rank applies them): its pins (the CLI's flags, the service's `search` fields
and autopar.plan's keywords are made from them: planner.pins), its choices (each value the
search or the plan can hold, with the executor function that runs it and its equivalence test:
planner.parallel.choice), its rows of the executor's capability table (planner.executable.RUNS:
which of the executor's paths runs it, and why the other refuses it) and the functions that
hold its time, memory and ledger terms. tests/test_invariants.py checks each declaration is
complete: every callable importable, every test id a test case, every RUNS row declared.

Pin values are the request's (JSON): switches are true/false, which the CLI spells on/off;
checkpointing takes true/false beside its policy names."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from planner.errors import InputError
from planner.parallel.choice import Choice

ExecutorMode = Literal["modules", "graph"]
MODULES_ONLY: frozenset[ExecutorMode] = frozenset({"modules"})
BOTH_PATHS: frozenset[ExecutorMode] = frozenset({"modules", "graph"})

PinKind = Literal["mesh", "count", "choice", "switch"]
CLI_SWITCH = {"on": True, "off": False}


@dataclass(frozen=True)
class ModelSupport:
    """The zoo families and Hugging Face model types a technique's executor function runs
    (the others are refused by name, before a search counts on it)."""

    technique: str  # as the refusal names it, e.g. "context parallelism"
    families: frozenset[str]
    hf_types: frozenset[str]

    def covers(self, family: str, model_config: dict | None) -> bool:
        if family == "hf":
            return (model_config or {}).get("model_type") in self.hf_types
        return family in self.families

    def refusal(self, family: str, model_config: dict | None) -> str | None:
        """Why the executor cannot run the technique on this model, or None."""
        if self.covers(family, model_config):
            return None
        kind = (model_config or {}).get("model_type") if family == "hf" else None
        return (
            f"the executor applies {self.technique} to {', '.join(sorted(self.families))} "
            f"models and Hugging Face {', '.join(sorted(self.hf_types))} models; this is a "
            + (f"Hugging Face {kind} model" if kind else f"{family} model")
        )


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve(spec: str) -> Callable:
    """The callable a declaration names as "module:name" (the executor's, imported when
    called: the planner does not import torch)."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Pin:
    name: str  # the request's `search` field, the Python keyword; the flag with dashes
    kind: PinKind
    help: str
    choices: tuple = ()  # kind choice: the values taken (True/False spelled on/off by the CLI)
    low: int = 0  # kind count: the bounds
    high: int = 0
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def cli_choices(self) -> list | None:
        if self.kind == "switch":
            return list(CLI_SWITCH)
        if self.kind == "choice":
            spelled = {True: "on", False: "off"}
            return [spelled.get(c, c) if isinstance(c, bool) else c for c in self.choices]
        return None

    def check(self, value: Any) -> Any:
        """The request's value as the search takes it (None: not pinned), or InputError
        naming `search.<name>`: the service's schema checks the same, autopar.plan's keywords
        arrive unchecked. A mesh may be spelled as the CLI spells it (PPxDPxTP)."""
        if value is None:
            return None
        field = f"search.{self.name}"
        if self.kind == "mesh":
            if (mesh := mesh_of(value)) is None:
                raise InputError(field, f"{value!r}", "[pp, dp, tp], three integers >= 1")
            return mesh
        if self.kind == "count":
            if not (_whole(value) and self.low <= value <= self.high):
                raise InputError(field, f"{value!r}", f"an integer {self.low} to {self.high}")
        elif self.kind == "switch":
            if not isinstance(value, bool):
                raise InputError(field, f"{value!r}", "true or false")
        elif not any(value == c and type(value) is type(c) for c in self.choices):
            raise InputError(field, f"{value!r}", ", ".join(map(str, self.choices)))
        return value

    def from_cli(self, value: Any) -> Any:
        """The request's value of what argparse parsed (None: not pinned)."""
        if value is None:
            return None
        if self.kind == "mesh":
            return list(value)
        takes_bool = self.kind == "switch" or any(c is True for c in self.choices)
        if takes_bool and value in CLI_SWITCH:
            return CLI_SWITCH[value]
        return value


def mesh_of(value: Any) -> list[int] | None:
    """[pp, dp, tp] from a list or as the CLI spells it ("PPxDPxTP"); None where it is not
    three integers >= 1."""
    parts = value.lower().split("x") if isinstance(value, str) else value
    if not isinstance(parts, list | tuple) or len(parts) != 3:
        return None
    parts = [int(p) if isinstance(p, str) and p.isdigit() else p for p in parts]
    return list(parts) if all(_whole(p) and p > 0 for p in parts) else None


@dataclass(frozen=True)
class Capability:
    """One row of the executor's capability table (planner.executable.RUNS)."""

    key: str  # e.g. "zero1", "cpu_offload"
    paths: frozenset[ExecutorMode]
    graph_refusal: str | None = None  # why graph mode refuses it, where it does


@dataclass(frozen=True)
class PinValues:
    """Values a technique adds to another technique's pin (activation offload is a value of
    `checkpointing`): the pin takes them beside its own, its help names them."""

    pin: str
    choices: tuple
    help: str


@dataclass(frozen=True)
class ActivationStore:
    """A checkpointing mode that recomputes nothing: each layer's saved activations are kept
    off the device between its forward and its backward and copied there and back. The
    checkpointing terms (planner.parallel.checkpointing), the stage DP's inputs, the step's
    prediction, the search and the executor call these for a mode that names one."""

    mode: str  # the checkpointing value (the pin's, ParallelConfig.checkpointing)
    label: str  # its name in explanations and summaries
    stage_field: str  # the Plan's stages[] switch it sets
    capability: str  # its row of the executor's capability table
    # (cluster) -> why the cluster cannot hold the activations, or None
    refusal: Callable[[Any], str | None]
    # (cluster, a micro-batch's saved layer bytes on a device) -> seconds, out and back
    transfer_time: Callable[[Any, float], float]
    # (a layer's input bytes, its largest output's bytes) -> bytes its backward holds
    transit_bytes: Callable[[int, int], int]
    # (saved layer bytes per micro-batch, micro-batches in flight) -> bytes off the device
    host_bytes: Callable[[float, float], int]
    apply: str  # "module:function" of the executor's: (stage) -> its counter of moved bytes

    def apply_to(self, stage) -> list[int]:
        """Run the executor's function on a stage module (imported here: the planner does
        not import torch)."""
        return resolve(self.apply)(stage)


@dataclass(frozen=True)
class Collective:
    """One collective a rank issues: its kind (planner.evaluate.ledger's vocabulary, a
    CostModel method), the bytes of its buffer on each rank, how many times."""

    kind: str
    nbytes: int
    count: int


@dataclass(frozen=True)
class ExchangeTerms:
    """What a sequence exchange costs one cp rank in one layer and micro-batch."""

    forward: tuple[Collective, ...]  # issued again where the layer recomputes
    backward: tuple[Collective, ...]
    # saved for backward beyond 1/cp of what the traced attention saves (may be negative)
    kept_bytes: int
    # this rank's attention FLOPs in the layer (forward, backward): what an exchange that
    # overlaps its transfers with attention can hide them behind
    attention_flops: tuple[float, float] = (0.0, 0.0)

    def time(self, cost, axis, collectives: tuple[Collective, ...]) -> float:
        """The collectives one after another, none hidden (cost: a CostModel, whose methods
        are the collectives' kinds)."""
        return sum(c.count * getattr(cost, c.kind)(c.nbytes, axis) for c in collectives)


@dataclass(frozen=True)
class SequenceExchange:
    """How the ranks of a context-parallel group give each rank's attention what it needs of
    the others' tokens (Megatron-LM's --cp-comm-type): the plan's mesh.cp_comm. Context
    parallelism's terms (planner.parallel.context) scale a layer's work by 1 / cp and add
    the exchange's; the executor's attention calls its shard."""

    name: str  # the cp_comm value
    label: str  # its name in explanations
    # (model config, cp, tp) -> why this model's heads cannot be exchanged so, or None
    refusal: Callable[[dict, int, int], str | None]
    # (the layer's AttentionBytes at the micro-batch, cp, tp, kernels) -> ExchangeTerms;
    # kernels: the device's ("cpu": gloo, which has no reduce-scatter)
    terms: Callable[[Any, int, int, str], ExchangeTerms]
    # "module:Class" of the executor's: (group, cp, rank, seq, device) -> the attention
    # callable GQAttention.context takes
    shard: str
    megatron: str | None  # Megatron-LM's --cp-comm-type value; None: it has none
    torchtitan: str | None  # torchtitan's context_parallel_rotate_method; None: none
    # (terms, cost model, cp axis) -> (forward, backward) seconds not hidden by compute;
    # None: the collectives one after another (ExchangeTerms.time)
    exposed: Callable[[ExchangeTerms, Any, Any], tuple[float, float]] | None = None

    def times(self, terms: ExchangeTerms, cost, axis) -> tuple[float, float]:
        if self.exposed is not None:
            return self.exposed(terms, cost, axis)
        return terms.time(cost, axis, terms.forward), terms.time(cost, axis, terms.backward)

    def shard_for(self, group, cp: int, rank: int, seq: int, device):
        return resolve(self.shard)(group, cp, rank, seq, device)


@dataclass(frozen=True)
class Technique:
    name: str
    order: int  # where a rank applies it among the others (planner.parallel.registry)
    pins: tuple[Pin, ...]
    choices: tuple[Choice, ...]
    # "module:function" of its time, memory and ledger terms (what planner.evaluate calls)
    terms: tuple[str, ...]
    capabilities: tuple[Capability, ...] = ()  # none: runs on whichever path runs its layout
    extends: tuple[PinValues, ...] = ()
    # the fields it adds to the Plan's stages: name -> (type, pydantic Field); written where
    # used (exclude_if), so that a plan that does not use a technique loads without it
    stage_fields: dict[str, tuple[type, Any]] = field(default_factory=dict)
    store: ActivationStore | None = None
    exchange: SequenceExchange | None = None
