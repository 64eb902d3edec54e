"""Predicted vs measured Llama layers on an H100 (issue 16, item 5): the cost model's per-layer
forward+backward compute time and saved-activation bytes against `bench/gpu_measure.py`'s
measurements of autopar's own Llama block (the one the executor runs), whole (tp 1) and with
one tensor-parallel rank's widths (tp 2-8, Megatron's layout, communication excluded on both
sides).

    python bench/gpu_layers.py [--measured bench/results/h100_measure.json ...]

Two predictions per layer: the datasheet profile with one scalar matmul efficiency (what
`dgx-h100` was before the measured tables: 0.65 of peak, no source) and the committed
`dgx-h100` profile, whose `measured.matmuls` / `measured.attention_times` came from the
first measurement file (planner.cost.shape_rates). The second and later files are repeats
on another machine start: their spread is the noise floor of the comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import header
from planner.cluster.mesh import LogicalMesh
from planner.cluster.profile import Efficiency, load_cluster
from planner.cost.model import CostModel
from planner.evaluate.node_costs import node_costs
from planner.graph.tracing import trace_model
from planner.intra_op.megatron import tensor_parallel_layout
from planner.models.registry import ModelSpec, resolve

MODELS = {  # measured name -> (zoo model, config overrides, batch)
    "llama3-8b": ("llama3-8b", {}, 2),
    "llama3-8b-b1": ("llama3-8b", {}, 1),
    "llama3-70b": ("llama3-70b", {}, 1),
    "llama3-405b": ("llama3-70b", {"hidden": 16384, "heads": 128, "ffn_hidden": 53248}, 1),
}
SEQ = 8192


def _graph(name: str):
    model, overrides, batch = MODELS[name]
    resolved = resolve(ModelSpec(name=model, config={**overrides, "layers": 2}))
    return trace_model(resolved, batch, SEQ, "bf16")


def predict(graph, cm: CostModel, tp: int, policy: str = "none") -> tuple[float, int]:
    """(forward + backward seconds, saved bytes) of the graph's last layer on one tp rank;
    checkpointed (`policy` full or selective): the layer's input kept, what the policy keeps,
    and the recomputation (the planner's terms: planner.parallel.checkpointing)."""
    mesh = LogicalMesh.contiguous(cm.cluster.with_nodes(1), 0, (1, tp))
    layouts = tensor_parallel_layout(graph, tp)
    last = max(n.layer for n in graph.nodes if n.layer is not None)
    nodes = [n for n in graph.nodes if n.layer == last]
    costs = node_costs(graph, layouts, cm, mesh, nodes=nodes).values()
    time = sum(c.fwd + c.bwd for c in costs)
    if policy == "none":
        return time, sum(c.saved for c in costs)
    x = nodes[0].inputs[0].nbytes  # the layer's input (its first node's)
    if policy == "full":
        return time + sum(c.fwd + c.comm_fwd for c in costs), x
    kept = sum(c.selective_kept for c in costs)
    return time + sum(c.selective_recompute + c.comm_fwd for c in costs), x + kept


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--measured",
        nargs="+",
        default=[f"bench/results/h100_measure{s}.json" for s in ("", "_run2", "_run3", "_run4")],
    )
    p.add_argument("--out", default="bench/results/h100_layers.md")
    args = p.parse_args()
    runs = [json.loads(Path(f).read_text()) for f in args.measured]
    tables = load_cluster("dgx-h100")
    scalar = tables.model_copy(update={"measured": None, "efficiency": Efficiency(matmul=0.65)})
    models = {"scalar": CostModel(scalar, "bf16"), "tables": CostModel(tables, "bf16")}
    measured: dict[tuple[str, int, str], list[tuple[float, int]]] = {}
    for run in runs:
        for part in ("layers", "tp_layers", "ckpt_layers"):
            for r in run.get(part, []):
                key = (r["model"], r.get("tp", 1), r.get("policy", "none"))
                measured.setdefault(key, []).append(
                    (r["layer_fwd_bwd_s"], r["layer_activation_bytes"])
                )
    graphs = {name: _graph(name) for name in {k[0] for k in measured}}
    rows, errors = [], {"scalar": [], "tables": []}
    for (name, tp, policy), samples in sorted(measured.items()):
        t_meas = statistics.median(s for s, _ in samples)
        spread = (max(s for s, _ in samples) - min(s for s, _ in samples)) / t_meas
        saved_meas = statistics.median(b for _, b in samples)
        cells = []
        for label, cm in models.items():
            t, saved = predict(graphs[name], cm, tp, policy)
            err = t / t_meas - 1
            if policy == "none":
                errors[label].append(abs(err))
            cells += [f"{t * 1e3:.1f}", f"{err:+.1%}"]
        saved_err = saved / saved_meas - 1
        _, _, batch = MODELS[name]
        rows.append(
            f"| {name} | {tp} | {policy} | {batch} x {SEQ} | {t_meas * 1e3:.1f} ({len(samples)}, "
            f"{spread:.1%}) | " + " | ".join(cells) + f" | {saved_meas / 2**30:.2f} | "
            f"{saved / 2**30:.2f} ({saved_err:+.0%}) |"
        )
    device = runs[0]["device"]
    lines = header(
        f"H100 layers: predicted vs measured ({device}, torch {runs[0]['torch']})",
        "python bench/gpu_layers.py",
    ).split("\n")
    lines += [
        "Measured: `bench/gpu_measure.py` on the device tool's machine "
        f"({', '.join(r['when'] for r in runs)}): median of the runs (count, spread). "
        "Predicted: the last layer of a 2-layer trace, Megatron's layout at tp, "
        "communication excluded on both sides. `scalar`: the datasheet profile at 0.65 of "
        "peak for every matmul; `tables`: the committed dgx-h100 profile (measured GEMM and "
        "attention rates by shape).",
        "",
        "| layer | tp | checkpointing | batch x seq | measured ms (runs, spread) | scalar ms | "
        "error | tables ms | error | measured GiB saved | predicted GiB saved |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        "| prediction (layers without checkpointing) | layers | mean abs error | max abs error |",
        "| --- | --- | --- | --- |",
    ]
    for label, errs in errors.items():
        lines.append(f"| {label} | {len(errs)} | {statistics.mean(errs):.1%} | {max(errs):.1%} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
