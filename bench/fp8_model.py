"""Issue 17's fp8 cost model against the H100: torchao Float8Linear layers measured there
compiled (bench/results/h100_fp8_compiled.json, `bench/gpu_measure.py --parts fp8_compiled`)
beside what planner.parallel.fp8 predicts for the same layer: forward + backward time in
bf16, tensorwise and rowwise, the fp8 speedup, and the bytes kept for backward. The model's
constants are the recipe's byte counts and the profile's measured GEMM rates (no constant is
fitted to these layers but ROWWISE_SLOWDOWN, the median of their rowwise/tensorwise ratio,
which this table therefore cannot validate).

Run: python bench/fp8_model.py   (writes bench/results/fp8_model.md)
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from common import header, write

from planner.cluster.profile import load_cluster
from planner.cost.model import CostModel
from planner.graph.opgraph import OpNode, TensorMeta

MEASURED = Path(__file__).parent / "results" / "h100_fp8_compiled.json"
MIB = 2**20


def linear(m: int, k: int, n: int) -> OpNode:
    """One bf16 nn.Linear(k, n) on m rows, as the trace records it."""
    return OpNode(
        name="fc",
        op="aten.linear.default",
        kind="linear",
        module="layers.0.feed_forward.w1",
        module_type="torch.nn.modules.linear.Linear",
        layer=0,
        inputs=[TensorMeta(shape=[m, k], dtype="bf16")],
        outputs=[TensorMeta(shape=[m, n], dtype="bf16")],
        params={"weight": TensorMeta(shape=[n, k], dtype="bf16")},
        fwd_flops=2 * m * k * n,
        bwd_flops=4 * m * k * n,
        bytes_read=2 * (m * k + k * n),
        bytes_written=2 * m * n,
        saved_bytes=2 * m * k,
    )


def main() -> None:
    data = json.loads(MEASURED.read_text())
    h100 = load_cluster("dgx-h100")
    models = {r: CostModel(h100, "bf16", fp8=r) for r in (None, "tensorwise", "rowwise")}
    rows, errors, speed_errors = [], {r: [] for r in models}, []
    for case in data["fp8_compiled"]:
        m, k, n = case["m"], case["k"], case["n"]
        node = linear(m, k, n)
        predicted = {r: cm.node_time(node).fwd + cm.node_time(node).bwd for r, cm in models.items()}
        measured = {
            None: case["bf16"]["fwd_bwd"],
            "tensorwise": case["tensorwise"]["fwd_bwd"],
            "rowwise": case["rowwise"]["fwd_bwd"],
        }
        for r in models:
            errors[r].append(predicted[r] / measured[r] - 1)
        speed_p = predicted[None] / predicted["tensorwise"]
        speed_m = measured[None] / measured["tensorwise"]
        speed_errors.append(speed_p / speed_m - 1)
        saved_p = models["tensorwise"].saved_bytes(node) + 4 * k * n  # + the fp32 weight
        saved_m = case["tensorwise"]["saved_bytes"]
        rows.append(
            f"| {m} x {k} x {n} | {measured[None] * 1e3:.2f} / {predicted[None] * 1e3:.2f} | "
            f"{measured['tensorwise'] * 1e3:.2f} / {predicted['tensorwise'] * 1e3:.2f} | "
            f"{measured['rowwise'] * 1e3:.2f} / {predicted['rowwise'] * 1e3:.2f} | "
            f"{speed_m:.2f}x / {speed_p:.2f}x | {saved_m / MIB:.0f} / {saved_p / MIB:.0f} |"
        )
    names = {None: "bf16", "tensorwise": "tensorwise", "rowwise": "rowwise"}
    summary = [
        f"- {names[r]}: mean |error| {statistics.mean(abs(e) for e in errs):.1%}, "
        f"max {max(errs, key=abs):+.1%}"
        for r, errs in errors.items()
    ]
    summary.append(
        f"- tensorwise speedup over bf16: mean |error| "
        f"{statistics.mean(abs(e) for e in speed_errors):.1%}, "
        f"max {max(speed_errors, key=abs):+.1%}"
    )
    text = header("fp8 cost model against torchao layers on an H100", "python bench/fp8_model.py")
    text += (
        f"\nMeasured: {data['device']}, torch {data['torch']}, {data['when']} (compiled forward +"
        " backward of one nn.Linear, bf16 autocast, median of 10 CUDA-event timings). Predicted:"
        " the dgx-h100 profile's measured bf16 and fp8 GEMM tables with planner.parallel.fp8's"
        " cast bytes at the profile's memory rate.\n\n"
        "| m x k x n | bf16 ms measured / predicted | tensorwise ms | rowwise ms | "
        "tensorwise speedup | saved MiB (tensorwise, with the fp32 weight) |\n"
        "| --- | --- | --- | --- | --- | --- |\n"
        + "\n".join(rows)
        + "\n\n"
        + "\n".join(summary)
        + "\n"
    )
    print(text)
    write("fp8_model.md", text)


if __name__ == "__main__":
    main()
