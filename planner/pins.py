"""The search's pins: the choices a user may fix instead of letting the search make them.
The mesh and the micro-batch size are the search's own; every other pin is declared by its
technique (planner.parallel.registry). The CLI's flags (api.cli.plan.add_pins), the service's
`search` fields (api.service.schemas.SearchInput), autopar.plan's keywords and the request's
search options (planner.request.search_options) are made from PINS, and tests/test_pins.py
checks that the three surfaces take exactly these."""

from __future__ import annotations

from planner.limits import MAX_GLOBAL_BATCH
from planner.parallel.registry import TECHNIQUES
from planner.parallel.technique import CLI_SWITCH, Pin

__all__ = ["CLI_SWITCH", "PINS", "PIN_NAMES", "Pin"]

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
PINS: tuple[Pin, ...] = SEARCH_PINS + tuple(pin for t in TECHNIQUES for pin in t.pins)
PIN_NAMES: tuple[str, ...] = tuple(p.name for p in PINS)
