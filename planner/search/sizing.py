"""How long, how much, how many GPUs: a training run's time and cost at a plan's
throughput, and the sweep over cluster sizes behind `autopar size` and POST /v1/sizings.

The arithmetic is the one a person does by hand: time = tokens / predicted tokens per second,
GPU-hours = GPUs x time, cost = GPU-hours x price. The sweep traces the model once and plans
it on each node count; layouts and cost tables are keyed without the node count
(planner.search.layout_cache), so every size after the first reads them from the disk cache.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, Field

from planner.errors import InputError
from planner.limits import MAX_NODES
from planner.plan import Plan, TrainingRun
from planner.units import human_count

MAX_TRAIN_TOKENS = 1e16  # ten quadrillion: 600x Llama 3's 15.6T
MAX_DEADLINE_S = 100 * 365 * 86400
MAX_SIZES = 16  # node counts one sweep plans
MAX_PRICE = 1e6  # per GPU-hour
# The share of a run's wall-clock spent on training steps that count: the rest goes to failures
# and restarts (work since the last checkpoint redone), checkpoint saves and evaluation. Meta
# reports "higher than 90% effective training time" over a 54-day snapshot of Llama 3 405B's
# pre-training on 16K H100 with 466 job interruptions (Dubey et al. 2024, "The Llama 3 Herd of
# Models", section 3.3.4); ByteDance's MegaScale reports an effective training time ratio
# above 90% on 10K+ GPUs (Jiang et al., NSDI 2024, section 6). 0.9 takes them at their word.
DEFAULT_GOODPUT = 0.9
GOODPUT_HELP = (
    "share of the run's wall-clock spent on steps that count, after failures and restarts, "
    "checkpoints and evaluation (default 0.9: Meta reports over 90% for Llama 3's training)"
)
_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# The forms a token count and a duration take, as the API's schema states them (JSON Schema's
# regex and Python's read these alike: no flags, ASCII classes). The parsers strip the spaces
# and match the rest whole: one optional run of spaces between the number and its unit, so a
# match is linear in the text (two adjacent `\s*` around an optional unit backtracked
# quadratically: a 40 KB value once held a server for 34 s).
SPACES = " \t\r\n"
TOKENS_PATTERN = r"^[ \t\r\n]*[0-9]+(\.[0-9]+)?([eE][0-9]+)? *[kKmMbBgGtTpP]?[ \t\r\n]*$"
DURATION_PATTERN = r"^[ \t\r\n]*[0-9]+(\.[0-9]+)? *[sSmMhHdDwW]?[ \t\r\n]*$"
_COUNT = re.compile(r"([0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?) *([kKmMbBgGtTpP]?)")
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?) *([sSmMhHdDwW]?)")
MAX_QUANTITY_CHARS = 64  # "15T", "1.5e12", "30d": nothing a person writes is longer


def _scaled(value: float | str, field: str, pattern, units: dict, what: str, example: str):
    """A number, or a string of a number and a unit suffix from `units` (its multiplier)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and len(value) > MAX_QUANTITY_CHARS:
        raise InputError(field, f"{len(value)} characters", f"at most {MAX_QUANTITY_CHARS}")
    match = pattern.fullmatch(value.strip(SPACES)) if isinstance(value, str) else None
    if match:
        return float(match.group(1)) * units[match.group(2).lower()]
    raise InputError(field, f"{value!r} is not {what}", example)


def parse_tokens(value: float | str, field: str) -> float:
    """A token count as people write it: 15T, 1.5e12, 300B, 2000000."""
    tokens = _scaled(value, field, _COUNT, _SUFFIX, "a token count", 'a number like "15T"')
    if not 1 <= tokens <= MAX_TRAIN_TOKENS:
        raise InputError(field, f"{value!r}", f"between 1 and {MAX_TRAIN_TOKENS:.0e} tokens")
    return tokens


