"""The search's pins: the choices a user may fix instead of letting the search make them.
Each is declared once here; the CLI's flags (api.cli.plan.add_pins), the service's
`search` fields (api.service.schemas.SearchInput), autopar.plan's keywords and the request's
search options (planner.request.search_options) are made from these declarations, and
tests/test_pins.py checks that the three surfaces take exactly these.

Values are the request's (JSON): switches are true/false, which the CLI spells on/off;
checkpointing takes true/false beside its policy names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from planner.limits import MAX_DEVICES, MAX_GLOBAL_BATCH, MAX_LAYERS
from planner.vocab import FP8_RECIPES, SCHEDULES, ZERO_LEVELS

PinKind = Literal["mesh", "count", "choice", "switch"]
CLI_SWITCH = {"on": True, "off": False}


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


PINS: tuple[Pin, ...] = (
    Pin(
        "mesh",
        "mesh",
        "the mesh [pp, dp, tp] (CLI: PPxDPxTP, e.g. 2x2x1); with cp, the world is "
        "pp x dp x cp x tp, as torchtitan and Megatron-LM count it",
        metavar="PPxDPxTP",
    ),
    Pin("schedule", "choice", "the pipeline schedule", choices=SCHEDULES),
    Pin(
        "virtual_stages",
        "count",
        "model chunks per device (2 or more: interleaved 1F1B or zero bubble)",
        low=1,
        high=MAX_LAYERS,
    ),
    Pin("zero", "choice", "the ZeRO stage on dp", choices=ZERO_LEVELS),
    Pin(
        "checkpointing",
        "choice",
        "activation checkpointing: true (CLI on: full), false (off), selective (keep matmul "
        "and attention outputs), selective_alternate (keep every second linear layer's "
        "output: torchtitan's op-level policy), partial (full on the fewest layers per stage "
        "that fit) or offload (no recompute: every layer's activations to host memory and "
        "back)",
        choices=(True, False, "selective", "selective_alternate", "partial", "offload"),
    ),
    Pin(
        "microbatch_size",
        "count",
        "samples per micro-batch",
        low=1,
        high=MAX_GLOBAL_BATCH,
        metavar="N",
    ),
    Pin(
        "tp_layout",
        "choice",
        "the tensor-parallel layout: megatron, or per_node (chosen node by node by the ILP)",
        choices=("megatron", "per_node"),
    ),
    Pin(
        "sequence_parallel",
        "switch",
        "Megatron's sequence parallelism (norms and residuals sharded on the sequence; with "
        "tp_layout megatron)",
    ),
    Pin(
        "dp_shard",
        "count",
        "HSDP: ZeRO shards over groups of N dp ranks and replicates across them (0: over all "
        "of dp)",
        low=0,
        high=MAX_DEVICES,
        metavar="N",
    ),
    Pin(
        "cp",
        "count",
        "context parallelism: groups of N ranks split each sample's sequence, a degree of "
        "its own beside dp (1: none; default: searched for sequences of 8,192 tokens and "
        "more, 1 where the mesh is pinned)",
        low=1,
        high=MAX_DEVICES,
        metavar="N",
    ),
    Pin(
        "cpu_offload",
        "switch",
        "ZeRO-3's shards of weights, gradients and optimizer state in host memory, the "
        "optimizer on the CPU (default: only where nothing fits without it)",
    ),
    Pin(
        "fp8",
        "choice",
        "fp8 matmuls (torchao float8 training) with this recipe, or off (default: tensorwise "
        "searched beside none on devices with fp8 tensor cores, for bf16 runs)",
        choices=("off", *FP8_RECIPES),
    ),
)
PIN_NAMES: tuple[str, ...] = tuple(p.name for p in PINS)
