"""The best plans of Alpa's suite (bench/suite.py, default search) scaled down so that they run
on 4 gloo processes of this machine: same family, schedule, ZeRO level, checkpointing and tp
layout, and — for per-node layouts — every node's strategy and placements copied from the
suite plan; small widths, fewer layers, a mesh of at most 4 ranks (pp and tp capped at 2, dp
takes what is left).

How a scaled plan is made: the planner plans the small model on a cpu-local cluster with the
suite plan's mesh (scaled; as many devices), schedule, ZeRO, checkpointing and layout pinned;
then each node of that plan takes the suite plan's tp strategy of the matching node, and the small
plan is evaluated again with those strategies (their placements, resharding, time, memory and
ledger as the ILP prices them: planner.intra_op.ilp_layouts.chosen_layouts). Nodes match by
(block, path inside the block, kind, occurrence): small block j takes the suite block of the
same make-up (MoE or dense; with or without a shortcut) nearest to the same relative depth;
nodes outside blocks (embeddings, head, loss) match by path. A node without a match keeps the
small plan's own choice (the table counts them).

Writes tests/fixtures/suite_scaled/<model>.json (tests/executor/test_suite_plans.py runs them
against the single-process reference) and bench/results/suite_scaled.md. With --execute it
runs those plans instead (gloo processes, 3 steps) and records measured vs predicted step
time in bench/results/suite_scaled_execute.md.

Run: python bench/suite_scaled.py [--execute] [model ...]
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections import Counter
from pathlib import Path

from common import header, write
from suite import SUITES, suite_inputs

from planner.cluster.mesh import LogicalMesh
from planner.cluster.profile import load_cluster
from planner.cost.model import CostModel
from planner.evaluate.estimate import evaluate
from planner.intra_op.ilp_layouts import chosen_layouts
from planner.intra_op.sharding_problem import ShardingProblem
from planner.parallel.tensor import layout_kinds
from planner.request import resolve_request
from planner.search.search import search
from planner.search.space import SearchOptions

FIXTURES = Path(__file__).parent.parent / "tests" / "fixtures" / "suite_scaled"
RANKS = 4
SMALL = {
    "gpt": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 128},
    "moe": {"layers": 4, "hidden": 64, "heads": 4, "experts": 4, "vocab": 128, "ffn_hidden": 128},
    "wresnet": {"layers": 26, "channels": 4, "width": 1, "image_size": 64, "classes": 8},
}
SEQ, MICRO_BATCH = 16, 4
BLOCK = re.compile(r"^(blocks|layers)\.(\d+)(?:\.(.*))?$")


def scaled_mesh(pp: int, dp: int, tp: int) -> tuple[int, int, int]:
    pp2, tp2 = min(pp, 2), min(tp, 2)
    return pp2, min(dp, RANKS // (pp2 * tp2)), tp2


def _node_keys(plan) -> dict[str, tuple]:
    """node name -> (block index or None, path inside the block, kind, occurrence)."""
    seen: Counter = Counter()
    out = {}
    for st in plan.stages:
        for s in st.shardings:
            m = BLOCK.match(s.module)
            block, rest = (int(m.group(2)), m.group(3) or "") if m else (None, s.module)
            key = (block, rest, s.kind)
            out[s.node] = (*key, seen[key])
            seen[key] += 1
    return out


def _block_makeup(keys: dict[str, tuple]) -> dict[int, frozenset]:
    makeup: dict[int, set] = {}
    for block, rest, kind, _ in keys.values():
        if block is not None:
            makeup.setdefault(block, set()).add((rest, kind))
    return {b: frozenset(v) for b, v in makeup.items()}


def _block_map(small: dict[int, frozenset], big: dict[int, frozenset]) -> dict[int, int]:
    """Small block -> the suite block of the same make-up nearest the same relative depth."""
    out = {}
    for j, makeup in small.items():
        target = (j + 0.5) * len(big) / max(len(small), 1)
        same = [b for b, m in big.items() if m == makeup] or list(big)
        out[j] = min(same, key=lambda b: abs(b + 0.5 - target))
    return out


def transplant(small_plan, big_plan) -> tuple[dict[str, str], int, int]:
    """Each node of `small_plan` with the tp strategy of `big_plan`'s matching node: returns
    (strategy by node, nodes matched, nodes)."""
    small_keys, big_keys = _node_keys(small_plan), _node_keys(big_plan)
    blocks = _block_map(_block_makeup(small_keys), _block_makeup(big_keys))
    by_key = {key: name for name, key in big_keys.items()}
    big_nodes = {s.node: s for st in big_plan.stages for s in st.shardings}
    names: dict[str, str] = {}
    for st in small_plan.stages:
        for s in st.shardings:
            block, rest, kind, occ = small_keys[s.node]
            big_key = (blocks.get(block) if block is not None else None, rest, kind, occ)
            source = big_nodes.get(by_key.get(big_key, ""))
            if source is not None:
                names[s.node] = source.strategy
    total = sum(len(st.shardings) for st in small_plan.stages)
    return names, len(names), total


def replan(result, inputs, names: dict[str, str]):
    """The search's best small plan evaluated again with the transplanted strategies (the
    ILP's terms for them: planner.intra_op.ilp_layouts.chosen_layouts), so its shardings,
    time, memory and ledger are the transplant's; a node that does not offer its suite
    strategy at this size keeps its own."""
    best = result.candidates[0]
    graph = result.layouts.graph(best.mbs)
    own = {s.node: s.strategy for st in result.plan.stages for s in st.shardings}
    tp = best.config.tp
    mesh = LogicalMesh.contiguous(inputs.cluster, 0, (1, tp))
    cm = CostModel(inputs.cluster, inputs.training.dtype)
    problem = ShardingProblem(graph, mesh, cm, memory_budget=math.inf, zero=0)
    layouts = chosen_layouts(problem, names, fallback=own)
    return evaluate(
        graph,
        inputs.cluster,
        inputs.training,
        best.config,
        inputs.model,
        tokens_per_sample=inputs.tokens_per_sample,
        layouts=layouts,
        ranges=list(best.ranges) if best.ranges else None,
    )


def _renamer(source_block: int | None, block: int | None):
    if source_block is None:
        return lambda name: name
    pattern = re.compile(rf"^(blocks|layers)\.{source_block}\.")
    return lambda name: pattern.sub(lambda m: f"{m.group(1)}.{block}.", name)


def scale(name: str, big_plan):
    """The scaled plan of one suite case, with its provenance."""
    family = big_plan.request.model.family
    pp, dp, tp = big_plan.mesh.shape
    mesh = scaled_mesh(pp, dp, tp)
    first = big_plan.stages[0]
    m = mesh[0]  # the fewest micro-batches every schedule takes (1F1B: m >= pp)
    devices = mesh[0] * mesh[1] * mesh[2]
    cluster = load_cluster("cpu-local").model_copy(update={"nodes": 1, "devices_per_node": devices})
    fields = {
        "global_batch_size": m * mesh[1] * MICRO_BATCH,
        "seq_len": SEQ,
        "dtype": "fp32",
        "optimizer": "sgd",
    }
    inputs = resolve_request({"name": name, "config": SMALL[family]}, cluster, fields).trace()
    # expert parallelism: as many of the scaled dp ranks as the suite plan's ep takes
    ep = min(big_plan.mesh.ep or 1, mesh[1])
    options = SearchOptions(
        mesh=mesh,
        ep=ep,
        schedules=(big_plan.schedule.name,),
        zero_stages=(first.zero,),
        checkpointing=(first.activation_checkpointing,),
        layouts=layout_kinds(big_plan.tp_layout, big_plan.sequence_parallel),
        microbatch_sizes=(MICRO_BATCH,),
    )
    result = search(inputs, options)
    small = result.plan
    matched, total = 0, sum(len(st.shardings) for st in small.stages)
    if big_plan.tp_layout == "per_node":
        names, matched, total = transplant(small, big_plan)
        small = replan(result, inputs, names)
    return small, {"matched": matched, "nodes": total}


def _config(plan) -> str:
    pp, dp, tp = plan.mesh.shape
    st = plan.stages[0]
    ckpt = " ckpt" if st.activation_checkpointing else ""
    v = plan.schedule.virtual_stages
    ep = f" (ep{plan.mesh.ep})" if plan.mesh.ep else ""
    return (
        f"pp{pp} dp{dp}{ep} tp{tp} {plan.schedule.name}{f' v{v}' if v > 1 else ''} "
        f"z{st.zero}{ckpt} {plan.tp_layout}"
    )


def _strategies(plan) -> list[str]:
    return sorted({f"{s.kind}:{s.strategy}" for st in plan.stages for s in st.shardings})


def main() -> None:
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--execute" in sys.argv:
        execute(names)
        return
    FIXTURES.mkdir(parents=True, exist_ok=True)
    rows = []
    for dtype, batch, cases in SUITES.values():
        for name, gpus in cases:
            if names and name not in names:
                continue
            t0 = time.perf_counter()
            try:
                big = search(suite_inputs(name, gpus, dtype, batch)).plan
            except Exception as err:  # a case that fits no configuration is recorded
                first = str(err).split(":")[0]
                rows.append({"model": name, "gpus": gpus, "error": first})
                continue
            small, match = scale(name, big)
            (FIXTURES / f"{name}.json").write_text(small.to_json())
            row = {
                "model": name,
                "gpus": gpus,
                "suite": _config(big),
                "executable": big.executable,
                "scaled": _config(small),
                "match": match,
                "strategies": _strategies(small),
                "seconds": time.perf_counter() - t0,
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    _report(rows)


def execute(names: list[str]) -> None:
    """Run every scaled plan (4 gloo processes, 3 steps): measured vs predicted step time."""
    from executor.local_ranks import run_local
    from planner.executable import plan_executor_mode
    from planner.plan import Plan

    text = header(
        "Alpa's suite plans scaled down: measured vs predicted step time",
        "python bench/suite_scaled.py --execute",
    )
    text += (
        "Each plan of tests/fixtures/suite_scaled/ run for 3 steps on this machine's gloo\n"
        "processes; measured: the slowest rank's mean of steps 2-3 (step 1 warms up);\n"
        "predicted: the plan's step time under the cpu-local profile (datasheet values, no\n"
        "graph-mode overhead modelled). Ledger: rank 0's collectives per kind and mesh axis\n"
        "(calls, bytes) and bytes held in the last step against the plan's\n"
        "(tests/executor/ledger_check.py): exact, or the axes where they differ. Activation\n"
        "peak: the worst rank's measured (executor.ledger.LiveBytes) against the plan's.\n\n"
        "| model | scaled plan | mode | measured s | predicted s | measured/predicted | ledger "
        "| activation peak |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    for path in sorted(FIXTURES.glob("*.json")):
        if names and path.stem not in names:
            continue
        plan = Plan.from_json(path.read_text())
        ranks = run_local(plan, steps=3, timeout_s=600)
        measured = max(sum(r["steps"][s]["time_s"] for s in (1, 2)) / 2 for r in ranks)
        predicted = plan.predicted.step_time_s
        text += (
            f"| {path.stem} | {_config(plan)} | {plan_executor_mode(plan)} | {measured:.3f} | "
            f"{predicted:.4f} | {measured / predicted:.1f} | {_ledger_outcome(plan, ranks)} "
            f"| {_activation_outcome(plan, ranks)} |\n"
        )
        print(path.stem, measured, predicted, file=sys.stderr, flush=True)
    write("suite_scaled_execute.md", text)


def _ledger_outcome(plan, ranks: list[dict]) -> str:
    """Rank 0's measured ledger against the plan's: "exact", or where it differs."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.executor.ledger_check import measured, predicted_for_rank

    comm, held = measured(ranks[0])
    want_comm, want_held = predicted_for_rank(plan, ranks[0]["rank"])
    axes = sorted({k[1] for k in set(comm) | set(want_comm) if comm.get(k) != want_comm.get(k)})
    parts = [f"differs on {', '.join(axes)}"] if axes else []
    if held != want_held:
        parts.append("held differs")
    return "; ".join(parts) or "exact"


