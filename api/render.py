"""Plain-text rendering for the CLI: tables that read well in a terminal and in a log."""

from __future__ import annotations

import io
from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from planner.plan import Plan
from planner.units import human_bytes, human_count, human_flops, plural

__all__ = ["human_bytes", "human_count", "plan_summary", "table"]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain table (rich, no colours, never wrapped): first column left, the rest right."""
    out = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, highlight=False)
    for i, header in enumerate(headers):
        out.add_column(str(header), justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        out.add_row(*(escape(str(c)) for c in row))
    buffer = io.StringIO()
    Console(file=buffer, width=10_000, color_system=None, legacy_windows=False).print(out)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def versus_prediction(predicted: float, measured: float) -> str:
    """How a prediction compares with its measurement, in words that say which side is
    larger: "prediction 12% low", "prediction 3% high", "measured 4.8x the prediction"."""
    if predicted <= 0 or measured <= 0:
        return "no comparison"
    if measured >= 2 * predicted:
        return f"measured {measured / predicted:.1f}x the prediction"
    if predicted >= 2 * measured:
        return f"prediction {predicted / measured:.1f}x the measured"
    error = predicted / measured - 1
    if abs(error) < 0.005:
        return "prediction within 0.5%"
    return f"prediction {abs(error):.0%} {'high' if error > 0 else 'low'}"


def _mesh_line(plan: Plan) -> str:
    if plan.mesh.stage_meshes is not None:
        return (
            f"mesh     {plan.mesh.summary()}; schedule {plan.schedule.name}, "
            f"{plural(plan.schedule.microbatches, 'micro-batch')}"
        )
    dims = plan.mesh.dims
    cp = f" cp={dims.cp}" if dims.cp > 1 else ""
    cp += f" ({dims.cp_comm})" if dims.cp_comm else ""
    parts = [
        f"mesh     pp={dims.pp} dp={dims.dp}{cp} tp={dims.tp}; schedule {plan.schedule.name}, "
        f"{plural(plan.schedule.microbatches, 'micro-batch')}"
    ]
    if plan.schedule.virtual_stages > 1:
        parts[0] += f", {plan.schedule.virtual_stages} virtual stages"
    if plan.sequence_parallel:
        parts.append("sequence parallel")
    if dims.dp_shard:
        parts.append(f"HSDP {dims.dp_replicate} replicas x {dims.dp_shard} shards")
    if any(st.cpu_offload for st in plan.stages):
        parts.append("CPU offload")
    if plan.fp8:
        parts.append(f"fp8 matmuls ({plan.fp8} scales)")
    return "; ".join(parts)


def plan_summary(plan: Plan) -> str:
    req = plan.request
    pred = plan.predicted
    head = [
        f"model    {req.model.name} ({human_count(req.model.params)} params)",
        f"cluster  {req.cluster.name}: {req.cluster.nodes} x {req.cluster.devices_per_node} "
        f"{req.cluster.device}",
        f"training global batch {req.training.global_batch_size}, seq {req.training.seq_len}, "
        f"{req.training.dtype}, {req.training.optimizer}"
        + (f", for {req.training.runtime}" if req.training.runtime != "autopar" else ""),
        _mesh_line(plan),
        "",
    ]
    rows = []
    for st in plan.stages:
        mem = st.predicted.memory
        rows.append(
            [
                st.index,
                f"{st.layers[0]}-{st.layers[1]}",
                f"{st.ranks[0]}-{st.ranks[-1]}",
                st.zero if st.resharded_layers is None else _layerwise(st),
                st.checkpointing_label,
                f"{st.predicted.compute_s * 1e3:.1f}",
                f"{st.predicted.comm_s * 1e3:.1f}",
                human_bytes(mem.params + mem.grads + mem.optimizer),
                human_bytes(mem.activations),
                human_bytes(mem.total),
            ]
        )
    stages = table(
        [
            "stage",
            "layers",
            "ranks",
            "zero",
            "ckpt",
            "compute ms/mb",
            "comm ms/mb",
            "model state",
            "activations",
            "memory",
        ],
        rows,
    )
    figures = table(
        ["predicted", "value"],
        [
            ["step time", f"{pred.step_time_s:.3f} s"],
            [
                "throughput",
                f"{pred.samples_per_s:.1f} samples/s, {pred.tokens_per_s:,.0f} tokens/s",
            ],
            ["per device", f"{human_flops(pred.tflops_per_device * 1e12)} ({pred.mfu:.1%} MFU)"],
            [
                "peak memory",
                human_bytes(pred.peak_memory_bytes)
                + ("" if pred.fits_in_memory else "  (DOES NOT FIT)"),
            ],
            ["bubble", f"{pred.bubble_fraction:.1%}"],
            ["exposed comm", f"{pred.comm_s:.3f} s"],
            *(run_rows(plan.run) if plan.run else []),
        ],
    )
    headers, rows = ledger_table(plan)
    ledger = "\n\n" + table(headers, rows) if rows else ""
    return (
        "\n".join(head)
        + stages
        + ledger
        + "\n\n"
        + figures
        + "\n\n"
        + "\n".join(f"- {line}" for line in plan.explanation)
    )


LEDGER_AXES = ("pp", "dp", "dp_shard", "dp_replicate", "tp", "cp", "tied", "world")


def ledger_table(plan: Plan) -> tuple[list[str], list[list[str]]]:
    """The plan's ledger in short (planner.evaluate.ledger): per stage, what one of its
    ranks communicates in a step on each mesh axis (calls and bytes by collective) and the
    bytes of parameters, gradients and optimizer state it holds."""
    ledgers = [(st, st.predicted.ledger) for st in plan.stages if st.predicted.ledger]
    axes = sorted(
        {e.axis for _, ledger in ledgers for e in ledger.comm if e.calls},
        key=lambda a: (LEDGER_AXES.index(a) if a in LEDGER_AXES else len(LEDGER_AXES), a),
    )
    rows = []
    for st, ledger in ledgers:
        cells = [
            ", ".join(
                f"{e.calls} {e.kind.replace('_', '-')} {human_bytes(e.bytes)}"
                for e in ledger.comm
                if e.axis == axis and e.calls
            )
            or "-"
            for axis in axes
        ]
        held = ledger.held[0] if ledger.held else None
        total = held.params + held.grads + held.optimizer if held else 0
        rows.append([str(st.index), *cells, human_bytes(total)])
    headers = ["ledger/step", *(f"on {axis}" for axis in axes), "state held"]
    return headers, rows


def run_rows(run) -> list[list[str]]:
    """The run's figures as summary rows."""
    rows = [
        ["run", f"{human_count(run.train_tokens)} tokens, {run.steps:,} steps"],
        [
            "run time",
            f"{run.time_s / 86400:.1f} days ({run.time_s / 3600:,.0f} h) at {run.goodput:.0%} "
            "goodput (wall-clock on steps that count)",
        ],
        ["GPU-hours", f"{run.gpu_hours:,.0f}"],
    ]
    if run.cost is not None:
        rows.append(["cost", f"{run.cost:,.0f} at {run.gpu_hour_price:g} per GPU-hour"])
    return rows


def _layerwise(st) -> str:
    """A layer-wise ZeRO stage's zero column: its ZeRO-3 layers, then 2 for the rest (with
    none, 2 on the layers and 3 on the stage's other parameters)."""
    if st.resharded_layers == 0:
        return "2, 3 off layers"
    return f"3 on {st.resharded_layers} of {st.layers[1] - st.layers[0]}, 2"