def parse_duration(value: float | str, field: str) -> float:
    """A deadline in seconds from "30d", "12h", "2w" or a number of seconds."""
    seconds = _scaled(value, field, _DURATION, _SECONDS, "a duration", 'seconds, or "30d"')
    if not 0 < seconds <= MAX_DEADLINE_S:
        raise InputError(field, f"{value!r}", "a positive duration of at most 100 years")
    return seconds


@dataclass(frozen=True)
class RunAsked:
    """The whole training run to price at a plan's throughput (the plan's `run`)."""

    train_tokens: float
    gpu_hour_price: float | None = None
    goodput: float = DEFAULT_GOODPUT


def read_run(
    train_tokens: float | str | None,
    price: float | None,
    prefix: str,
    fields: tuple[str, str, str] | None = None,
    goodput: float | None = None,
) -> RunAsked | None:
    """A request's run fields, checked (None: no run asked); errors name
    `prefix`.train_tokens, `prefix`.gpu_hour_price and `prefix`.goodput, or `fields` (the
    CLI's flags)."""
    tokens_field, price_field, goodput_field = fields or (
        f"{prefix}.train_tokens",
        f"{prefix}.gpu_hour_price",
        f"{prefix}.goodput",
    )
    if price is not None and not 0 <= price <= MAX_PRICE:  # also refuses NaN
        raise InputError(price_field, f"{price}", f"between 0 and {MAX_PRICE:g}")
    if goodput is not None and not 0 < goodput <= 1:
        raise InputError(goodput_field, f"{goodput}", "a share above 0 and at most 1, e.g. 0.9")
    if train_tokens is None:
        for field, value in ((price_field, price), (goodput_field, goodput)):
            if value is not None:
                raise InputError(field, f"given without {tokens_field}", "both")
        return None
    tokens = parse_tokens(train_tokens, tokens_field)
    return RunAsked(tokens, price, DEFAULT_GOODPUT if goodput is None else goodput)


def training_run(
    plan: Plan,
    train_tokens: float,
    price: float | None = None,
    goodput: float = DEFAULT_GOODPUT,
) -> TrainingRun:
    """The whole run at the plan's predicted throughput, `goodput` of its wall-clock spent
    on steps that count."""
    pred, training = plan.predicted, plan.request.training
    gpus = plan.request.cluster.nodes * plan.request.cluster.devices_per_node
    steps_s = train_tokens / pred.tokens_per_s
    time_s = steps_s / goodput
    per_step = training.global_batch_size * training.seq_len
    hours = gpus * time_s / 3600
    return TrainingRun(
        train_tokens=train_tokens,
        steps=max(1, math.ceil(train_tokens / per_step)),
        steps_time_s=steps_s,
        goodput=goodput,
        time_s=time_s,
        gpu_hours=hours,
        gpu_hour_price=price,
        cost=None if price is None else hours * price,
    )


