"""The plan viewer's sections as numbers and labels: figures, the device grid, memory per
stage, the baselines (with a flag when one beats the plan), the shardings by layer. Every
part names a pipeline chunk the same way (api/viewer_timeline.chunk_label)."""

from __future__ import annotations

from typing import Any

from api.compare import describe
from api.render import human_bytes, run_rows
from api.viewer_layers import layer_groups
from api.viewer_timeline import chunk_label, chunks_of_stage, color
from planner.cost.schedule_v import device_of_chunk
from planner.executable import plan_executor_mode
from planner.plan import Plan

MEMORY_PARTS = (
    ("params", "#4e79a7"),
    ("grads", "#f28e2b"),
    ("optimizer", "#59a14f"),
    ("activations", "#e15759"),
)
# below this share of device memory, bars are drawn against the largest stage instead of the
# capacity (a 12 MiB plan on an 80 GiB device would be a hairline)
TINY_SHARE = 0.05


def figures(plan: Plan) -> list[list[str]]:
    p, s = plan.predicted, plan.search
    fits = "" if p.fits_in_memory else " (does not fit)"
    return [
        ["step time", f"{p.step_time_s:.3f} s"],
        ["throughput", f"{p.samples_per_s:.1f} samples/s, {p.tokens_per_s:,.0f} tokens/s"],
        ["per device", f"{p.tflops_per_device:.1f} TFLOP/s ({p.mfu:.1%} MFU)"],
        ["peak memory", human_bytes(p.peak_memory_bytes) + fits],
        ["pipeline bubble", f"{p.bubble_fraction:.1%}"],
        ["exposed communication", f"{p.comm_s:.3f} s"],
        ["executable today", executable_text(plan)],
        ["search", f"{s.time_s:.1f} s, {s.candidates_evaluated} configurations"],
        *(run_rows(plan.run) if plan.run else []),
    ]


def executable_text(plan: Plan) -> str:
    mode = plan_executor_mode(plan)
    if mode == "modules":
        return "yes (module-level parallel styles, FSDP2, pipelining)"
    if mode == "graph":
        return "yes (graph mode: per-node placements with DTensor)"
    return f"no: {plan.not_executable_reason or 'not recorded in this plan'}"


def grid(plan: Plan) -> list[dict]:
    c = plan.request.cluster
    where: dict[int, tuple[int, int, int]] = {}
    for s, plane in enumerate(plan.mesh.ranks):
        for d, row in enumerate(plane):
            for t, rank in enumerate(row):
                where[rank] = (s, d, t)
    interleaved = len(plan.stages) > plan.mesh.shape[0]
    meshes = plan.mesh.stage_meshes

    def on(s: int) -> str:
        """A stage's own submesh, where stages have their own."""
        return f" on dp{meshes[s][0]} × tp{meshes[s][1]}" if meshes else ""

    nodes = []
    for node in range(c.nodes):
        devices = []
        for local in range(c.devices_per_node):
            rank = node * c.devices_per_node + local
            s, d, t = where.get(rank, (-1, 0, 0))
            chunks = chunks_of_stage(plan, s) if s >= 0 else []
            held = f" · chunks {', '.join(map(str, chunks))}" if interleaved else ""
            label = f"stage {s}{held}{on(s)} · dp {d} · tp {t}" if s >= 0 else "idle"
            short = "c" + ",".join(map(str, chunks)) if interleaved else f"d{d} t{t}"
            devices.append(
                {
                    "rank": rank,
                    "stage": f"s{s}" if s >= 0 else "idle",
                    "short": short,
                    "label": label,
                    "color": color(s) if s >= 0 else "#ccc",
                }
            )
        nodes.append({"index": node, "devices": devices})
    return nodes


def memory(plan: Plan) -> dict:
    """One bar per pipeline stage (a device's memory: with interleaving, all its chunks)."""
    cluster = plan.request.cluster
    cap = cluster.device_memory_bytes
    usable = cap - cluster.memory_headroom_bytes if cap else None
    pp = plan.mesh.shape[0]
    first = {}
    for st in plan.stages:  # every chunk of a device carries the device's memory
        first.setdefault(device_of_chunk(plan.schedule.name, st.index, plan.mesh.shape[0]), st)
    largest = max(st.predicted.memory.total for st in first.values())
    tiny = bool(cap) and largest < TINY_SHARE * cap
    scale = max(largest, 1) if tiny or not cap else max(largest, cap)
    rows = []
    for s in range(pp):
        st = first[s]
        mem = st.predicted.memory
        parts = (mem.params, mem.grads, mem.optimizer, mem.activations)
        segments = [
            {"name": n, "color": c, "size": human_bytes(v), "width": f"{100 * v / scale:.2f}"}
            for (n, c), v in zip(MEMORY_PARTS, parts, strict=True)
            if v > 0
        ]
        chunks = chunks_of_stage(plan, s)
        label = f"stage {s}" + (f" (c{', c'.join(map(str, chunks))})" if len(chunks) > 1 else "")
        rows.append({"label": label, "segments": segments, "total": human_bytes(mem.total)})
    return {
        "rows": rows,
        "capacity": human_bytes(cap) if cap else "",
        "cap_left": None if tiny or not cap else f"{100 * cap / scale:.2f}",
        "usable_left": None
        if tiny or not usable or usable == cap
        else f"{100 * usable / scale:.2f}",
        "tiny": tiny,
        "legend": MEMORY_PARTS,
    }


def baselines(plan: Plan, entries: list[dict[str, Any]]) -> tuple[list[list[str]], str]:
    """The table, and a warning when a baseline family's best is faster than the plan (a
    pinned or time-limited search can lose), with the margin."""
    if not entries:
        return [], ""
    ours = plan.predicted.step_time_s
    tflops = f"{plan.predicted.tflops_per_device:.1f}"
    rows = [["autopar plan", f"{ours:.3f}", tflops, "1.00×", describe(plan)]]
    faster = []
    for b in entries:
        if not b.get("fits"):
            rows.append([f"{b['kind']} (best)", "does not fit", "–", "–", "–"])
            continue
        ratio = b["step_time_s"] / ours
        rows.append(
            [
                f"{b['kind']} (best)",
                f"{b['step_time_s']:.3f}",
                f"{b['tflops_per_device']:.1f}",
                f"{ratio:.2f}×",
                b.get("summary") or "",
            ]
        )
        if ratio < 0.995:
            faster.append((ratio, b["kind"]))
    warning = ""
    if faster:
        ratio, kind = min(faster)
        warning = (
            f"Slower than a baseline: {kind}'s best runs a step in {ratio:.0%} of this plan's "
            f"time ({1 / ratio - 1:.0%} faster). Pinned choices or a search limit exclude it; "
            "search with fewer pins."
        )
    return rows, warning


def stages(plan: Plan) -> list[dict]:
    out = []
    for st in plan.stages:
        ckpt = st.checkpointing_label
        header = (
            f"{chunk_label(plan, st.index).capitalize()}: "
            f"layers {st.layers[0]}–{st.layers[1] - 1}, "
            f"ranks {st.ranks[0]}–{st.ranks[-1]}, dp {st.logical_mesh.dp} × tp "
            f"{st.logical_mesh.tp}, {st.zero_label}"
            + ("" if ckpt == "no" else ", checkpointing" + ("" if ckpt == "yes" else f" ({ckpt})"))
        )
        color_of = color(device_of_chunk(plan.schedule.name, st.index, plan.mesh.shape[0]))
        out.append({"header": header, "groups": layer_groups(st), "color": color_of})
    return out
