"""Pipeline parallelism on the pp axis: schedules, chunks and point-to-point sends.

Time: planner.cost.schedules (GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble: step
time, bubble, in-flight micro-batches) and planner.cost.schedule_v (ZB-V, its order
replayed). Sends carry 1/tp of the boundary activation forward and its gradient back
(Megatron's scatter/gather optimisation), not overlapped with compute.
Search: pp divides the devices and is at most the layer count; 1F1B, interleaved 1F1B (2 to 8
chunks per device, as many as leave every chunk a layer), the interleaved zero-bubble
schedule (1 to 8 chunks: less bubble than either, but every stage holds as many micro-batches
as the first, and no ZeRO-3) and ZB-V (two chunks per device in a V: the first device holds
the embedding and the head, the turn needs no send, no ZeRO-3; its bubble depends on how the
forward, input-gradient and weight-gradient times compare, so it wins or loses against the
interleaved zero-bubble schedule case by case) and DualPipeV (torch's ScheduleDualPipeV, in
the same V, at least 2 pp micro-batches; torch 2.13 runs each of its paired forward and
backward one after the other, as our executor registers no callback overlapping them, and
that order is what is timed: it holds one more chunk's activations than ZB-V, and is faster
or slower than ZB-V by a fraction of a percent as the forward, input- and weight-gradient
times compare); Looped BFS (torch's ScheduleLoopedBFS, chunks in a loop, every forward of a
chunk before the next) runs when pinned but is not searched: its replayed step time equals
interleaved 1F1B's at the same chunk count with identical chunks and is longer with the
embedding's and the head's (tests/planner/test_zbv.py), while every device holds all m
micro-batches, as GPipe does; GPipe takes 1F1B's time with more
activation memory, so the search picks it only where torch's 1F1B cannot run (fewer
micro-batches than stages, where both run the same order); a user may pin it. Plan fields:
mesh.shape[0], schedule, schedule.virtual_stages, stages[].layers, stages[].ranks.
"""

from __future__ import annotations

from planner.cost.model import CostModel
from planner.cost.schedule_v import DUALPIPE_V, V_SHAPED, ZBV, device_of_chunk, replayed
from planner.cost.schedules import MULTI_CHUNK, WEIGHT_SPLIT
from planner.limits import MAX_LAYERS, MAX_REPLAYED_ACTIONS
from planner.parallel.choice import Choice
from planner.parallel.technique import Pin, Technique
from planner.vocab import SCHEDULES, STAGE_MESHES

_EXEC = "executor.pipeline:build_schedule"
_TEST = "tests/executor/test_execute.py::test_plan_matches_single_process_reference"
_CASES = {
    "gpipe": "pp2xdp2-gpipe-zero3",
    "1f1b": "pp2xtp2-1f1b",
    "interleaved_1f1b": "pp2xdp2-interleaved-zero2",
    "interleaved_zero_bubble": "pp2xdp2-zero-bubble-v2",
    ZBV: "pp2xdp2-zbv",
    DUALPIPE_V: "pp2xdp2-dualpipe-v",
    "looped_bfs": "pp2xdp2-looped-bfs-zero3",
}
CHOICES = tuple(Choice("schedule.name", s, _EXEC, f"{_TEST}[{_CASES[s]}]") for s in SCHEDULES)
# The zero-bubble schedule before interleaved 1F1B: where it fits with some chunk count, ZeRO
# level and checkpointing, interleaved 1F1B with the same is not evaluated (never faster).
SEARCHED_SCHEDULES = ("1f1b", "interleaved_zero_bubble", ZBV, DUALPIPE_V, "interleaved_1f1b")
# ZB-V and DualPipeV are searched with at most 8 pp micro-batches beside other schedules: the
# step time is a replay of their order (~6 pp m actions: 10-40 ms a configuration at pp 16
# and m 512-1,024 took gpt-39b's search from 1.3 to 2.5 s), and beyond 8 rounds the
# interleaved zero-bubble schedule's fill and drain, all they can save, is under 1/8 of the
# step.
V_MAX_ROUNDS = 8
# Interleaved 1F1B is searched with 2 to 8 chunks per device: the bubble shrinks as 1/v while
# the sends grow with v, and beyond 8 the models here keep one or two layers per chunk; a
# user may pin any count the layers allow (--virtual-stages).
MAX_VIRTUAL_STAGES = 8
_V_TEST = f"{_TEST}[pp2xdp2-interleaved-v3]"
CHOICES += (
    Choice("schedule.virtual_stages", 1, _EXEC, f"{_TEST}[{_CASES['1f1b']}]"),
    Choice("schedule.virtual_stages", 2, _EXEC, f"{_TEST}[{_CASES['interleaved_1f1b']}]"),
    Choice("schedule.virtual_stages", "3 or more", _EXEC, _V_TEST),
)


