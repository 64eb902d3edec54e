"""The plan viewer's Gantt chart: per pipeline stage (a device group) one compute lane and,
below it, one communication lane: the pipeline sends that end each forward (activations to
the next chunk) and each backward (gradients to the previous one), then the data-parallel
gradient sync and the optimizer step that end the step. Durations come from the plan's
predicted figures; the order from the schedule's list scheduler (api/gantt.py)."""

from __future__ import annotations

from api.gantt import timeline
from planner.cost.schedule_v import chunks_of_device, device_of_chunk
from planner.plan import Plan

PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"]
COMM = {"send": "#6b7280", "dp sync": "#1d2330", "optimizer": "#9ca3af"}
MAX_GANTT_MICROBATCHES = 32
WIDTH, ROW_H, LEFT = 1200, 24, 118


def color(stage: int) -> str:
    return PALETTE[stage % len(PALETTE)]


def chunk_label(plan: Plan, chunk: int) -> str:
    """How every part of the page names a pipeline chunk: "stage 1" without interleaving,
    "stage 1 · chunk 5" with it (chunk = the plan's stages[].index)."""
    pp = plan.mesh.shape[0]
    stage = device_of_chunk(plan.schedule.name, chunk, pp)
    if len(plan.stages) == pp:
        return f"stage {stage}"
    return f"stage {stage} · chunk {chunk}"


def chunks_of_stage(plan: Plan, stage: int) -> list[int]:
    pp = plan.mesh.shape[0]
    return [
        st.index for st in plan.stages if device_of_chunk(plan.schedule.name, st.index, pp) == stage
    ]


def gantt(plan: Plan) -> dict | None:
    pp = plan.mesh.shape[0]
    per_device, p2p = [0.0] * pp, [0.0] * len(plan.stages)
    for st in plan.stages:  # interleaved plans list each chunk; a device runs several
        device = device_of_chunk(plan.schedule.name, st.index, pp)
        per_device[device] += st.predicted.compute_s + st.predicted.comm_s
        p2p[st.index] = st.predicted.p2p_s
    m = plan.schedule.microbatches
    shown = min(m, MAX_GANTT_MICROBATCHES)
    blocks = timeline(plan.schedule.name, per_device, shown, plan.schedule.virtual_stages)
    if not blocks:
        return None
    v = max(plan.schedule.virtual_stages, 1)
    own = [chunks_of_device(plan.schedule.name, d, pp, v) for d in range(pp)]
    bars, comm = [], []
    for b in blocks:
        k = own[b.device][b.chunk]  # the timeline counts a device's chunks locally
        bars.append(
            {
                "lane": 2 * b.device,
                "start": b.start,
                "end": b.end,
                "color": color(b.device),
                "opacity": "1" if b.kind == "F" else "0.55",
                "title": f"{b.kind} micro-batch {b.microbatch}, {chunk_label(plan, k)}",
                "label": f"{b.kind}{b.microbatch}" + (f"·c{k}" if len(plan.stages) > pp else ""),
            }
        )
        last = k == len(plan.stages) - 1
        sends = (b.kind == "F" and not last) or (b.kind == "B" and k > 0)
        if sends and p2p[k] > 0:
            # the cost model runs a send after its pass, not beside the next one (predict:
            # half the chunk's p2p time in forward, half in backward): the block's tail
            half = min(p2p[k] / 2, b.end - b.start)
            what = "activations" if b.kind == "F" else "gradients"
            title = f"send {what} of micro-batch {b.microbatch}"
            comm.append(_comm(b.device, b.end - half, half, "send", title))
    pipe_end = max(b.end for b in blocks)
    sync = plan.predicted.breakdown.get("dp_sync_s", 0.0)
    step = plan.predicted.breakdown.get("optimizer_s", 0.0)
    for d in range(pp):
        if sync > 0:
            comm.append(
                _comm(d, pipe_end, sync, "dp sync", "data-parallel gradient sync (exposed)")
            )
        if step > 0:
            comm.append(_comm(d, pipe_end + sync, step, "optimizer", "optimizer step"))
    total = max([pipe_end, *(c["end"] for c in comm)])
    scale = (WIDTH - LEFT - 10) / total if total > 0 else 1.0
    for bar in [*bars, *comm]:
        x, w = LEFT + bar["start"] * scale, max((bar["end"] - bar["start"]) * scale, 0.8)
        bar.update(
            x=f"{x:.1f}", w=f"{w:.1f}", y=bar["lane"] * ROW_H + 4, label_x=f"{x + w / 2:.1f}"
        )
        if w < 10 * len(bar.get("label", "")) * 0.6:
            bar["label"] = ""
    lanes = []
    for d in range(pp):
        chunks = chunks_of_stage(plan, d)
        name = f"stage {d}" + (
            f" (c{', c'.join(map(str, chunks))})" if len(plan.stages) > pp else ""
        )
        lanes.append({"label": name, "y": 2 * d * ROW_H + 18, "kind": "compute"})
        lanes.append({"label": "  comm", "y": (2 * d + 1) * ROW_H + 18, "kind": "comm"})
    return {
        "width": WIDTH,
        "height": 2 * pp * ROW_H + 30,
        "left": LEFT,
        "bar_h": ROW_H - 6,
        "comm_h": ROW_H - 12,
        "axis_y": 2 * pp * ROW_H + 20,
        "lanes": lanes,
        "blocks": bars,
        "comm": comm,
        "legend": list(COMM.items()),
        "total_ms": f"{total * 1e3:.1f}",
        "shown": shown,
        "microbatches": m,
    }


def _comm(device: int, start: float, length: float, kind: str, title: str) -> dict:
    return {
        "lane": 2 * device + 1,
        "start": start,
        "end": start + length,
        "color": COMM[kind],
        "kind": kind,
        "title": f"{title}: {length * 1e3:.2f} ms",
        "label": kind if kind != "send" else "",
    }
