"""From raw timings to a cluster profile: alpha-beta fits of the collectives per link tier
(with residuals), achieved matmul / attention FLOP/s and memory bandwidth.

Each collective is fitted as t(B) = a + b B by least squares on relative error (small and large
messages count alike), then read with the ring model the cost model uses
(planner/cost/model.py): a = hops x latency, b = volume / bandwidth.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from planner.cluster.profile import ClusterProfile, LinkFit, MeasuredPoint
from planner.limits import MAX_BANDWIDTH

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def ring_terms(collective: str, n: int) -> tuple[float, float]:
    """(hops, volume factor) of a ring collective over n devices (see cost_model.py)."""
    if collective == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if collective == "send_recv":
        return 1, 1.0
    return n - 1, (n - 1) / n


def fit_line(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """Least squares of t = a + b x weighted by 1/t (relative error); a, b >= 0."""
    w = [1 / (t * t) for t in ts]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs, strict=True))
    st = sum(wi * t for wi, t in zip(w, ts, strict=True))
    sxx = sum(wi * x * x for wi, x in zip(w, xs, strict=True))
    sxt = sum(wi * x * t for wi, x, t in zip(w, xs, ts, strict=True))
    det = sw * sxx - sx * sx
    if det <= 0:
        return 0.0, max(ts) / max(max(xs), 1)
    b = (sw * sxt - sx * st) / det
    a = (st - b * sx) / sw
    if a < 0:  # latency below resolution: fit the slope through the origin
        a, b = 0.0, sxt / sxx
    if b <= 0:
        b = 1e-18
    return a, b


def fit_collective(collective: str, points: list[MeasuredPoint]) -> LinkFit:
    """Alpha-beta fit for one collective at one group size."""
    n = points[0].group_size
    xs = [float(p.bytes) for p in points]
    ts = [p.seconds for p in points]
    a, b = fit_line(xs, ts)
    hops, volume = ring_terms(collective, n)
    residual = math.sqrt(
        statistics.fmean(((a + b * x) - t) ** 2 / (t * t) for x, t in zip(xs, ts, strict=True))
    )
    return LinkFit(
        group_size=n,
        latency=a / hops,
        # A flat (noise-only) slope means no measurable limit: the profile's cap stands in.
        bandwidth=min(volume / b, MAX_BANDWIDTH),
        rel_residual=residual,
        points=len(points),
    )


def fit_tiers(
    collectives: dict[str, dict[str, list[MeasuredPoint]]],
) -> dict[str, dict[str, LinkFit]]:
    """Per tier and collective, the fit at the largest measured group size."""
    fits: dict[str, dict[str, LinkFit]] = {}
    for tier, by_name in collectives.items():
        for name, points in by_name.items():
            sizes = sorted({p.group_size for p in points})
            group = [p for p in points if p.group_size == sizes[-1]]
            if len(group) >= 2:
                fits.setdefault(tier, {})[name] = fit_collective(name, group)
    return fits


def _link(fits: dict[str, LinkFit], fallback: dict[str, Any]) -> dict[str, Any]:
    """A link tier from its fits: all-reduce's if measured (what gradient sync and tensor
    parallelism mostly use), else the median over collectives."""
    if not fits:
        return fallback
    if "all_reduce" in fits:
        f = fits["all_reduce"]
        return {"bandwidth": f.bandwidth, "latency": f.latency}
    return {
        "bandwidth": statistics.median(f.bandwidth for f in fits.values()),
        "latency": statistics.median(f.latency for f in fits.values()),
    }


def build_profile(base: ClusterProfile, raw: dict[str, Any], name: str | None = None):
    """A ClusterProfile like `base` with links, compute rates and the `measured` section
    taken from the worker's raw timings."""
    collectives: dict[str, dict[str, list[MeasuredPoint]]] = {}
    for row in raw.get("collectives", []):
        point = MeasuredPoint(
            group_size=row["group_size"], bytes=row["bytes"], seconds=row["seconds"]
        )
        collectives.setdefault(row["tier"], {}).setdefault(row["collective"], []).append(point)
    fits = fit_tiers(collectives)
    doc = base.model_dump(mode="json")
    links = doc["links"]
    intra = _link(fits.get("intra_node", {}), links["intra_node"])
    inter = _link(
        fits.get("inter_node", {}), intra if raw.get("nnodes", 1) == 1 else links["inter_node"]
    )
    doc["links"] = {"intra_node": intra, "inter_node": inter}
    achieved: dict[str, float] = {}
    for m in raw.get("matmuls", []):
        achieved[m["dtype"]] = max(achieved.get(m["dtype"], 0.0), m["flops_per_s"])
    efficiency = dict(doc.get("efficiency") or {})
    efficiency["comm"] = 1.0  # the fitted bandwidth is already what a collective achieves
    bandwidth = raw.get("memory_bandwidth")
    if bandwidth:
        doc["device"]["memory_bandwidth"] = bandwidth
        efficiency["memory"] = 1.0
    if raw.get("overlap") is not None:
        efficiency["overlap"] = raw["overlap"]
    if raw.get("kernels") in ("cuda", "cpu"):
        doc["device"]["kernels"] = raw["kernels"]
    doc["efficiency"] = efficiency
    doc["name"] = name or f"{base.name}-measured"
    doc["nodes"] = raw.get("nnodes", base.nodes)
    doc["devices_per_node"] = raw.get("procs_per_node", base.devices_per_node)
    doc["sources"] = [*base.sources, f"measured by autopar profile-cluster on {raw.get('where')}"]
    doc["measured"] = {
        "when": raw.get("when"),
        "where": raw.get("where"),
        "collectives": {
            t: {c: [p.model_dump() for p in pts] for c, pts in by.items()}
            for t, by in collectives.items()
        },
        "fits": {t: {c: f.model_dump() for c, f in by.items()} for t, by in fits.items()},
        "achieved_flops": achieved,
        "matmuls": raw.get("matmuls", []),
        "attention_flops": {a["dtype"]: a["flops_per_s"] for a in raw.get("attention", [])},
        "memory_bandwidth": bandwidth,
        "overlap": raw.get("overlap"),
        "op_times": raw.get("op_times", []),
    }
    return ClusterProfile.model_validate(doc)
