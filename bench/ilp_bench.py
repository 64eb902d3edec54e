"""Intra-op ILP size and speed: one GPT-39B block on each 8-GPU logical mesh, and the whole
48-block model as one stage with and without deduplication of identical blocks.
Targets (issue 3): each block solve under 1 s; the 48-block stage with dedup under 10 s.

Setting: dgx-a100-80g (one node, 8 x A100 80 GB), bf16, micro-batch 1, seq 1024 (Alpa's GPT
suite), 1 micro-batch per step. "strategies s" is building the strategy lists and their costs;
"build s" is building the model (arrays, planner/intra_op/ilp_model.py); "solve s" is HiGHS.

Run: python bench/ilp_bench.py   (writes bench/results/ilp.md)
"""

from __future__ import annotations

import sys
import time

from common import header, write

from planner.cluster.mesh import LogicalMesh
from planner.cluster.profile import load_cluster
from planner.cost.model import CostModel
from planner.graph.tracing import trace_model
from planner.intra_op.ilp import solve
from planner.intra_op.sharding_problem import ShardingProblem
from planner.models import ModelSpec, resolve

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]


def run(graph, nodes, shape, dedup, solver="highs"):
    cluster = load_cluster("dgx-a100-80g")
    mesh = LogicalMesh.contiguous(cluster, 0, shape)
    t0 = time.perf_counter()
    problem = ShardingProblem(graph, mesh, CostModel(cluster, "bf16"), nodes=nodes, dedup=dedup)
    strategies_s = time.perf_counter() - t0
    sol = solve(problem, solver=solver, time_limit=600)
    total = time.perf_counter() - t0
    st = sol.stats
    layout = sorted({s.name for n, s in sol.choices.items() if "mlp.fc1" in graph.node(n).module})
    return (
        f"| {'x'.join(map(str, shape))} | {st.nodes} | {st.unique_nodes} | {st.variables} | "
        f"{st.constraints} | {strategies_s:.2f} | {st.build_s:.2f} | {st.solve_s:.2f} | "
        f"{total:.2f} | {st.status} | {sol.objective_s * 1e3:.2f} | {', '.join(layout)} |"
    )


def main() -> None:
    head = (
        "| mesh (dp x tp) | nodes | ILP nodes | variables | constraints | strategies s | "
        "build s | solve s | total s | status | objective ms | fc1 strategy |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    block = trace_model(resolve(ModelSpec(name="gpt-39b", config={"layers": 1})), 1, 1024, "bf16")
    block_nodes = [n for n in block.nodes if n.layer == 0]
    rows = []
    for shape in MESHES:
        rows.append(run(block, block_nodes, shape, dedup=False))
        print(rows[-1], file=sys.stderr, flush=True)
    full = trace_model(resolve(ModelSpec(name="gpt-39b")), 1, 1024, "bf16")
    stage_rows = []
    for shape in MESHES:
        for dedup in (True, False):
            line = run(full, None, shape, dedup=dedup)
            stage_rows.append(line.replace("| ", f"| {'dedup' if dedup else 'full'} ", 1))
            print(stage_rows[-1], file=sys.stderr, flush=True)
    text = header("Intra-op ILP: size and solve time (GPT-39B)", "python bench/ilp_bench.py")
    text += "\n".join(
        [
            "Setting: dgx-a100-80g (8 x A100 80 GB, NVLink), bf16, micro-batch 1, seq 1024, "
            "HiGHS (highspy, model passed as arrays).",
            "",
            "## One GPT-39B block (its 24 operator nodes) on each 8-GPU logical mesh",
            "",
            head,
            *rows,
            "",
            "## The whole model (48 blocks + embeddings + head) as one stage",
            "",
            head.replace("| mesh", "| ILP | mesh").replace("|---|", "|---|---|", 1),
            *stage_rows,
            "",
        ]
    )
    write("ilp.md", text)


if __name__ == "__main__":
    main()
