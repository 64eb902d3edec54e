"""The plan viewer: one self-contained HTML page (inline SVG, no scripts, nothing fetched from
the internet), rendered from Jinja2 templates (api/templates/, autoescaped). The service links
the stylesheet it ships (/static/viewer.css); `autopar plan --html` inlines it so the file
opens anywhere. This module turns a Plan into the numbers and labels the templates lay out."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape

from api.compare import describe
from api.gantt import timeline
from api.render import human_bytes, human_count, run_rows
from planner.cost.schedule_v import device_of_chunk
from planner.executable import plan_executor_mode
from planner.plan import Plan

HERE = Path(__file__).resolve().parent
CSS_PATH = HERE / "static" / "viewer.css"
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"]
MEMORY_PARTS = (
    ("params", "#4e79a7"),
    ("grads", "#f28e2b"),
    ("optimizer", "#59a14f"),
    ("activations", "#e15759"),
)
MAX_GANTT_MICROBATCHES = 32
MAX_SHARDING_ROWS = 400
SHOWN_KINDS = ("linear", "embedding", "attention", "loss", "conv2d", "einsum")


@cache
def _env() -> Environment:
    return Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(["html", "j2"], default=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )


def _render(template: str, title: str, css_href: str | None, **values: Any) -> str:
    inline = "" if css_href else CSS_PATH.read_text()
    page = _env().get_template(template)
    return page.render(title=title, css_href=css_href, inline_css=inline, **values)


def _color(stage: int) -> str:
    return PALETTE[stage % len(PALETTE)]


def _figures(plan: Plan) -> list[list[str]]:
    p, s = plan.predicted, plan.search
    fits = "" if p.fits_in_memory else " (does not fit)"
    return [
        ["step time", f"{p.step_time_s:.3f} s"],
        ["throughput", f"{p.samples_per_s:.1f} samples/s, {p.tokens_per_s:,.0f} tokens/s"],
        ["per device", f"{p.tflops_per_device:.1f} TFLOP/s ({p.mfu:.1%} MFU)"],
        ["peak memory", human_bytes(p.peak_memory_bytes) + fits],
        ["pipeline bubble", f"{p.bubble_fraction:.1%}"],
        ["exposed communication", f"{p.comm_s:.3f} s"],
        ["executable today", _executable_text(plan)],
        [
            "search",
            f"{s.time_s:.1f} s, {s.candidates_evaluated} configurations",
        ],
        *(run_rows(plan.run) if plan.run else []),
    ]


def _grid(plan: Plan) -> list[dict]:
    c = plan.request.cluster
    where: dict[int, tuple[int, int, int]] = {}
    for s, plane in enumerate(plan.mesh.ranks):
        for d, row in enumerate(plane):
            for t, rank in enumerate(row):
                where[rank] = (s, d, t)
    nodes = []
    for node in range(c.nodes):
        devices = []
        for local in range(c.devices_per_node):
            rank = node * c.devices_per_node + local
            s, d, t = where.get(rank, (-1, 0, 0))
            label = f"stage {s} · dp {d} · tp {t}" if s >= 0 else "idle"
            color = _color(s) if s >= 0 else "#ccc"
            devices.append({"rank": rank, "s": s, "d": d, "t": t, "label": label, "color": color})
        nodes.append({"index": node, "devices": devices})
    return nodes


def _gantt(plan: Plan) -> dict | None:
    pp = plan.mesh.shape[0]
    per_device = [0.0] * pp
    for st in plan.stages:  # interleaved plans list each virtual stage; a device runs several
        device = device_of_chunk(plan.schedule.name, st.index, pp)
        per_device[device] += st.predicted.compute_s + st.predicted.comm_s
    m = plan.schedule.microbatches
    shown = min(m, MAX_GANTT_MICROBATCHES)
    blocks = timeline(plan.schedule.name, per_device, shown, plan.schedule.virtual_stages)
    if not blocks:
        return None
    total = max(b.end for b in blocks)
    width, row_h, left = 960, 26, 70
    scale = (width - left - 10) / total if total > 0 else 1
    bars = []
    for b in blocks:
        x, w = left + b.start * scale, max((b.end - b.start) * scale, 0.5)
        bars.append(
            {
                "x": f"{x:.1f}",
                "y": b.device * row_h + 4,
                "w": f"{w:.1f}",
                "color": _color(b.device),
                "opacity": "1" if b.kind == "F" else "0.55",
                "title": f"{b.kind} micro-batch {b.microbatch} chunk {b.chunk}",
                "label": f"{b.kind}{b.microbatch}" if w > 16 else "",
                "label_x": f"{x + w / 2:.1f}",
            }
        )
    return {
        "width": width,
        "height": pp * row_h + 30,
        "left": left,
        "bar_h": row_h - 6,
        "axis_y": pp * row_h + 20,
        "lanes": [{"index": d, "y": d * row_h + 20} for d in range(pp)],
        "blocks": bars,
        "total_ms": f"{total * 1e3:.1f}",
        "shown": shown,
        "microbatches": m,
    }


def _memory(plan: Plan) -> dict:
    cap = plan.request.cluster.device_memory_bytes
    biggest = max([st.predicted.memory.total for st in plan.stages] + [cap or 0, 1])
    rows = []
    for st in plan.stages:
        mem = st.predicted.memory
        segments = [
            {"name": n, "color": c, "size": human_bytes(v), "width": f"{100 * v / biggest:.2f}"}
            for (n, c), v in zip(
                MEMORY_PARTS, (mem.params, mem.grads, mem.optimizer, mem.activations), strict=True
            )
            if v > 0
        ]
        rows.append({"index": st.index, "segments": segments, "total": human_bytes(mem.total)})
    return {
        "rows": rows,
        "capacity": human_bytes(cap) if cap else "",
        "cap_left": f"{100 * cap / biggest:.2f}" if cap else None,
        "legend": MEMORY_PARTS,
    }


def _baselines(plan: Plan, baselines: list[dict[str, Any]]) -> list[list[str]]:
    if not baselines:
        return []
    ours = plan.predicted.step_time_s
    tflops = f"{plan.predicted.tflops_per_device:.1f}"
    rows = [["autopar plan", f"{ours:.3f}", tflops, "1.00×", describe(plan)]]
    for b in baselines:
        if not b.get("fits"):
            rows.append([f"{b['kind']} (best)", "does not fit", "–", "–", "–"])
            continue
        rows.append(
            [
                f"{b['kind']} (best)",
                f"{b['step_time_s']:.3f}",
                f"{b['tflops_per_device']:.1f}",
                f"{b['step_time_s'] / ours:.2f}×",
                b.get("summary") or "",
            ]
        )
    return rows


def _checkpointing(st) -> str:
    label = st.checkpointing_label
    if label == "no":
        return ""
    return ", activation checkpointing" + ("" if label == "yes" else f" ({label})")


def _stages(plan: Plan) -> list[dict]:
    out = []
    for st in plan.stages:
        kinds = [s for s in st.shardings if s.kind in SHOWN_KINDS]
        rows = [[s.module or s.node, s.kind, s.strategy] for s in kinds[:MAX_SHARDING_ROWS]]
        header = (
            f"Stage {st.index}: layers {st.layers[0]}–{st.layers[1]}, ranks {st.ranks[0]}–"
            f"{st.ranks[-1]}, dp {st.logical_mesh.dp} × tp {st.logical_mesh.tp}, ZeRO-{st.zero}"
            + _checkpointing(st)
        )
        color = _color(st.index % plan.mesh.shape[0])
        out.append({"header": header, "rows": rows, "more": len(kinds) - len(rows), "color": color})
    return out


def render_page(plan: Plan, baselines: list[dict[str, Any]], css_href: str | None = None) -> str:
    req = plan.request
    subtitle = (
        f"{human_count(req.model.params)} parameters · {req.cluster.nodes} × "
        f"{req.cluster.devices_per_node} {req.cluster.device} · global batch "
        f"{req.training.global_batch_size}, seq {req.training.seq_len}, {req.training.dtype}"
    )
    return _render(
        "plan.html.j2",
        f"autopar plan: {req.model.name} on {req.cluster.name}",
        css_href,
        subtitle=subtitle,
        mesh=describe(plan),
        figures=_figures(plan),
        explanation=plan.explanation,
        grid=_grid(plan),
        gantt=_gantt(plan),
        memory=_memory(plan),
        baselines=_baselines(plan, baselines),
        stages=_stages(plan),
    )


def render_status_page(job: dict[str, Any], css_href: str | None = None) -> str:
    return _render(
        "status.html.j2",
        f"autopar plan {job['id']}",
        css_href,
        job=job,
        progress=job.get("progress") or {},
    )


def render_missing_page(plan_id: str, css_href: str | None = None) -> str:
    return _render("missing.html.j2", "autopar: no such plan", css_href, plan_id=plan_id)


def _executable_text(plan: Plan) -> str:
    mode = plan_executor_mode(plan)
    if mode == "modules":
        return "yes (module-level parallel styles, FSDP2, pipelining)"
    if mode == "graph":
        return "yes (graph mode: per-node placements with DTensor)"
    return f"no: {plan.not_executable_reason or 'not recorded in this plan'}"


def render_sizing_page(sizing, css_href: str | None = None) -> str:
    """The sizing (planner.search.sizing.Sizing): the chart and the table per size."""
    from api.cli.size import sizing_rows
    from api.sizing_chart import sizing_svg

    headers, rows = sizing_rows(sizing)
    return _render(
        "sizing.html.j2",
        f"autopar sizing: {sizing.model} on {sizing.cluster}",
        css_href,
        sizing=sizing,
        tokens=human_count(sizing.train_tokens),
        chart=sizing_svg(sizing),
        headers=headers,
        rows=rows,
    )
