"""The sizing chart: throughput and cost against GPUs, one SVG drawn here (no
plotting library, nothing loaded from the network), for `autopar size --chart` and the
service's sizing page."""

from __future__ import annotations

import math
from html import escape

from planner.search.sizing import Sizing

W, H = 720, 380
LEFT, RIGHT, TOP, BOTTOM = 80, 90, 40, 60
THROUGHPUT, COST = "#2563eb", "#dc2626"


def _ticks(high: float) -> list[float]:
    """Four round ticks from 0 to at least `high`."""
    if high <= 0:
        return [0.0, 1.0]
    step = 10 ** math.floor(math.log10(high / 4))
    for mult in (1, 2, 2.5, 5, 10):
        if high / (step * mult) <= 4:
            step *= mult
            break
    return [step * i for i in range(math.ceil(high / step) + 1)]


def _short(v: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:g}{unit}"
    return f"{v:g}"


def sizing_svg(sizing: Sizing) -> str:
    """An SVG of tokens/s (left axis) and cost or GPU-hours (right axis) per GPU count."""
    rows = [r for r in sizing.rows if r.fits and r.run is not None]
    money = sizing.gpu_hour_price is not None
    second = "cost" if money else "GPU-hours"
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" '
        f'height="{H}" role="img" aria-label="throughput and {second} against GPUs" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">'
        f"{escape(sizing.model)} on {escape(sizing.cluster)}: throughput and {second}</text>",
    ]
    if not rows:
        parts.append(f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no size fits</text>')
        return "\n".join([*parts, "</svg>"])
    gpus = [r.gpus for r in rows]
    lo, hi = math.log2(min(gpus)), math.log2(max(gpus))
    span = hi - lo or 1.0
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM

    def x(g: int) -> float:
        return LEFT + (math.log2(g) - lo) / span * plot_w if hi > lo else LEFT + plot_w / 2

    series = [
        ("tokens/s", THROUGHPUT, [r.tokens_per_s for r in rows]),
        (second, COST, [(r.run.cost if money else r.run.gpu_hours) for r in rows]),
    ]
    parts.append(
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" '
        'stroke="#444"/>'
    )
    for g in gpus:
        parts.append(
            f'<text x="{x(g):.1f}" y="{TOP + plot_h + 18}" text-anchor="middle">{g}</text>'
        )
    parts.append(f'<text x="{LEFT + plot_w / 2}" y="{H - 15}" text-anchor="middle">GPUs</text>')
    for side, (name, colour, values) in enumerate(series):
        ticks = _ticks(max(values))
        top = ticks[-1] or 1.0
        axis_x = LEFT if side == 0 else LEFT + plot_w
        tick_x = axis_x - 6 if side == 0 else axis_x + 6
        text_anchor = "end" if side == 0 else "start"
        parts.append(
            f'<line x1="{axis_x}" y1="{TOP}" x2="{axis_x}" y2="{TOP + plot_h}" stroke="{colour}"/>'
        )
        for t in ticks:
            ty = TOP + plot_h - t / top * plot_h
            parts.append(
                f'<text x="{tick_x}" y="{ty + 4:.1f}" text-anchor="{text_anchor}" '
                f'fill="{colour}">{_short(t)}</text>'
            )
        label_x = 14 if side == 0 else W - 14
        parts.append(
            f'<text x="{label_x}" y="{TOP + plot_h / 2}" fill="{colour}" text-anchor="middle" '
            f'transform="rotate(-90 {label_x} {TOP + plot_h / 2})">{escape(name)}</text>'
        )
        pairs = zip(gpus, values, strict=True)
        points = [(x(g), TOP + plot_h - v / top * plot_h) for g, v in pairs]
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
        parts.append(
            f'<polyline class="series" data-series="{escape(name)}" points="{path}" '
            f'fill="none" stroke="{colour}" stroke-width="2"/>'
        )
        for (px, py), g, v in zip(points, gpus, values, strict=True):
            parts.append(
                f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="{colour}">'
                f"<title>{g} GPUs: {escape(name)} {_short(v)}</title></circle>"
            )
    return "\n".join([*parts, "</svg>"])