class SizeRow(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: int
    gpus: int
    fits: bool
    summary: str = Field("", description="the plan's mesh and schedule, or why none fits")
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    run: TrainingRun | None = None


class Sizing(BaseModel):
    """A sweep's answer: per node count the best plan's throughput, time and cost; the
    cheapest size that meets the deadline and the fastest within the budget."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    cluster: str
    device: str
    train_tokens: float
    gpu_hour_price: float | None = None
    deadline_s: float | None = None
    budget: float | None = None
    rows: list[SizeRow]
    cheapest_within_deadline: int | None = Field(None, description="nodes")
    fastest_within_budget: int | None = Field(None, description="nodes")
    explanation: list[str] = Field(default_factory=list)


def node_counts(low: int, high: int, field: str = "nodes") -> list[int]:
    """Doubling node counts from `low` to `high` (both included)."""
    if not 1 <= low <= high <= MAX_NODES:
        raise InputError(field, f"{low} to {high}", f"1 <= min <= max <= {MAX_NODES:,} nodes")
    counts = [low]
    while counts[-1] * 2 <= high:
        counts.append(counts[-1] * 2)
    if counts[-1] != high:
        counts.append(high)
    if len(counts) > MAX_SIZES:
        raise InputError(field, f"{len(counts)} sizes", f"at most {MAX_SIZES} node counts")
    return counts


def size(
    inputs,
    counts: list[int],
    train_tokens: float,
    plan_one: Callable,
    price: float | None = None,
    deadline_s: float | None = None,
    budget: float | None = None,
    say: Callable[[str, int, int], None] = lambda *_: None,
    goodput: float = DEFAULT_GOODPUT,
) -> Sizing:
    """Plan `inputs` (planner.request.PlanningInputs, traced once) on each node count with
    `plan_one(inputs) -> Plan` (the search; raises NoFeasiblePlan) and price the run."""
    from planner.search.search import NoFeasiblePlan

    rows = []
    for i, nodes in enumerate(counts):
        say(f"planning on {nodes} nodes", i, len(counts))
        cluster = inputs.cluster.with_nodes(nodes, field="nodes")
        try:
            plan = plan_one(replace(inputs, cluster=cluster))
        except NoFeasiblePlan as err:
            why = err.explanation[0] if err.explanation else "nothing fits"
            rows.append(SizeRow(nodes=nodes, gpus=cluster.num_devices, fits=False, summary=why))
            continue
        pred = plan.predicted
        rows.append(
            SizeRow(
                nodes=nodes,
                gpus=cluster.num_devices,
                fits=True,
                summary=plan_line(plan),
                step_time_s=pred.step_time_s,
                tokens_per_s=pred.tokens_per_s,
                mfu=pred.mfu,
                run=training_run(plan, train_tokens, price, goodput),
            )
        )
    say("done", len(counts), len(counts))
    return _choose(inputs, rows, train_tokens, price, deadline_s, budget, goodput)


def plan_line(plan: Plan) -> str:
    zero = max(st.zero for st in plan.stages)
    return f"{plan.mesh.summary()}, {plan.schedule.name}, zero{zero}"


def _choose(inputs, rows, train_tokens, price, deadline_s, budget, goodput) -> Sizing:
    fit = [r for r in rows if r.fits and r.run is not None]
    lines = []
    cheapest = fastest = None
    if deadline_s is not None:
        meets = [r for r in fit if r.run.time_s <= deadline_s]
        key = (lambda r: (r.run.cost, r.run.time_s)) if price is not None else None
        best = min(meets, key=key or (lambda r: (r.run.gpu_hours, r.run.time_s)), default=None)
        cheapest = best.nodes if best else None
        lines.append(
            f"Cheapest size within the deadline: {best.nodes} nodes ({_days(best.run.time_s)})."
            if best
            else "No size meets the deadline; the fastest is "
            + (f"{min(fit, key=lambda r: r.run.time_s).nodes} nodes." if fit else "none.")
        )
    if budget is not None and price is not None:
        within = [r for r in fit if r.run.cost <= budget]
        best = min(within, key=lambda r: r.run.time_s, default=None)
        fastest = best.nodes if best else None
        lines.append(
            f"Fastest size within the budget: {best.nodes} nodes ({_days(best.run.time_s)}, "
            f"{best.run.cost:,.0f})."
            if best
            else "No size stays within the budget."
        )
    lines.append(
        f"{human_count(train_tokens)} tokens; time = tokens / predicted tokens per second / "
        f"goodput {goodput:.0%} (the share of wall-clock on steps that count, after failures "
        "and restarts, checkpoints and evaluation; Meta reports over 90% for Llama 3; "
        "--goodput to change), GPU-hours = GPUs x time"
        + (", cost = GPU-hours x price." if price is not None else ".")
    )
    return Sizing(
        model=inputs.model.name,
        cluster=inputs.cluster.name,
        device=inputs.cluster.device.name,
        train_tokens=train_tokens,
        gpu_hour_price=price,
        deadline_s=deadline_s,
        budget=budget,
        rows=rows,
        cheapest_within_deadline=cheapest,
        fastest_within_budget=fastest,
        explanation=lines,
    )


def _days(seconds: float) -> str:
    return f"{seconds / 86400:.1f} days" if seconds >= 86400 else f"{seconds / 3600:.1f} hours"
