"""The plan viewer: one self-contained HTML page (inline SVG, no scripts, nothing fetched from
the internet), rendered from Jinja2 templates (api/templates/, autoescaped). The service links
the stylesheet it ships (/static/viewer.css); `autopar plan --html` inlines it so the file
opens anywhere. This module turns a Plan into the numbers and labels the templates lay out."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape

import api.viewer_parts as parts
from api.compare import describe
from api.render import human_count, ledger_table
from api.viewer_timeline import gantt
from planner.plan import Plan

HERE = Path(__file__).resolve().parent
CSS_PATH = HERE / "static" / "viewer.css"


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


def render_page(plan: Plan, baselines: list[dict[str, Any]], css_href: str | None = None) -> str:
    req = plan.request
    subtitle = (
        f"{human_count(req.model.params)} parameters · {req.cluster.nodes} × "
        f"{req.cluster.devices_per_node} {req.cluster.device} · global batch "
        f"{req.training.global_batch_size}, seq {req.training.seq_len}, {req.training.dtype}"
    )
    rows, warning = parts.baselines(plan, baselines)
    return _render(
        "plan.html.j2",
        f"autopar plan: {req.model.name} on {req.cluster.name}",
        css_href,
        subtitle=subtitle,
        mesh=describe(plan),
        figures=parts.figures(plan),
        explanation=plan.explanation,
        grid=parts.grid(plan),
        gantt=gantt(plan),
        memory=parts.memory(plan),
        baselines=rows,
        warning=warning,
        stages=parts.stages(plan),
        ledger=ledger_table(plan),
    )


def render_status_page(job: dict[str, Any], css_href: str | None = None) -> str:
    return _render(
        "status.html.j2",
        f"autopar plan {job['id']}",
        css_href,
        job=job,
        progress=job.get("progress") or {},
    )


def render_missing_page(plan_id: str, css_href: str | None = None, why: str = "") -> str:
    title = "autopar: no such plan"
    return _render("missing.html.j2", title, css_href, plan_id=plan_id, why=why)


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


def render_compare_page(a: Plan, b: Plan, ids: tuple[str, str], css_href: str | None = None) -> str:
    """The comparison page; served (a stylesheet link), it links each plan's own page."""
    from api.viewer_compare import rows, sides

    title = f"autopar: {a.request.model.name} on {a.request.cluster.name}, two plans"
    values = {"rows": rows(a, b), "sides": sides(a, b, ids), "links": css_href is not None}
    return _render("compare.html.j2", title, css_href, **values)
