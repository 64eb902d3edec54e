"""The plan viewer: one self-contained HTML page (inline SVG, no scripts, nothing fetched from
the internet). The service links the stylesheet it ships (/static/viewer.css); `autopar plan
--html` inlines it so the file opens anywhere."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from api.compare import describe
from api.gantt import timeline
from api.render import human_bytes, human_count
from planner.executable import plan_executor_mode
from planner.plan import Plan

CSS_PATH = Path(__file__).resolve().parent / "static" / "viewer.css"
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"]
MAX_GANTT_MICROBATCHES = 32


def _color(stage: int) -> str:
    return PALETTE[stage % len(PALETTE)]


def _head(title: str, css_href: str | None) -> str:
    style = (
        f'<link rel="stylesheet" href="{escape(css_href)}">'
        if css_href
        else f"<style>{CSS_PATH.read_text()}</style>"
    )
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title>{style}</head><body>"
    )


def _table(headers: list[str], rows: list[list[Any]], cls: str = "") -> str:
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _figures(plan: Plan) -> str:
    p = plan.predicted
    rows = [
        ["step time", f"{p.step_time_s:.3f} s"],
        ["throughput", f"{p.samples_per_s:.1f} samples/s, {p.tokens_per_s:,.0f} tokens/s"],
        ["per device", f"{p.tflops_per_device:.1f} TFLOP/s ({p.mfu:.1%} MFU)"],
        [
            "peak memory",
            human_bytes(p.peak_memory_bytes) + ("" if p.fits_in_memory else " (does not fit)"),
        ],
        ["pipeline bubble", f"{p.bubble_fraction:.1%}"],
        ["exposed communication", f"{p.comm_s:.3f} s"],
        [
            "executable today",
            _executable_text(plan),
        ],
        [
            "search",
            f"{plan.search.time_s:.1f} s, {plan.search.candidates_evaluated} configurations",
        ],
    ]
    return _table(["predicted", "value"], rows, "figures")


def _device_grid(plan: Plan) -> str:
    c = plan.request.cluster
    where: dict[int, tuple[int, int, int]] = {}
    for s, plane in enumerate(plan.mesh.ranks):
        for d, row in enumerate(plane):
            for t, rank in enumerate(row):
                where[rank] = (s, d, t)
    cells = []
    for node in range(c.nodes):
        devs = []
        for local in range(c.devices_per_node):
            rank = node * c.devices_per_node + local
            s, d, t = where.get(rank, (-1, 0, 0))
            color = _color(s) if s >= 0 else "#ccc"
            label = f"stage {s} · dp {d} · tp {t}" if s >= 0 else "idle"
            devs.append(
                f'<div class="device" style="background:{color}" title="rank {rank}: {label}">'
                f"<b>{rank}</b><span>s{s} d{d} t{t}</span></div>"
            )
        cells.append(
            f'<div class="node"><div class="node-label">node {node}</div>{"".join(devs)}</div>'
        )
    return f'<div class="grid">{"".join(cells)}</div>'


def _gantt(plan: Plan) -> str:
    pp = plan.mesh.shape[0]
    per_device = [0.0] * pp
    for st in plan.stages:  # interleaved plans list each virtual stage; a device runs several
        per_device[st.index % pp] += st.predicted.compute_s + st.predicted.comm_s
    m = plan.schedule.microbatches
    shown = min(m, MAX_GANTT_MICROBATCHES)
    blocks = timeline(plan.schedule.name, per_device, shown, plan.schedule.virtual_stages)
    if not blocks:
        return "<p>no schedule</p>"
    total = max(b.end for b in blocks)
    width, row_h, left = 960, 26, 70
    scale = (width - left - 10) / total if total > 0 else 1
    parts = [
        f'<svg class="gantt" viewBox="0 0 {width} {pp * row_h + 30}" '
        f'width="{width}" height="{pp * row_h + 30}" role="img" aria-label="pipeline schedule">'
    ]
    for d in range(pp):
        y = d * row_h + 4
        parts.append(f'<text x="4" y="{y + 16}" class="lane">stage {d}</text>')
    for b in blocks:
        x = left + b.start * scale
        w = max((b.end - b.start) * scale, 0.5)
        y = b.device * row_h + 4
        color = _color(b.device)
        opacity = "1" if b.kind == "F" else "0.55"
        parts.append(
            f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 6}" fill="{color}" '
            f'fill-opacity="{opacity}" stroke="#fff" stroke-width="0.5">'
            f"<title>{b.kind} micro-batch {b.microbatch} chunk {b.chunk}</title></rect>"
        )
        if w > 16:
            parts.append(
                f'<text x="{x + w / 2:.1f}" y="{y + 14}" class="mb">{b.kind}{b.microbatch}</text>'
            )
    axis_y = pp * row_h + 20
    parts.append(
        f'<text x="{left}" y="{axis_y}" class="lane">0</text>'
        f'<text x="{width - 10}" y="{axis_y}" class="lane" text-anchor="end">'
        f"{total * 1e3:.1f} ms</text></svg>"
    )
    note = (
        f"<p class='note'>First {shown} of {m} micro-batches; forward solid, backward light. "
        "Simulated from the predicted per-stage times (forward:backward = 1:2).</p>"
    )
    return "".join(parts) + note


def _stages(plan: Plan) -> str:
    out = []
    for st in plan.stages:
        kinds = [
            s
            for s in st.shardings
            if s.kind in ("linear", "embedding", "attention", "loss", "conv2d", "einsum")
        ]
        rows = [[s.module or s.node, s.kind, s.strategy] for s in kinds[:400]]
        more = len(kinds) - len(rows)
        header = (
            f"Stage {st.index}: layers {st.layers[0]}–{st.layers[1]}, ranks {st.ranks[0]}–"
            f"{st.ranks[-1]}, dp {st.logical_mesh.dp} × tp {st.logical_mesh.tp}, ZeRO-{st.zero}"
            + (", activation checkpointing" if st.activation_checkpointing else "")
        )
        out.append(
            f'<details class="stage" open>'
            f'<summary style="border-color:{_color(st.index % plan.mesh.shape[0])}">'
            f"{escape(header)}</summary>"
            + _table(["module", "kind", "strategy"], rows, "shardings")
            + (f"<p class='note'>{more} more not shown</p>" if more > 0 else "")
            + "</details>"
        )
    return "".join(out)


def _memory(plan: Plan) -> str:
    cap = plan.request.cluster.device_memory_bytes
    biggest = max([st.predicted.memory.total for st in plan.stages] + [cap or 0, 1])
    rows = []
    for st in plan.stages:
        mem = st.predicted.memory
        parts = [
            ("params", mem.params, "#4e79a7"),
            ("grads", mem.grads, "#f28e2b"),
            ("optimizer", mem.optimizer, "#59a14f"),
            ("activations", mem.activations, "#e15759"),
        ]
        bars = "".join(
            f'<span class="seg" style="width:{100 * v / biggest:.2f}%;background:{c}" '
            f'title="{n}: {human_bytes(v)}"></span>'
            for n, v, c in parts
            if v > 0
        )
        cap_line = (
            f'<span class="cap" style="left:{100 * cap / biggest:.2f}%" title="capacity"></span>'
            if cap
            else ""
        )
        rows.append(
            f'<div class="mem-row"><span class="mem-label">stage {st.index}</span>'
            f'<span class="mem-bar">{bars}{cap_line}</span>'
            f'<span class="mem-val">{human_bytes(mem.total)}'
            + (f" / {human_bytes(cap)}" if cap else "")
            + "</span></div>"
        )
    legend = " ".join(
        f'<span class="key" style="background:{c}"></span>{n}'
        for n, c in (
            ("params", "#4e79a7"),
            ("grads", "#f28e2b"),
            ("optimizer", "#59a14f"),
            ("activations", "#e15759"),
        )
    )
    legend += " · line: device capacity"
    return f'<div class="memory">{"".join(rows)}<p class="legend">{legend}</p></div>'


def _baselines(plan: Plan, baselines: list[dict[str, Any]]) -> str:
    if not baselines:
        return "<p class='note'>No baselines were evaluated for this plan.</p>"
    ours = plan.predicted.step_time_s
    rows = [
        [
            "autopar plan",
            f"{ours:.3f}",
            f"{plan.predicted.tflops_per_device:.1f}",
            "1.00×",
            describe(plan),
        ]
    ]
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
    return _table(
        ["configuration", "step s", "TFLOP/s/device", "time vs plan", "setup"], rows, "baselines"
    )


def render_page(plan: Plan, baselines: list[dict[str, Any]], css_href: str | None = None) -> str:
    req = plan.request
    title = f"autopar plan: {req.model.name} on {req.cluster.name}"
    subtitle = (
        f"{human_count(req.model.params)} parameters · {req.cluster.nodes} × "
        f"{req.cluster.devices_per_node} {req.cluster.device} · global batch "
        f"{req.training.global_batch_size}, seq {req.training.seq_len}, {req.training.dtype}"
    )
    explanation = "".join(f"<li>{escape(line)}</li>" for line in plan.explanation)
    return (
        _head(title, css_href) + f"<header><h1>{escape(title)}</h1><p>{escape(subtitle)}</p>"
        f"<p class='mesh'>{escape(describe(plan))}</p></header><main>"
        f"<section><h2>Predicted</h2>{_figures(plan)}"
        + (f"<ul class='explanation'>{explanation}</ul>" if explanation else "")
        + f"</section><section><h2>Devices by stage</h2>{_device_grid(plan)}</section>"
        f"<section><h2>Pipeline schedule</h2>{_gantt(plan)}</section>"
        f"<section><h2>Memory per device</h2>{_memory(plan)}</section>"
        f"<section><h2>Compared with baselines</h2>{_baselines(plan, baselines)}</section>"
        f"<section><h2>Shardings per stage</h2>{_stages(plan)}</section>"
        "</main></body></html>"
    )


def render_status_page(job: dict[str, Any], css_href: str | None = None) -> str:
    status = job["status"]
    lines = [f"<p>Status: <b>{escape(status)}</b></p>"]
    progress = job.get("progress") or {}
    if progress.get("step"):
        lines.append(f"<p>{escape(progress['step'])}: {progress['done']}/{progress['total']}</p>")
    if job.get("error"):
        lines.append(f"<p class='error'>{escape(job['error'])}</p>")
    if job.get("explanation"):
        lines.append(
            "<ul>" + "".join(f"<li>{escape(x)}</li>" for x in job["explanation"]) + "</ul>"
        )
    return (
        _head(f"autopar plan {job['id']}", css_href)
        + f"<header><h1>Plan {escape(job['id'])}</h1><p>{escape(job['model'])} on "
        f"{escape(job['cluster'])}</p></header><main><section>{''.join(lines)}</section></main>"
        "</body></html>"
    )


def render_missing_page(plan_id: str, css_href: str | None = None) -> str:
    return (
        _head("autopar: no such plan", css_href)
        + f"<header><h1>No plan {escape(plan_id)}</h1></header><main><section>"
        "<p>It was never made or has been deleted. <a href='/v1/plans'>GET /v1/plans</a> lists "
        "the stored plans.</p></section></main></body></html>"
    )


def _executable_text(plan: Plan) -> str:
    mode = plan_executor_mode(plan)
    if mode == "modules":
        return "yes (module-level parallel styles, FSDP2, pipelining)"
    if mode == "graph":
        return "yes (graph mode: per-node placements with DTensor)"
    return "no (a per-node tp layout across pipeline stages, or a model family not yet run)"
