"""The comparison page (GET /v1/plans/compare?a=...&b=...): two plans' figures side by side
with the ratio of each, then each plan's schedule and memory as the plan page draws them."""

from __future__ import annotations

from api.compare import describe
from api.render import human_bytes
from api.viewer_parts import memory
from api.viewer_timeline import gantt
from planner.plan import Plan


def _ratio(a: float, b: float, lower_is_better: bool = True) -> str:
    if a <= 0 or b <= 0:
        return "–"
    r = b / a
    if abs(r - 1) < 0.005:
        return "same"
    worse = r > 1 if lower_is_better else r < 1
    factor = r if r > 1 else 1 / r
    return f"B {factor:.2f}× {'worse' if worse else 'better'}"


def _devices(plan: Plan) -> str:
    c = plan.request.cluster
    return f"{c.nodes} × {c.devices_per_node} {c.device}"


def rows(a: Plan, b: Plan) -> list[list[str]]:
    pa, pb = a.predicted, b.predicted
    return [
        ["model", a.request.model.name, b.request.model.name, ""],
        ["devices", _devices(a), _devices(b), ""],
        ["configuration", describe(a), describe(b), ""],
        [
            "step time",
            f"{pa.step_time_s:.3f} s",
            f"{pb.step_time_s:.3f} s",
            _ratio(pa.step_time_s, pb.step_time_s),
        ],
        [
            "tokens/s",
            f"{pa.tokens_per_s:,.0f}",
            f"{pb.tokens_per_s:,.0f}",
            _ratio(pa.tokens_per_s, pb.tokens_per_s, lower_is_better=False),
        ],
        ["MFU", f"{pa.mfu:.1%}", f"{pb.mfu:.1%}", _ratio(pa.mfu, pb.mfu, lower_is_better=False)],
        [
            "peak memory",
            human_bytes(pa.peak_memory_bytes),
            human_bytes(pb.peak_memory_bytes),
            _ratio(pa.peak_memory_bytes, pb.peak_memory_bytes),
        ],
        ["pipeline bubble", f"{pa.bubble_fraction:.1%}", f"{pb.bubble_fraction:.1%}", ""],
        ["exposed communication", f"{pa.comm_s:.3f} s", f"{pb.comm_s:.3f} s", ""],
    ]


def sides(a: Plan, b: Plan, ids: tuple[str, str]) -> list[dict]:
    return [
        {
            "name": name,
            "id": plan_id,
            "mesh": describe(plan),
            "gantt": gantt(plan),
            "memory": memory(plan),
        }
        for name, plan_id, plan in (("A", ids[0], a), ("B", ids[1], b))
    ]
