"""Alpa's inter-operator pass (issue 40): each pipeline stage on its own submesh with its own
(dp, tp), against every stage on one mesh, on Alpa's suites (bench/suite.py's cases:
aws-p3.16xlarge, GPT and MoE at global batch 1024 fp16, Wide-ResNet at 1536 fp32).

Per case, two searches of the same trace with plans the executor cannot run allowed
(`--allow-non-executable`, where the pass runs by default; the executor runs per-stage plans
with Megatron's layouts and no tied embeddings, which rules out most of these): the uniform
search alone (`--stage-meshes uniform`) and the default (uniform, then the stage-submesh DP
for the best uniform plans' settings). Reported: both predicted step times and the margin,
the per-stage plan's meshes where it wins, and both search times (the disk cache off, so
neither search reads the other's layouts; alternating, the least of two runs of each).
Tracing is not included in either.

Run: AUTOPAR_CACHE_DIR=off python bench/submeshes.py [gpt|moe|wresnet|executable ...]
(writes bench/results/submeshes.md)
"""

from __future__ import annotations

import os
import sys
import time

from common import RESULTS, header, write
from suite import SUITES, cluster_for, suite_inputs

from planner.search import submeshes
from planner.search.search import NoFeasiblePlan, search
from planner.search.space import SearchOptions

PASS_S = [0.0]  # the pass's own time in the search being run (bench-only instrumentation)


def _timed_pass(run, candidates, required=False):
    started = time.perf_counter()
    try:
        return _per_stage_search(run, candidates, required)
    finally:
        PASS_S[0] += time.perf_counter() - started


_per_stage_search = submeshes.per_stage_search
submeshes.per_stage_search = _timed_pass


def _searched(inputs, stage_meshes: tuple[str, ...]):
    PASS_S[0] = 0.0
    started = time.perf_counter()
    options = SearchOptions(executable_only=False, stage_meshes=stage_meshes)
    try:
        plan = search(inputs, options).plan
    except NoFeasiblePlan:
        plan = None
    return plan, time.perf_counter() - started, PASS_S[0]


def _mesh(plan) -> str:
    if plan is None:
        return "does not fit"
    # (the stages' meshes joined by "/": "|" would split the table's cell)
    return f"{plan.mesh.summary().replace(' | ', ' / ')}, m{plan.schedule.microbatches}"


def run_suite(name: str) -> list[str]:
    dtype, batch, cases = SUITES[name]
    lines = [
        f"## {name} (global batch {batch}, {dtype})",
        "",
        "| model | GPUs | uniform: plan | step s | per-stage search: plan | step s | margin "
        "| search s uniform | search s with pass | ratio | pass s | ratio in one search |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, gpus in cases:
        inputs = suite_inputs(model, gpus, dtype, batch)
        # alternating, the least of two each: the first search of a trace also rescales it
        # to its micro-batch sizes, which later ones reuse
        runs: dict[str, list] = {"uniform": [], "both": []}
        for _ in range(2):
            runs["uniform"].append(_searched(inputs, ("uniform",)))
            runs["both"].append(_searched(inputs, ("uniform", "per_stage")))
        uniform, t_uniform = runs["uniform"][0][0], min(r[1] for r in runs["uniform"])
        both, t_both, t_pass = min(runs["both"], key=lambda r: r[1])
        step_u = uniform.predicted.step_time_s if uniform else None
        step_b = both.predicted.step_time_s if both else None
        margin = f"{1 - step_b / step_u:.2%}" if step_u and step_b else "-"
        lines.append(
            f"| {model} | {gpus} | {_mesh(uniform)} | {step_u or 0:.3f} | {_mesh(both)} | "
            f"{step_b or 0:.3f} | {margin} | {t_uniform:.1f} | {t_both:.1f} | "
            f"{t_both / t_uniform:.2f}x | {t_pass:.2f} | {t_both / (t_both - t_pass):.2f}x |"
        )
        print(lines[-1], flush=True)
    return [*lines, ""]


# Executable searches with the pass pinned (`--stage-meshes per_stage`, the executor's own
# plans): Llama-3-8B (untied embeddings) at sequence 2048, fp16, on p3.16xlarge nodes.
EXECUTABLE = (("llama3-8b", 16, 256), ("llama3-8b", 32, 512))


def run_executable() -> list[str]:
    from planner.request import resolve_request

    lines = [
        "## executable searches, the pass pinned (llama3-8b, seq 2048, fp16)",
        "",
        "| GPUs | batch | uniform: plan | step s | pinned per-stage: plan | step s | executable |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, gpus, batch in EXECUTABLE:
        training = {"global_batch_size": batch, "seq_len": 2048, "dtype": "fp16"}
        inputs = resolve_request({"name": model}, cluster_for(gpus), training).trace()
        plans = {}
        for pin in ("uniform", "per_stage"):
            options = SearchOptions(stage_meshes=(pin,))
            try:
                plans[pin] = search(inputs, options).plan
            except NoFeasiblePlan as err:
                plans[pin] = err
        uniform, staged = plans["uniform"], plans["per_stage"]
        step_u = uniform.predicted.step_time_s
        if isinstance(staged, NoFeasiblePlan):
            cells = f"refused: {' '.join(staged.explanation)[:120]} | - | - |"
        else:
            cells = (
                f"{_mesh(staged)}, ZeRO {'/'.join(str(st.zero) for st in staged.stages)} | "
                f"{staged.predicted.step_time_s:.3f} | {staged.executable} |"
            )
        lines.append(f"| {gpus} | {batch} | {_mesh(uniform)} | {step_u:.3f} | {cells}")
        print(lines[-1], flush=True)
    return [*lines, ""]


def main() -> None:
    if os.environ.get("AUTOPAR_CACHE_DIR", "x").lower() not in ("off", ""):
        sys.exit("run with AUTOPAR_CACHE_DIR=off (both searches must solve their own layouts)")
    suites = sys.argv[1:] or [*SUITES, "executable"]
    body = [
        header(
            "Stages on their own submeshes (Alpa's inter-operator pass) vs one mesh",
            "AUTOPAR_CACHE_DIR=off python bench/submeshes.py " + " ".join(suites),
        ),
        "",
        __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        "margin: how much faster the per-stage plan is predicted (0.00%: the pass found "
        "nothing faster and the uniform plan stands). ratio: search time with the pass over "
        "without, two searches (run-to-run variance on this machine is 10-20%); pass s: the "
        "pass's own time inside the faster search with it; ratio in one search: that search's "
        "time over itself without the pass's.",
        "",
    ]
    for name in suites:
        body += run_executable() if name == "executable" else run_suite(name)
    write(RESULTS / "submeshes.md", "\n".join(body))


if __name__ == "__main__":
    main()
