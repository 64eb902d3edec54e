"""Issue 17's long sequences: Llama-3-8B and -70B at 32K and 128K tokens on 64 to 1,024 H100
(dgx-h100), planned with context parallelism in the search space, against the best plan the
same search finds without it (cp pinned to 1) and against Megatron-LM's and torchtitan's
grids (both with context parallelism, planner/search/baselines.py). Global batches of about
4M tokens (128 x 32K, 32 x 128K), as Llama 3's long-context stage used a few million tokens
per step. Ratio = the other's step time / the plan's (>= 1: the plan is as fast or faster).
Search seconds: each case is searched once untimed first, so both searches find its tables
cached (the baselines build their own).

Second table: published runs with context parallelism, their configurations evaluated as
published (`autopar estimate`'s path), predicted peak memory against what they report:
torchtitan's benchmarks/llama3_h100_202412_torchtitan.md, Table 2 (Llama 3.1 8B, 8 H100,
FSDP x CP = 8, local batch 1, full activation checkpointing, 32K-256K tokens) and Table 6
(Llama 3.1 405B, 512 H100, TP 8, PP 8 with 1F1B, FSDP x CP = 8, local batch 8, full
checkpointing). Their H100s are 96 GB parts at 500 W (bench/profiles/grand-teton-h100-500w.yaml);
they report the caching allocator's peak reserved memory, the maximum over GPUs. They ran with
torch.compile and Float8 linears: their step times are compared with the prediction with fp8
tensorwise linears (torchtitan's Float8 default then; the profile's fp8 peak is the NVL
datasheet's, it has no measured fp8 table, so the scalar efficiency applies). FSDP
reshards after forward (ZeRO-3) without a pipeline; with one it
keeps the gathered bf16 weights from forward to backward (2 B/param) with fp32 weights,
gradients and optimizer state sharded, torchtitan's default: between the cost model's ZeRO-2
(fp32 weights unsharded) and ZeRO-3 (nothing kept gathered), so both are listed.

Run: python bench/long_context.py [--quick]   (writes bench/results/long_context.md)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from common import header, write

from api.compare import describe
from planner.cluster.profile import load_cluster
from planner.evaluate.config import ParallelConfig
from planner.evaluate.estimate import evaluate
from planner.graph.tracing import trace_model
from planner.intra_op.megatron import tensor_parallel_layout
from planner.models import ModelSpec, resolve
from planner.plan import TrainingSettings
from planner.request import model_ref, resolve_request
from planner.search.baselines import baseline
from planner.search.search import NoFeasiblePlan, search
from planner.search.space import SearchOptions

CASES = [
    # (model, nodes of 8 H100, sequence, global batch in sequences)
    ("llama3-8b", 8, 32768, 128),
    ("llama3-8b", 8, 131072, 32),
    ("llama3-70b", 8, 32768, 128),
    ("llama3-70b", 32, 131072, 32),
    ("llama3-70b", 128, 131072, 32),
]
KINDS = ("megatron", "fsdp_tp")
GRAND_TETON = str(Path(__file__).parent / "profiles" / "grand-teton-h100-500w.yaml")
L405 = {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "ffn_hidden": 53248}
# (label, model, config, GPUs, pp, tp, FSDP, CP, seq, local batch, TPS/GPU, GiB): torchtitan's
PUBLISHED = [
    ("8B, FSDP 8, CP 1", "llama3-8b", {}, 8, 1, 1, 8, 1, 32768, 1, 3890, 83.9),
    ("8B, FSDP 4, CP 2", "llama3-8b", {}, 8, 1, 1, 4, 2, 65536, 1, 2540, 84.2),
    ("8B, FSDP 2, CP 4", "llama3-8b", {}, 8, 1, 1, 2, 4, 131072, 1, 1071, 84.0),
    ("8B, FSDP 1, CP 8", "llama3-8b", {}, 8, 1, 1, 1, 8, 262144, 1, 548, 84.5),
    ("405B, FSDP 8, CP 1", "llama3-70b", L405, 512, 8, 8, 8, 1, 32768, 8, 76, 75.3),
    ("405B, FSDP 4, CP 2", "llama3-70b", L405, 512, 8, 8, 4, 2, 65536, 8, 47, 75.9),
    ("405B, FSDP 2, CP 4", "llama3-70b", L405, 512, 8, 8, 2, 4, 131072, 8, 31, 77.1),
    ("405B, FSDP 1, CP 8", "llama3-70b", L405, 512, 8, 8, 1, 8, 262144, 8, 16, 84.9),
]


def published_rows() -> list[str]:
    rows = []
    for label, model, config, gpus, pp, tp, fsdp, cp, seq, local, tps, gib in PUBLISHED:
        resolved = resolve(ModelSpec(name=model, config=config))
        cluster = load_cluster(GRAND_TETON).with_nodes(gpus // 8)
        batch = fsdp * local  # torchtitan's local batch is per data-parallel (FSDP) rank
        training = TrainingSettings(global_batch_size=batch, seq_len=seq, dtype="bf16")
        graph = trace_model(resolved, 1, seq, "bf16")
        # torchtitan's tensor parallelism is sequence-parallel (SequenceParallel norms)
        layouts = tensor_parallel_layout(graph, tp, sequence_parallel=tp > 1)
        for zero in (3,) if pp == 1 else (2, 3):
            mesh = ParallelConfig(fsdp * cp, tp, pp, local, "1f1b", 1, zero, True, cp=cp)
            ref = model_ref(resolved, seq)
            plan = evaluate(graph, cluster, training, mesh, ref, layouts=layouts, detail=False)
            # their Float8 linears (torchao, tensorwise: torchtitan's default recipe then)
            fp8 = ParallelConfig(**{**mesh.__dict__, "fp8": "tensorwise"})
            fp8_plan = evaluate(graph, cluster, training, fp8, ref, layouts=layouts, detail=False)
            peak = plan.predicted.peak_memory_bytes / 2**30
            fits = "yes" if plan.predicted.fits_in_memory else "**no**"
            published = batch * seq / (tps * gpus)
            fp8_s = fp8_plan.predicted.step_time_s
            rows.append(
                f"| {label}, {seq // 1024}K, {gpus} GPUs, pp{pp} tp{tp}, as ZeRO-{zero} | "
                f"{gib:.1f} | {peak:.1f} | {(peak - gib) / gib:+.1%} | {fits} | "
                f"{published:.1f} | {plan.predicted.step_time_s:.1f} | {fp8_s:.1f} | "
                f"{fp8_s / published - 1:+.1%} |"
            )
            print(rows[-1], flush=True)
    return rows


def _plan(inputs, cp: int | None):
    t0 = time.perf_counter()
    try:
        plan = search(inputs, SearchOptions(cp=cp, executable_only=True)).plan
    except NoFeasiblePlan:
        plan = None
    return plan, time.perf_counter() - t0


def _cell(plan, ours) -> tuple[str, str, str]:
    if plan is None:
        return "does not fit", "-", "-"
    step = plan.predicted.step_time_s
    ratio = f"{step / ours:.3f}" if ours else "-"
    return (
        f"{step:.2f}",
        ratio,
        f"{describe(plan)}, {plan.predicted.peak_memory_bytes / 2**30:.1f} GiB",
    )


def main() -> None:
    cases = CASES[:2] if "--quick" in sys.argv else CASES
    rows = []
    for model, nodes, seq, batch in cases:
        label = f"{model}, {seq // 1024}K, {nodes * 8} H100, batch {batch}"
        profile = load_cluster("dgx-h100").with_nodes(nodes)
        training = {"global_batch_size": batch, "seq_len": seq, "dtype": "bf16"}
        inputs = resolve_request({"name": model}, profile, training).trace()
        _plan(inputs, None)  # untimed: the case's traces and layout tables cached for both
        plan, took = _plan(inputs, None)
        ours = plan.predicted.step_time_s if plan else None
        step, _, what = _cell(plan, ours)
        rows.append(f"| {label} | plan | {step} | 1.000 | {what} | {took:.1f} |")
        no_cp, took = _plan(inputs, 1)
        step, ratio, what = _cell(no_cp, ours)
        rows.append(f"| {label} | plan without cp | {step} | {ratio} | {what} | {took:.1f} |")
        for kind in KINDS:
            t0 = time.perf_counter()
            found = baseline(kind, inputs)
            took = time.perf_counter() - t0
            step, ratio, what = _cell(found.plan, ours)
            rows.append(f"| {label} | {kind} grid | {step} | {ratio} | {what} | {took:.1f} |")
    text = header(
        "Long sequences with context parallelism (issue 17)", "python bench/long_context.py"
    )
    text += "\n".join(
        [
            "Same cost model (dgx-h100 with its measured GEMM and attention tables) for all; "
            "executable plans only; ratio = the row's step time / the plan's.",
            "",
            "| case | who | step s | ratio | configuration, peak memory | s to find |",
            "| --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )
    if "--quick" not in sys.argv:
        text += "\n".join(
            [
                "",
                "## Published runs with context parallelism: memory and step time",
                "",
                "torchtitan's Tables 2 and 6 (see the script's docstring); step times from "
                "their tokens/s per GPU, run with torch.compile and Float8 linears; predicted "
                "in bf16, and with fp8 tensorwise linears (planner.parallel.fp8: the casts "
                "priced fused, as compiled; the other ops eager). Memory predicted in bf16.",
                "",
                "| run | published GiB | predicted GiB | difference | fits | published s "
                "(compiled, fp8) | predicted s (bf16) | predicted s (fp8) | fp8 error |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
                *published_rows(),
                "",
            ]
        )
    write("long_context.md" if "--quick" not in sys.argv else "long_context_quick.md", text)


if __name__ == "__main__":
    main()
