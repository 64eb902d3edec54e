"""The search's pins: the choices a user may fix instead of letting the search make them.
The mesh and the micro-batch size are the search's own; the others are each a technique's
(TECHNIQUE_PINS, by the name its planner.parallel declaration carries them under; the registry
order). They are written here rather than in the technique modules so that building the CLI's
parser imports no cost model (the technique modules import numpy, networkx and the profiles:
200 ms more for every command). The CLI's flags (api.cli.plan.add_pins), the service's
`search` fields (api.service.schemas.SearchInput), autopar.plan's keywords and the request's
search options (planner.request.search_options) are made from PINS; tests/test_pins.py checks
that the three surfaces take exactly these, tests/test_invariants.py that each technique
declares its own."""

from __future__ import annotations

from planner.limits import MAX_DEVICES, MAX_GLOBAL_BATCH, MAX_LAYERS
from planner.parallel.technique import CLI_SWITCH, Pin
from planner.vocab import FP8_RECIPES, SCHEDULES, ZERO_LEVELS

__all__ = ["CLI_SWITCH", "PINS", "PIN_NAMES", "TECHNIQUE_PINS", "Pin"]

SEARCH_PINS: tuple[Pin, ...] = (
    Pin(
        "mesh",
        "mesh",
        "the mesh [pp, dp, tp] (CLI: PPxDPxTP, e.g. 2x2x1); with cp, the world is "
        "pp x dp x cp x tp, as torchtitan and Megatron-LM count it",
        metavar="PPxDPxTP",
    ),
    Pin(
        "microbatch_size",
        "count",
        "samples per micro-batch",
        low=1,
        high=MAX_GLOBAL_BATCH,
        metavar="N",
    ),
)
TECHNIQUE_PINS: dict[str, tuple[Pin, ...]] = {
    "fp8": (
        Pin(
            "fp8",
            "choice",
            "fp8 matmuls (torchao float8 training) with this recipe, or off (default: tensorwise "
            "searched beside none on devices with fp8 tensor cores, for bf16 runs)",
            choices=("off", *FP8_RECIPES),
        ),
    ),
    "tensor": (
        Pin(
            "tp_layout",
            "choice",
            "the tensor-parallel layout: megatron, or per_node (chosen node by node by the ILP)",
            choices=("megatron", "per_node"),
        ),
    ),
    "sequence": (
        Pin(
            "sequence_parallel",
            "switch",
            "Megatron's sequence parallelism (norms and residuals sharded on the sequence; with "
            "tp_layout megatron)",
        ),
    ),
    "context": (
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
    ),
    "checkpointing": (
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
    ),
    "activation_offload": (),
    "data": (
        Pin("zero", "choice", "the ZeRO stage on dp", choices=ZERO_LEVELS),
        Pin(
            "dp_shard",
            "count",
            "HSDP: ZeRO shards over groups of N dp ranks and replicates across them (0: over all "
            "of dp)",
            low=0,
            high=MAX_DEVICES,
            metavar="N",
        ),
    ),
    "offload": (
        Pin(
            "cpu_offload",
            "switch",
            "ZeRO-3's shards of weights, gradients and optimizer state in host memory, the "
            "optimizer on the CPU (default: only where nothing fits without it)",
        ),
    ),
    "pipeline": (
        Pin("schedule", "choice", "the pipeline schedule", choices=SCHEDULES),
        Pin(
            "virtual_stages",
            "count",
            "model chunks per device (2 or more: interleaved 1F1B or zero bubble)",
            low=1,
            high=MAX_LAYERS,
        ),
    ),
}
PINS: tuple[Pin, ...] = SEARCH_PINS + tuple(p for pins in TECHNIQUE_PINS.values() for p in pins)
PIN_NAMES: tuple[str, ...] = tuple(p.name for p in PINS)