def zero_refusal(schedule: str, zero: int) -> str | None:
    """Why the executor cannot run `schedule` with this ZeRO level, or None. Under torch's
    split backward (input gradients, then weight gradients later) FSDP2 with parameters
    resharded after forward, ZeRO-3, loses ranks mid-step (torch 2.13, gloo), so the search
    does not offer the pair and a plan pinning both is refused."""
    if schedule in WEIGHT_SPLIT and zero == 3:
        return f"{schedule} does not run with ZeRO-3 (FSDP2 resharding under a split backward)"
    return None


def zero_stages_for(schedule: str, zero_stages: tuple[int, ...]) -> tuple[int, ...]:
    """The ZeRO levels of `zero_stages` the executor runs with `schedule`."""
    return tuple(z for z in zero_stages if zero_refusal(schedule, z) is None)


# The interleaved schedules run micro-batches in rounds of pp (ZB-V takes any count).
INTERLEAVED_ROUNDS = ("interleaved_1f1b", "interleaved_zero_bubble")


def replay_refusal(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> str | None:
    """Why a schedule timed by replaying its order is not timed at this size, or None."""
    actions = 3 * pp * virtual_stages * microbatches
    if replayed(schedule, pp, microbatches) and actions > MAX_REPLAYED_ACTIONS:
        return (
            f"{schedule}'s step time replays its order: {actions:,} actions with "
            f"{microbatches} micro-batches, over the {MAX_REPLAYED_ACTIONS:,} allowed"
        )
    return None


def not_runnable(schedule: str, pp: int, microbatches: int) -> str | None:
    """Why torch.distributed.pipelining's class for `schedule` refuses this many micro-batches
    on pp stages, or None when it runs them (torch 2.13's constructors check these)."""
    if pp == 1:
        return None
    if schedule == "1f1b" and microbatches < pp:
        return (
            f"1f1b needs at least as many micro-batches as stages ({microbatches} < pp = {pp}); "
            "gpipe runs the same order"
        )
    if schedule == DUALPIPE_V and microbatches < 2 * pp:
        return f"{schedule} needs at least 2 pp = {2 * pp} micro-batches ({microbatches})"
    if schedule in V_SHAPED and (why := replay_refusal(schedule, pp, 2, microbatches)):
        return why
    rounds = max(1, microbatches // pp)
    if schedule in INTERLEAVED_ROUNDS and microbatches % rounds:
        return (
            f"{schedule} needs micro-batches in whole rounds of pp = {pp} "
            f"({microbatches} is not a multiple of {rounds})"
        )
    return None


def refusals(schedules: tuple[str, ...], pp: int, microbatches: int) -> set[str]:
    """Why torch refuses each of `schedules` with this many micro-batches on pp stages."""
    found = (not_runnable(s, pp, microbatches) for s in schedules)
    return {why for why in found if why}


def searched_schedules(schedules: tuple[str, ...], pp: int, microbatches: int) -> list[str]:
    """The schedules to evaluate for (pp, micro-batches): those that run; with fewer
    micro-batches than stages 1F1B's order is GPipe's, so the search takes gpipe instead;
    the V-shaped ones only up to V_MAX_ROUNDS rounds unless only they are asked for."""
    out = [s for s in schedules if not_runnable(s, pp, microbatches) is None]
    if "1f1b" in schedules and "1f1b" not in out and "gpipe" not in out:
        out.insert(0, "gpipe")
    if any(s not in V_SHAPED for s in out) and microbatches > V_MAX_ROUNDS * pp:
        out = [s for s in out if s not in V_SHAPED]
    return out


def virtual_stage_counts(
    schedule: str,
    pp: int,
    num_layers: int,
    pinned: tuple[int, ...] | None = None,
    microbatches: int = 1,
) -> list[int]:
    """Model chunks per device the search tries for `schedule` on pp stages: one for the
    single-chunk schedules; for interleaved 1F1B every count from 2 (the zero-bubble schedule:
    from 1) to MAX_VIRTUAL_STAGES that leaves each chunk at least one layer (or the pinned
    counts that do)."""
    if schedule not in MULTI_CHUNK:
        return [1] if pinned is None or 1 in pinned else []
    if pp == 1:
        return []
    if schedule in V_SHAPED:  # two chunks per device, in a V
        return [2] if (pinned is None or 2 in pinned) and 2 * pp <= num_layers else []
    least = 2 if schedule == "interleaved_1f1b" else 1
    counts = pinned if pinned is not None else range(least, MAX_VIRTUAL_STAGES + 1)
    fits = [v for v in counts if v >= least and pp * v <= num_layers]
    return [v for v in fits if replay_refusal(schedule, pp, v, microbatches) is None]


def kept_outputs(
    layer_inputs: list[int], ranges: list[tuple[int, int]], schedule: str, pp: int
) -> list[int]:
    """Per chunk, the bytes of its output a device keeps for each micro-batch in flight:
    torch's pipelining holds a stage's output until that micro-batch's backward (Megatron
    frees the output's data once sent; torch does not). The last chunk's output is the loss;
    a V schedule hands the output of its turn to the next chunk on the same device, where it
    is that chunk's input."""
    out = [0] * len(ranges)
    for c in range(len(ranges) - 1):
        if device_of_chunk(schedule, c, pp) != device_of_chunk(schedule, c + 1, pp):
            out[c] = layer_inputs[ranges[c][1]]
    return out


def p2p_times(
    cm: CostModel,
    cut_bytes: list[int],
    ranges: list[tuple[int, int]],
    first_ranks: list[int],
    tp: int,
    schedule: str = "1f1b",
) -> list[float]:
    """Per chunk: the send of its output activation forward and, on the next chunk, of the
    gradient back (none between chunks on one device: ZB-V's turn). `first_ranks[s]` is a
    rank of pipeline stage s (the link it uses)."""
    p = len(first_ranks)
    out = [0.0] * len(ranges)
    for c in range(len(ranges) - 1):
        here, there = device_of_chunk(schedule, c, p), device_of_chunk(schedule, c + 1, p)
        if here == there:
            continue
        src, dst = first_ranks[here], first_ranks[there]
        cost = cm.send_recv(cut_bytes[ranges[c][1]] / tp, cm.p2p_axis(src, dst))
        out[c] += cost  # forward send
        out[c + 1] += cost  # backward send of the gradient
    return out


PINS: tuple[Pin, ...] = (
    Pin("schedule", "choice", "the pipeline schedule", choices=SCHEDULES),
    Pin(
        "stage_meshes",
        "choice",
        "uniform: every pipeline stage on one (dp, tp) mesh; per_stage: each stage on its "
        "own submesh with its own (dp, tp) (Alpa's inter-operator pass; the executor runs "
        "such plans with Megatron's layouts, no sequence parallelism and no embeddings "
        "tied across stages); default: both where plans the executor cannot run are "
        "allowed, else uniform",
        choices=STAGE_MESHES,
    ),
    Pin(
        "virtual_stages",
        "count",
        "model chunks per device (2 or more: interleaved 1F1B or zero bubble)",
        low=1,
        high=MAX_LAYERS,
    ),
)


TECHNIQUE = Technique(
    "pipeline",
    order=80,
    pins=PINS,
    choices=CHOICES,
    terms=(
        "planner.parallel.pipeline:p2p_times",
        "planner.parallel.pipeline:kept_outputs",
    ),
)
