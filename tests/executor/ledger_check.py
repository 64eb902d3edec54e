"""The ledger check every executor test runs: what each rank measured in its last step
(executor.ledger) against what the plan predicts for it (each plan stage's
`predicted.ledger`, summed over the stages the rank holds). Written apart from both sides: it
only adds up the plan's entries and compares."""

from __future__ import annotations

from collections import Counter

# Where a case's run does not yet match the plan's ledger: why, the mesh axes whose entries
# are not compared, and whether the bytes held are. Everything else must match exactly:
# collective calls and bytes per kind and mesh axis, and the bytes of parameters, gradients
# and optimizer state each rank holds.
LEDGER_GAPS: dict[str, tuple[str, frozenset[str], bool]] = {}


def predicted_for_rank(plan, rank: int) -> tuple[dict, dict]:
    calls: Counter = Counter()
    nbytes: Counter = Counter()
    held: Counter = Counter()
    for stage in plan.stages:
        if rank not in stage.ranks:
            continue
        ledger = stage.predicted.ledger
        assert ledger is not None, f"stage {stage.index} carries no ledger"
        for e in ledger.comm:
            calls[(e.kind, e.axis)] += e.calls
            nbytes[(e.kind, e.axis)] += e.bytes
        held_here = ledger.held[stage.ranks.index(rank) if len(ledger.held) > 1 else 0]
        for field, value in held_here.model_dump().items():
            held[field] += value
    comm = {k: (calls[k], nbytes[k]) for k in calls if calls[k]}
    return comm, dict(held)


def measured(result: dict) -> tuple[dict, dict]:
    ledger = result["steps"][-1]["ledger"]
    comm = {(e["kind"], e["axis"]): (e["calls"], e["bytes"]) for e in ledger["comm"]}
    return comm, ledger["held"]


# The activation peak (executor.ledger.LiveBytes: the most bytes the step's own tensors hold
# at once, gradients and dp's buffers left out) against the plan's activation memory for the
# rank's device. Not exact: the plan counts what is saved for backward (and rebuilt under
# checkpointing), the run also holds the tensors between ops (a layer's output gradients, a
# pending tied-weight gradient), and tiny test models make those a large share.
ACTIVATION_TOLERANCE = 0.15


def predicted_activations(plan, rank: int) -> int:
    """The plan's activation bytes on this rank's device (every chunk of an interleaved
    schedule repeats its device's memory)."""
    return next(st.predicted.memory.activations for st in plan.stages if rank in st.ranks)


def activation_errors(plan, ranks: list[dict]) -> dict[int, float]:
    """rank -> measured / predicted activation peak - 1."""
    out = {}
    for result in ranks:
        got = result["steps"][-1]["ledger"]["activation_peak"]
        out[result["rank"]] = got / max(predicted_activations(plan, result["rank"]), 1) - 1
    return out


def check_activations(plan, ranks: list[dict], gap: str | None = None) -> None:
    """Each rank's activation peak within ACTIVATION_TOLERANCE of the plan's, unless a gap
    says why not (and a listed case must still be outside it)."""
    errors = activation_errors(plan, ranks)
    worst = max(errors.values(), key=abs)
    if gap is None:
        assert abs(worst) <= ACTIVATION_TOLERANCE, ("activation peak", errors)
    else:
        assert abs(worst) > ACTIVATION_TOLERANCE, "the activation peak matches: drop its gap"


# The gradient peak (executor.ledger.LiveBytes.gradient_peak: the most bytes of gradients a
# rank holds at once in the step) against the plan's gradient memory for the rank's device:
# where gradients accumulate whole (DDP, ZeRO-1, FSDP2 under a pipeline schedule or over
# several micro-batches at ZeRO-2) the plan counts them whole, in fp32; the run also holds one
# parameter's new gradient before it is added to the accumulated one (a tied or embedding
# weight's is a large share of a tiny model).
GRADIENT_TOLERANCE = (-0.15, 0.45)


def gradient_errors(plan, ranks: list[dict]) -> dict[int, float]:
    """rank -> measured / predicted gradient peak - 1."""
    out = {}
    for result in ranks:
        got = result["steps"][-1]["ledger"]["gradient_peak"]
        rank = result["rank"]
        predicted = next(st.predicted.memory.grads for st in plan.stages if rank in st.ranks)
        out[rank] = got / max(predicted, 1) - 1
    return out


def check_gradients(plan, ranks: list[dict], gap: str | None = None) -> None:
    """Each rank's gradient peak within GRADIENT_TOLERANCE of the plan's, unless a gap says
    why not (and a listed case must still be outside it)."""
    errors = gradient_errors(plan, ranks)
    low, high = GRADIENT_TOLERANCE
    inside = all(low <= e <= high for e in errors.values())
    if gap is None:
        assert inside, ("gradient peak", errors)
    else:
        assert not inside, ("the gradient peak matches: drop its gap", errors)


def routed_keys(plan) -> set[tuple[str, str]]:
    """(kind, axis) of the entries whose bytes the router shares out within the group (the
    plan's `routed` entries): compared per group, their calls per rank."""
    return {(e.kind, e.axis) for st in plan.stages for e in st.predicted.ledger.comm if e.routed}


def ep_groups(plan) -> list[list[int]]:
    """The ranks of each expert-parallel group: ep neighbouring dp indices of one pipeline
    stage and tp index (plan.mesh.ranks is [pp][dp][tp]); with expert tp 1, ep neighbouring
    ranks of the stage's dp x tp, tp innermost."""
    ep = plan.mesh.ep or 1
    groups = []
    for grid in plan.mesh.ranks:
        if plan.mesh.etp == 1:
            flat = [rank for row in grid for rank in row]
            groups += [flat[start : start + ep] for start in range(0, len(flat), ep)]
            continue
        for start in range(0, len(grid), ep):
            for t in range(len(grid[0])):
                groups.append([grid[d][t] for d in range(start, start + ep)])
    return groups


def check_ledger(plan, ranks: list[dict], gap: tuple | None = None) -> None:
    """Every rank's measured ledger equals its prediction, but for what a gap leaves out
    (and a listed case must still differ there: a gap that closes is taken off the list).
    Routed entries (expert parallelism's dropless exchange): each rank's calls, and the
    bytes summed over each ep group."""
    _, skipped, held_compared = gap or ("", frozenset(), True)
    routed = routed_keys(plan)
    differs = False
    group_bytes: dict[int, tuple[int, int]] = {}  # rank -> (measured, predicted) routed bytes
    for result in ranks:
        comm, held = measured(result)
        want_comm, want_held = predicted_for_rank(plan, result["rank"])
        group_bytes[result["rank"]] = (
            sum(comm.get(k, (0, 0))[1] for k in routed),
            sum(want_comm.get(k, (0, 0))[1] for k in routed),
        )
        comm = {k: (v[0], None) if k in routed else v for k, v in comm.items()}
        want_comm = {k: (v[0], None) if k in routed else v for k, v in want_comm.items()}
        differs |= comm != want_comm or held != want_held
        comm = {k: v for k, v in comm.items() if k[1] not in skipped}
        want_comm = {k: v for k, v in want_comm.items() if k[1] not in skipped}
        assert comm == want_comm, (result["rank"], "comm", comm, want_comm)
        if held_compared:
            assert held == want_held, (result["rank"], "held", held, want_held)
    if routed:
        for group in ep_groups(plan):
            got = sum(group_bytes[r][0] for r in group)
            want = sum(group_bytes[r][1] for r in group)
            assert got == want, ("routed bytes of ep group", group, got, want)
    assert differs or gap is None, "the ledger matches: take it off LEDGER_GAPS"