def _activation_outcome(plan, ranks: list[dict]) -> str:
    from tests.executor.ledger_check import activation_errors

    return f"{max(activation_errors(plan, ranks).values(), key=abs):+.0%}"


def _report(rows: list[dict]) -> None:
    text = header(
        "Alpa's suite plans scaled down to 4 gloo processes",
        "python bench/suite_scaled.py",
    )
    text += (
        "Each suite plan (aws-p3.16xlarge, default search) with its schedule, ZeRO level,\n"
        "checkpointing, tp layout and per-node strategies on a small model (tests/fixtures/\n"
        "suite_scaled/, run against the single-process reference by\n"
        "tests/executor/test_suite_plans.py). 'matched': nodes whose sharding came from the\n"
        "suite plan (per-node layouts; Megatron layouts are re-derived).\n\n"
        "| model | GPUs | suite plan | executable | scaled plan | matched |\n"
        "|---|---|---|---|---|---|\n"
    )
    for r in rows:
        if "error" in r:
            text += f"| {r['model']} | {r['gpus']} | {r['error']} | - | - | - |\n"
            continue
        match = r["match"]
        text += (
            f"| {r['model']} | {r['gpus']} | {r['suite']} | {'yes' if r['executable'] else 'no'} "
            f"| {r['scaled']} | {match['matched']}/{match['nodes']} |\n"
        )
    write("suite_scaled.md", text)


if __name__ == "__main__":
    main()
