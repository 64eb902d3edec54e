"""The global batch as a search dimension: within the user's bounds, the batch whose best
plan trains the most tokens per second on the cluster (the same GPUs for every batch, so also
the most per GPU and the shortest time to a token budget), as Galvatron searches it; and the
largest micro-batch the chosen configuration fits, as llm-analysis reports it.

`training.global_batch_size` takes a number (planned as given), `"LO-HI"` (or `[LO, HI]`) or
`"auto"` (1 to 16 samples per device). The batches tried are LO, 2 LO, 4 LO, ... up to HI,
and HI: a plan's throughput moves with the batch through the micro-batch count (bubble,
exposed communication, optimizer step per sample), which doubling covers; each is one search
on the same trace (planner.request.PlanningInputs traces micro-batches, not the batch).

What the batch does to convergence is not priced: past the critical batch size (McCandlish
et al. 2018, "An Empirical Model of Large-Batch Training") more samples per step buy less
progress per sample, so the plan says so, and the choice of range is the user's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from planner.errors import InputError
from planner.limits import MAX_GLOBAL_BATCH

FIELD = "training.global_batch_size"
_NAME = "global_batch_size"  # the TrainingSettings field each batch tried sets
AUTO_SAMPLES_PER_DEVICE = (1, 16)
MAX_BATCHES_TRIED = 16  # searches per request: bounded work whatever the range
MAX_MICROBATCH_PROBED = 1024  # samples: the largest micro-batch looked for
MAX_TEXT = 40  # characters of a range: no unbounded integer parsing
NEAR_BEST = 0.01  # the smallest batch this close to the best throughput is named beside it
EXPECTED = f'an integer 1-{MAX_GLOBAL_BATCH:,}, "LO-HI" (a range to search) or "auto"'
CONVERGENCE = (
    "The global batch was searched for throughput only: past the critical batch size "
    "(McCandlish et al. 2018) a larger batch needs more tokens to reach the same loss; check "
    "it against your model's and data's, or pin the batch."
)


@dataclass(frozen=True)
class BatchRange:
    low: int
    high: int

    def candidates(self) -> list[int]:
        """low, 2 low, 4 low, ... up to high, and high; at most MAX_BATCHES_TRIED."""
        out, b = [], self.low
        while b < self.high and len(out) < MAX_BATCHES_TRIED - 1:
            out.append(b)
            b *= 2
        return [*out, self.high]

    def text(self) -> str:
        return f"{self.low}-{self.high}"


def parse_global_batch(value: Any, devices: int) -> int | BatchRange:
    """The request's global batch: a number, or the range to search ("auto": 1 to 16 samples
    per device). Errors name the field and what it takes."""
    if isinstance(value, bool) or (isinstance(value, str) and len(value) > MAX_TEXT):
        raise InputError(FIELD, repr(value)[:80], EXPECTED)
    if isinstance(value, int):
        return _count(value, value)
    if isinstance(value, str) and value.strip().isdigit():
        return _count(int(value), value)
    if isinstance(value, str) and value.strip().lower() == "auto":
        low, high = (n * devices for n in AUTO_SAMPLES_PER_DEVICE)
        return BatchRange(min(low, MAX_GLOBAL_BATCH), min(high, MAX_GLOBAL_BATCH))
    bounds = None
    if isinstance(value, str):
        found = re.fullmatch(r"\s*(\d+)\s*[-:]\s*(\d+)\s*", value)
        bounds = (int(found[1]), int(found[2])) if found else None
    elif (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        bounds = (value[0], value[1])
    if bounds is None:
        raise InputError(FIELD, repr(value)[:80], EXPECTED)
    low, high = (_count(b, value) for b in bounds)
    if low > high:
        raise InputError(FIELD, f"{low}-{high}", "a range LO-HI with LO <= HI")
    return low if low == high else BatchRange(low, high)


def _count(n: int, shown: Any) -> int:
    if not 1 <= n <= MAX_GLOBAL_BATCH:
        raise InputError(FIELD, repr(shown)[:80], EXPECTED)
    return n


@dataclass(frozen=True)
class BatchChoice:
    batch: int
    tokens_per_s: float | None  # None: nothing fits at this batch


def search_batches(inputs, options, batches: BatchRange, progress) -> tuple[Any, list]:
    """The best plan over the range's batches (planner.search.search.search per batch) and
    what each gave. Raises NoFeasiblePlan (the last batch's reasons) when none fits."""
    from planner.search.search import NoFeasiblePlan, search

    best, tried, failure = None, [], None
    for batch in batches.candidates():
        at = replace(inputs, training=inputs.training.model_copy(update={_NAME: batch}))
        try:
            plan = search(at, options, progress=progress).plan
        except NoFeasiblePlan as err:
            tried.append(BatchChoice(batch, None))
            failure = err
            continue
        p = plan.predicted
        tried.append(BatchChoice(batch, p.tokens_per_s))
        if best is None or p.tokens_per_s > best.predicted.tokens_per_s:
            best = plan
    if best is None:
        raise failure
    return best, tried


def largest_microbatch(inputs, options, plan) -> int | None:
    """The largest micro-batch (a power of two times the plan's) that the plan's
    configuration fits with its micro-batch count, every stage: each probe a search pinned
    to the plan's degrees, ZeRO level, schedule, checkpointing and fp8 at that micro-batch.
    None for stages on submeshes of their own (no one mesh to pin)."""
    from planner.search.search import NoFeasiblePlan, search

    if plan.mesh.stage_meshes is not None:
        return None
    dims, stage = plan.mesh.dims, plan.stages[0]
    pinned = replace(
        options,
        mesh=dims.grid,
        cp=dims.cp,
        cp_comm=dims.cp_comm,
        dp_shard=dims.dp_shard,
        ep=dims.ep,
        zero_stages=(stage.zero,),
        schedules=(plan.schedule.name,),
        virtual_stages=(plan.schedule.virtual_stages,),
        checkpointing=_checkpointing(stage),
        fp8=(plan.fp8,),
        top_k=1,
    )
    m = plan.schedule.microbatches
    fits = plan.request.training.global_batch_size // (dims.dp * m)
    while fits * 2 <= MAX_MICROBATCH_PROBED and fits * 2 * m * dims.dp <= MAX_GLOBAL_BATCH:
        trial = fits * 2
        update = {_NAME: trial * m * dims.dp}
        at = replace(inputs, training=inputs.training.model_copy(update=update))
        try:
            search(at, replace(pinned, microbatch_sizes=(trial,)))
        except NoFeasiblePlan:
            break
        fits = trial
    return fits


def _checkpointing(stage) -> tuple:
    """The search's checkpointing values for the stage's own (partial: how many layers may
    change with the micro-batch)."""
    from planner.parallel.checkpointing import PARTIAL

    if not stage.activation_checkpointing:
        return (False,)
    if stage.checkpoint_policy != "full":
        return (stage.checkpoint_policy,)
    return (True,) if stage.checkpointed_layers is None else (PARTIAL,)


def batch_lines(tried: list[BatchChoice], chosen: int, devices: int, largest: int | None):
    """The plan's explanation of the batch search."""
    parts = [
        f"{c.batch}: {c.tokens_per_s / devices:,.0f}" if c.tokens_per_s else f"{c.batch}: no fit"
        for c in tried
    ]
    lines = [
        f"Global batch {chosen}, searched for tokens/s per GPU over "
        + ", ".join(parts)
        + " (batch: tokens/s per GPU).",
        CONVERGENCE,
    ]
    best = max(c.tokens_per_s or 0.0 for c in tried)
    near = next(c for c in tried if (c.tokens_per_s or 0.0) >= (1 - NEAR_BEST) * best)
    if near.batch < chosen:
        lines.append(
            f"Batch {near.batch} is within {NEAR_BEST:.0%} of that throughput "
            f"({near.tokens_per_s / devices:,.0f} tokens/s per GPU): below the critical batch "
            "size a smaller batch needs fewer tokens for the same loss."
        )
    if largest is not None:
        noun = "sample" if largest == 1 else "samples"
        lines.append(
            f"The largest micro-batch this configuration fits is {largest} {noun} "
            "(powers of two from the plan's, its micro-batch count kept)."
        )
    return lines


def refuse_range(batches: BatchRange | None, command: str) -> None:
    """`command` takes one global batch: a range is searched by planning alone."""
    if batches is not None:
        raise InputError(FIELD, f"a range ({batches.text()})", f"one global batch for {command}")
