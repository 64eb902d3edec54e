"""Issues 36 and 38's GPU checks, read here: `bench/gpu_checks.sh` ran on the device tool's
machine and its files were copied to bench/results/h200_checks/; this writes
bench/results/h200_checks.md beside the predictions of this checkout.

- The ledger run (issue 36): bench/results/gpu_ledger_plan.json (Llama-3-8B's widths with 2
  layers, pp1 dp2, ZeRO-0, 4 micro-batches of 2 x 2048 tokens per rank) executed by
  `autopar execute` with both dp ranks on the one GPU (gloo, executor/worker.py): rank 0's
  collectives and bytes held in its last step beside the plan's ledger, and the allocator's
  peak beside the plan's predicted memory.
- The GEMMs of tensor-parallel ranks' layers at their own shapes (issue 38's small and thin
  GEMMs), causal attention from 8K to 128K, and one Llama-3-70B tp4 block in bf16 and torchao
  float8 (`bench/gpu_measure.py --parts layer_gemms,long_attention,fp8_layer`), beside the
  cost model's times from the `h200` profile (its tables were measured on an H100 SXM, the
  same SMs and clocks; the H200's HBM3e is faster, which the GEMM rates barely see).

Run: python bench/gpu_checks_report.py [DEVICE_DIR ...]   (copies DEVICE_DIRs' files first)
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import header, write
from fp8_model import linear

from planner.cluster.profile import load_cluster
from planner.cost.model import CostModel
from planner.cost.shape_rates import rate_tables
from planner.evaluate.ledger import rank_ledger
from planner.plan import Plan

RESULTS = Path(__file__).resolve().parent / "results"
KEPT = RESULTS / "h200_checks"
PLAN = RESULTS / "gpu_ledger_plan.json"
GIB, MIB = 2**30, 2**20
PARTS = ("layer_gemms", "long_attention", "fp8_layer")


def _bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB" if n >= MIB else f"{n:.0f} B"


def ledger_section() -> list[str]:
    plan = Plan.from_json(PLAN.read_text())
    result = json.loads((KEPT / "ledger_result.json").read_text())
    rank0 = json.loads((KEPT / "ledger_rank0.json").read_text())
    last = rank0["steps"][-1]
    measured = last["ledger"]
    want_comm, want_held = rank_ledger(plan, 0)
    got_comm = {(e["kind"], e["axis"]): (e["calls"], e["bytes"]) for e in measured["comm"]}
    lines = [
        "## Issue 36: one gradient sync per step with 4 micro-batches, on the GPU",
        "",
        "`autopar execute bench/results/gpu_ledger_plan.json --steps 4` (pp1 dp2 tp1, ZeRO-0, "
        f"{plan.schedule.microbatches} micro-batches per rank, bf16), both dp ranks on the one "
        "H200 over gloo (NCCL refuses two ranks on one GPU; executor/worker.py picks gloo when "
        "a node has more ranks than GPUs). Rank 0's last step:",
        "",
        "| | predicted | measured |",
        "| --- | --- | --- |",
    ]
    for key in sorted(set(want_comm) | set(got_comm)):
        want, got = want_comm.get(key, (0, 0)), got_comm.get(key, (0, 0))
        lines.append(
            f"| {key[0]} on {key[1]} | {want[0]} x, {_bytes(want[1])} | "
            f"{got[0]} x, {_bytes(got[1])} |"
        )
    for kind, want in want_held.items():
        lines.append(f"| {kind} held | {_bytes(want)} | {_bytes(measured['held'].get(kind, 0))} |")
    activations = next(st.predicted.memory.activations for st in plan.stages if 0 in st.ranks)
    lines.append(
        f"| activation peak (executor.ledger.LiveBytes) | {_bytes(activations)} | "
        f"{_bytes(measured['activation_peak'])} |"
    )
    peak = max(s["peak_device_bytes"] for s in rank0["steps"])
    reserved = max(s["peak_reserved_bytes"] for s in rank0["steps"])
    predicted = result["predicted_peak_bytes"]
    lines.append(
        f"| device memory | {_bytes(predicted)} | allocator peak {_bytes(peak)} "
        f"({peak / predicted - 1:+.1%}), reserved {_bytes(reserved)} |"
    )
    steps = ", ".join(f"{s['time_s']:.2f}" for s in rank0["steps"])
    lines += [
        "",
        f"Steps (s): {steps}; losses "
        + ", ".join(f"{s['loss']:.4f}" for s in rank0["steps"])
        + ". The step time is not the plan's (predicted "
        f"{result['predicted_step_s']:.3f} s): gloo moves each step's "
        f"{_bytes(got_comm.get(('all_reduce', 'dp'), (0, 0))[1])} of gradients through host "
        "memory and TCP, and two processes share the GPU.",
        "",
    ]
    return lines


def gemm_section(data: dict, h200, title: str = "") -> list[str]:
    table = CostModel(h200, "bf16")
    scalar = h200.peak_flops("bf16") * h200.efficiency.matmul
    lines = [
        "## Issue 38: tensor-parallel ranks' GEMMs at their own shapes (bf16)" + title,
        "",
        "Each linear layer's three GEMMs as autograd issues them: forward `F.linear(x[m,k], "
        "w[n,k])`, input gradient `g[m,n] @ w`, weight gradient `g^T @ x`; each run 20 times "
        "back to back between two CUDA events (median of 7), so that the CPU enqueues ahead "
        "as in a training step. Predicted: the cost model with the profile's GEMM table "
        "(planner.cost.shape_rates: each GEMM at the rate interpolated for its own shape, a "
        "memory-bound floor), and with the scalar efficiency alone "
        f"({h200.efficiency.matmul} of the peak). 'alone': the same three GEMMs each timed "
        "on its own between two events (launch latency included).",
        "",
        "| model, tp | layer | m x k x n | fwd ms measured / table | bwd ms measured / table "
        "| fwd+bwd ms measured / alone / table / scalar | error table | error scalar |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    errors_table, errors_scalar, big_table = [], [], []
    for r in data["layer_gemms"]:
        m, k, n = r["m"], r["k"], r["n"]
        t = table.node_time(linear(m, k, n))
        s_all = 6 * m * k * n / scalar
        bwd = r["dgrad"] + r["wgrad"]
        total = r["fwd"] + bwd
        alone = r["fwd_alone"] + r["dgrad_alone"] + r["wgrad_alone"]
        e_t = (t.fwd + t.bwd) / total - 1
        e_s = s_all / total - 1
        errors_table.append(e_t)
        errors_scalar.append(e_s)
        if total >= 0.3e-3:
            big_table.append(e_t)
        lines.append(
            f"| {r['model']}, tp{r['tp']} | {r['layer']} | {m} x {k} x {n} | "
            f"{r['fwd'] * 1e3:.3f} / {t.fwd * 1e3:.3f} | {bwd * 1e3:.3f} / {t.bwd * 1e3:.3f} | "
            f"{total * 1e3:.3f} / {alone * 1e3:.3f} / {(t.fwd + t.bwd) * 1e3:.3f} / "
            f"{s_all * 1e3:.3f} | {e_t:+.1%} | {e_s:+.1%} |"
        )
    autograd = [r["fwd_bwd"] for r in data["layer_gemms"]]
    lines += [
        "",
        f"{len(errors_table)} layers, forward + backward: with the table mean |error| "
        f"**{statistics.mean(abs(e) for e in errors_table):.1%}**, max "
        f"**{max(errors_table, key=abs):+.1%}** ({len(big_table)} layers of 0.3 ms or more: "
        f"mean |error| {statistics.mean(abs(e) for e in big_table):.1%}); the scalar "
        f"efficiency alone mean |error| {statistics.mean(abs(e) for e in errors_scalar):.1%}, "
        f"max {max(errors_scalar, key=abs):+.1%} (negative: predicted too fast). One "
        "`torch.autograd.grad` of one linear layer, back to back, never took under "
        f"{min(autograd) * 1e3:.3f} ms however small the GEMMs: the autograd engine's CPU "
        "time per call, which a training step pays once per backward, not per layer.",
        "",
    ]
    return lines


def attention_section(data: dict, h200) -> list[str]:
    tables = rate_tables(h200.measured, "bf16")
    lines = [
        "## Issue 38: causal attention from 8K to 128K tokens (bf16, head dim 128)",
        "",
        "`scaled_dot_product_attention(is_causal=True)`, median of 3; predicted from the "
        "profile's attention table (measured to 32K; beyond it the rate is the 32K one).",
        "",
        "| batch x heads | seq | fwd ms measured / predicted | fwd+bwd ms measured / "
        "predicted | error fwd+bwd |",
        "| --- | --- | --- | --- | --- |",
    ]
    errors = []
    for r in data["long_attention"]:
        bh, s = r["batch"] * r["heads"], r["seq"]
        flops = 4.0 * bh * s * s * r["head_dim"]  # the trace's convention (shape_rates)
        fwd = flops / tables.attention_fwd.rate((bh, s))
        bwd = 2 * flops / tables.attention_bwd.rate((bh, s))
        e = (fwd + bwd) / r["fwd_bwd"] - 1
        errors.append((s, e))
        lines.append(
            f"| {r['batch']} x {r['heads']} | {s} | {r['fwd'] * 1e3:.2f} / {fwd * 1e3:.2f} | "
            f"{r['fwd_bwd'] * 1e3:.2f} / {(fwd + bwd) * 1e3:.2f} | {e:+.1%} |"
        )
    inside = [abs(e) for s, e in errors if s <= 32768]
    beyond = [e for s, e in errors if s > 32768]
    lines += [
        "",
        f"Within the table (8K-32K): mean |error| {statistics.mean(inside):.1%}; beyond it "
        f"(64K, 128K): {', '.join(f'{e:+.1%}' for e in beyond)}.",
        "",
    ]
    return lines


def fp8_section(data: dict, h200) -> list[str]:
    rows = {(r["recipe"], r["compiled"]): r for r in data["fp8_layer"]}
    gemms = [r for r in data["layer_gemms"] if (r["model"], r["tp"]) == ("llama3-70b", 4)]
    # the block's linears: q, k, v, o, w1, w3, w2 (k and v alike, w1 and w3 alike)
    count = {"q": 1, "kv": 2, "o": 1, "w1": 2, "w2": 1}
    bf16_linears = sum(count[r["layer"]] * r["fwd_bwd"] for r in gemms)
    models = {rec: CostModel(h200, "bf16", fp8=rec) for rec in (None, "tensorwise", "rowwise")}
    predicted = {
        rec: sum(
            count[r["layer"]]
            * (lambda t: t.fwd + t.bwd)(cm.node_time(linear(r["m"], r["k"], r["n"])))
            for r in gemms
        )
        for rec, cm in models.items()
    }
    lines = [
        "## Issue 38: one Llama-3-70B tp4 block in torchao float8 against bf16",
        "",
        "One tensor-parallel rank's block (hidden 8192, 16 of 64 query heads, 2 of 8 kv heads, "
        "FFN 7168 of 28672; 1 x 8192 tokens), fp32 weights under bf16 autocast as the executor "
        "trains, forward + backward, median of 10; float8 through executor.fp8 (torchao "
        "Float8Linear on the block's 7 linears; the executor compiles such blocks on CUDA). "
        "Linear part: the block's time less its non-linear part (the bf16 block less its "
        f"seven bf16 GEMMs measured alone, {bf16_linears * 1e3:.2f} ms).",
        "",
        "| recipe | eager ms | compiled ms | speed-up (compiled) | linear part ms (compiled) "
        "| linear speed-up measured / predicted | saved for backward (compiled) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = rows[("bf16", True)]["fwd_bwd"]
    other = base - bf16_linears
    for rec, key in (("bf16", None), ("tensorwise", "tensorwise"), ("rowwise", "rowwise")):
        eager, comp = rows[(rec, False)], rows[(rec, True)]
        part = comp["fwd_bwd"] - other
        lines.append(
            f"| {rec} | {eager['fwd_bwd'] * 1e3:.2f} | {comp['fwd_bwd'] * 1e3:.2f} | "
            f"{base / comp['fwd_bwd']:.2f}x | {part * 1e3:.2f} | "
            f"{bf16_linears / part:.2f}x / {predicted[None] / predicted[key]:.2f}x | "
            f"{comp['saved_bytes'] / GIB:.2f} GiB |"
        )
    lines.append("")
    return lines


def main() -> None:
    KEPT.mkdir(exist_ok=True)
    for source in sys.argv[1:]:  # in the order they ran: a later run's parts replace
        for f in Path(source).glob("*.json"):
            if f.name == "shapes.json" and (KEPT / f.name).exists():
                kept = json.loads((KEPT / f.name).read_text())
                new = json.loads(f.read_text())
                when = kept.setdefault("parts_when", {})
                for part in PARTS:
                    if part in kept:
                        when.setdefault(part, kept["when"])
                when.update({part: new["when"] for part in new if part.endswith(PARTS)})
                (KEPT / f.name).write_text(json.dumps(kept | new, indent=1))
            elif not f.name.endswith(".error.json"):
                shutil.copyfile(f, KEPT / f.name)
    data = json.loads((KEPT / "shapes.json").read_text())
    h200 = load_cluster("h200")
    lines = [
        header(
            f"Issues 36 and 38 on one GPU ({data['device']}, torch {data['torch']})",
            "bash bench/gpu_checks.sh (device tool), then python bench/gpu_checks_report.py",
        ),
        "",
        f"Measured on the device tool's {data['device']} "
        f"({data['sms']} SMs; nvidia-smi: {data['nvidia_smi'].splitlines()[-1]}); the "
        "device's files are in `h200_checks/`; when each part ran: "
        + ", ".join(f"{k} {v}" for k, v in data.get("parts_when", {}).items())
        + f"; the ledger run {data['when']}.",
        "",
        *ledger_section(),
        *gemm_section(data, h200),
        *attention_section(data, h200),
        *fp8_section(data, h200),
    ]
    h100_run = RESULTS / "h100_gemm_pipelined.json"
    if h100_run.exists():  # the same layers on an H100 SXM, against dgx-h100's own table
        h100 = json.loads(h100_run.read_text())
        lines += gemm_section(
            h100, load_cluster("dgx-h100"), f", on an {h100['device']} ({h100['when']})"
        )
    write("h200_checks.md", "\n".join(lines))


if __name__ == "__main__":
    main()
