"""The search's pins: the choices a user may fix instead of letting the search make them.
The mesh and the micro-batch size are the search's own; the others are each a technique's,
declared with it (TECHNIQUE_PINS: by technique, in the registry's order, with the values other
techniques add to them: planner.parallel.registry.technique_pins). The CLI's flags
(api.cli.plan.add_pins), the service's `search` fields (api.service.schemas.SearchInput),
autopar.plan's keywords and the request's search options (planner.request.search_options)
are made from PINS; tests/test_pins.py checks that the three surfaces take exactly these,
tests/test_invariants.py that each technique declares its own."""

from __future__ import annotations

from planner.limits import MAX_GLOBAL_BATCH
from planner.parallel.registry import technique_pins
from planner.parallel.technique import CLI_SWITCH, Pin

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
TECHNIQUE_PINS: dict[str, tuple[Pin, ...]] = technique_pins()
PINS: tuple[Pin, ...] = SEARCH_PINS + tuple(p for pins in TECHNIQUE_PINS.values() for p in pins)
PIN_NAMES: tuple[str, ...] = tuple(p.name for p in PINS)
