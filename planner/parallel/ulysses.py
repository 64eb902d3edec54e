"""Ulysses: context parallelism whose ranks exchange heads for tokens (Jacobs et al. 2023,
"DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
Transformer Models", arXiv:2309.14509, section 3; Megatron-LM's `--cp-comm-type a2a`).

Each cp rank holds its share of the sequence for all of its tp rank's heads. Before
attention, one all-to-all per tensor turns the queries, keys and values into the whole
sequence for 1/cp of the heads; each rank attends its heads causally over the whole
sequence, and one all-to-all turns the output back. Backward runs the four exchanges in
reverse. A rank sends (cp - 1)/cp of each tensor: the bytes do not grow with cp, where the
all-gather exchange's K/V do; what it keeps for backward is 1/cp of every attention tensor,
where the all-gather keeps the whole sequence's K and V.

Grouped-query attention: where a tp rank's kv heads do not divide over cp, each kv head is
repeated r = cp / gcd(kv heads, cp) times first (the fewest that divide; r divides the
group of query heads per kv head whenever cp divides the query heads), so the exchange
carries r x the keys and values. Needs: cp divides each tp rank's query heads."""

from __future__ import annotations

from math import gcd

from planner.parallel.choice import Choice
from planner.parallel.context import LayerAttention, masked_attention_refusal
from planner.parallel.technique import (
    Collective,
    ExchangeTerms,
    PinValues,
    SequenceExchange,
    Technique,
)

NAME = "ulysses"


def refusal(model_config: dict, cp: int, tp: int) -> str | None:
    if why := masked_attention_refusal(model_config, NAME):
        return why
    heads = model_config.get("heads")
    if not heads:
        return None  # a model without attention heads in its config: checked at trace
    local = heads // tp
    if local % cp:
        return (
            f"Ulysses splits each tp rank's {local} query heads over the cp ranks: cp {cp} "
            "does not divide them"
        )
    return None


def kv_repeats(kv_heads: int, cp: int) -> int:
    """How many times a tp rank's kv heads are repeated so that cp divides them."""
    return cp // gcd(kv_heads, cp) if kv_heads else 1


def terms(layer: LayerAttention, cp: int, tp: int, kernels: str) -> ExchangeTerms:
    """Four all-to-alls forward (queries, keys, values in; the output back) and four in
    backward, each of this rank's share of the tensor (1/cp of the sequence, 1/tp of the
    heads); kept: grouped-query K/V at r x their kv heads where the traced attention keeps
    them repeated to every query head."""
    del kernels  # gloo and NCCL both run all-to-all
    r = kv_repeats(layer.kv_heads // tp, cp)
    q, out = int(layer.query / tp / cp), int(layer.output / tp / cp)
    each = int(layer.gathered * r / tp / cp / 2)  # K, then V
    collectives = (
        Collective("all_to_all", q, 1),
        Collective("all_to_all", each, 2),
        Collective("all_to_all", out, 1),
    )
    kept = int((layer.gathered * r - layer.kept) / tp / cp)
    return ExchangeTerms(collectives, collectives, kept)


EXCHANGE = SequenceExchange(
    NAME,
    "Ulysses all-to-all",
    refusal=refusal,
    terms=terms,
    shard="executor.ulysses:UlyssesShard",
    megatron="a2a",
    torchtitan=None,
)

_TEST = "tests/executor/test_ulysses.py::test_ulysses_plan_matches_the_reference"
TECHNIQUE = Technique(
    NAME,
    order=41,  # with context parallelism: the attention layers' exchange
    pins=(),
    choices=(
        Choice("mesh.cp_comm", NAME, "executor.ulysses:UlyssesShard", f"{_TEST}[dp2xcp2-ckpt]"),
    ),
    terms=("planner.parallel.ulysses:terms", "planner.parallel.ulysses:refusal"),
    extends=(
        PinValues(
            "cp_comm",
            (NAME,),
            "ulysses: all-to-all from sequence to heads and back (DeepSpeed-Ulysses; cp "
            "divides each tp rank's query heads)",
        ),
    ),
    exchange=EXCHANGE,
)
