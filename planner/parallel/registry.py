"""Every technique's declaration (planner.parallel.technique): the modules of planner/parallel
that declare a `TECHNIQUE`, in the order a rank applies them (Technique.order; DESIGN.md): fp8
swaps the linear modules first, then tensor, sequence and context placements, activation
checkpointing or offload, ZeRO/FSDP2 over dp and its CPU offload, and the pipeline schedule
last. Found, not listed: a technique is added or removed with its module.

Read through functions, not at import: the declarations import the cost model, and the
checkpointing terms look up the activation stores while the registry is being read."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import replace

import planner.parallel
from planner.parallel.technique import ActivationStore, Pin, SequenceExchange, Technique


@functools.cache
def techniques() -> tuple[Technique, ...]:
    found = []
    for info in pkgutil.iter_modules(planner.parallel.__path__):
        module = importlib.import_module(f"planner.parallel.{info.name}")
        declared = getattr(module, "TECHNIQUE", None)
        if isinstance(declared, Technique):
            found.append(declared)
    return tuple(sorted(found, key=lambda t: t.order))


@functools.cache
def technique_pins() -> dict[str, tuple[Pin, ...]]:
    """Each technique's pins, with the values other techniques add to them (PinValues)."""
    added: dict[str, list] = {}
    for t in techniques():
        for values in t.extends:
            added.setdefault(values.pin, []).append(values)
    out = {}
    for t in techniques():
        pins = []
        for pin in t.pins:
            for values in added.get(pin.name, ()):
                choices, help_text = pin.choices + values.choices, f"{pin.help}; {values.help}"
                pin = replace(pin, choices=choices, help=help_text)
            pins.append(pin)
        out[t.name] = tuple(pins)
    return out


@functools.cache
def stores() -> dict[str, ActivationStore]:
    """The activation stores by their checkpointing mode."""
    return {t.store.mode: t.store for t in techniques() if t.store is not None}


def store_of(mode) -> ActivationStore | None:
    """The activation store a checkpointing mode names, or None (a recompute mode, or none)."""
    return stores().get(mode) if isinstance(mode, str) else None


@functools.cache
def stage_fields() -> dict[str, tuple[type, object]]:
    """The fields the techniques add to the Plan's stages."""
    return {name: f for t in techniques() for name, f in t.stage_fields.items()}


@functools.cache
def exchanges() -> dict[str, SequenceExchange]:
    """The context-parallel sequence exchanges by their cp_comm name."""
    return {t.exchange.name: t.exchange for t in techniques() if t.exchange is not None}


def exchange_of(name: str | None) -> SequenceExchange:
    """The exchange a plan's cp_comm names (None: context parallelism's own, all-gather)."""
    return exchanges()[name or DEFAULT_EXCHANGE]


DEFAULT_EXCHANGE = "all_gather"
