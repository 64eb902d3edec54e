"""`autopar shard`: the intra-operator ILP for one stage on one mesh."""

from __future__ import annotations

import argparse
import json
import sys

from api.cli.common import (
    WEEK_S,
    add_cluster_args,
    add_model_args,
    add_precision_args,
    cluster_from_args,
    count,
    progress_printer,
    read_graph,
    resolve_model,
    seconds,
)
from api.render import human_bytes, table
from planner.errors import InputError
from planner.limits import (
    MAX_GLOBAL_BATCH,
    MAX_MICROBATCHES,
    MAX_SEQ,
)
from planner.vocab import SOLVERS


def _mesh_shape(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise InputError("--mesh", f"{text!r} is not DPxTP", "two positive integers, e.g. 1x8")
    return int(parts[0]), int(parts[1])


def _layer_range(text: str | None, num_layers: int) -> tuple[int, int]:
    if not text:
        return 0, num_layers
    a, sep, b = text.partition(":")
    try:
        start = int(a) if a else 0
        end = int(b) if b else num_layers
    except ValueError:
        raise InputError("--layers", f"{text!r} is not start:end", "e.g. 0:4") from None
    if not sep or not 0 <= start < end <= num_layers:
        raise InputError(
            "--layers", f"{text!r} is not a range inside [0, {num_layers})", "start:end"
        )
    return start, end


def cmd_shard(args: argparse.Namespace) -> int:

    from planner.cluster.mesh import LogicalMesh
    from planner.cost.model import CostModel
    from planner.graph.batch import rescale_batch
    from planner.graph.tracing import trace_model
    from planner.intra_op.ilp import solve
    from planner.intra_op.ilp_report import solution_to_dict
    from planner.intra_op.sharding_problem import InfeasibleError, ShardingProblem
    from planner.request import default_dtype

    say = progress_printer(sys.stderr.isatty() and not args.json)
    cluster = cluster_from_args(args)
    dtype = args.dtype or default_dtype(cluster)
    dp, tp = _mesh_shape(args.mesh)
    if dp * tp > cluster.num_devices:
        raise InputError(
            "--mesh", f"{dp}x{tp} needs {dp * tp} devices, the cluster has {cluster.num_devices}"
        )
    if args.graph:
        graph = rescale_batch(read_graph(args.graph), args.batch)
    else:
        resolved = resolve_model(args)
        say(f"tracing {resolved.name}")
        graph = trace_model(resolved, args.batch, args.seq, dtype, progress=say)
    start, end = _layer_range(args.layers, max(graph.num_layers, 1))
    first = next((i for i, n in enumerate(graph.nodes) if n.layer is not None), 0)
    nodes = [
        n
        for i, n in enumerate(graph.nodes)
        if (n.layer is not None and start <= n.layer < end)
        or (
            n.layer is None
            and ((i < first and start == 0) or (i > first and end == graph.num_layers))
        )
        or graph.num_layers == 0
    ]
    mesh = LogicalMesh.contiguous(cluster, 0, (dp, tp))
    cm = CostModel(cluster, dtype, attention=args.attention)
    budget = args.memory_budget * 2**30 if args.memory_budget else None
    say("building strategies")
    problem = ShardingProblem(
        graph,
        mesh,
        cm,
        nodes=nodes,
        microbatches=args.microbatches,
        memory_budget=budget,
        optimizer=args.optimizer,
        dedup=not args.no_dedup,
        zero=0 if args.no_zero else 3,
    )
    say("solving")
    try:
        solution = solve(problem, args.solver, args.time_limit)
    except InfeasibleError as err:
        print("infeasible:\n" + "\n".join(f"- {line}" for line in err.explanation), file=sys.stderr)
        return 3
    data = solution_to_dict(problem, solution)
    print(json.dumps(data, indent=2) if args.json else _shard_summary(data))
    return 0


def _shard_summary(data: dict) -> str:
    rows = []
    for n in data["nodes"]:
        if n["kind"] in ("reshape", "constant", "input") and not n["reshard_in_s"]:
            continue
        rows.append(
            [
                n["node"],
                n["module"] or "-",
                n["kind"],
                n["strategy"],
                f"{n['compute_s'] * 1e3:.3f}",
                f"{n['comm_s'] * 1e3:.3f}",
                f"{n['grad_sync_s'] * 1e3:.3f}",
                f"{n['reshard_in_s'] * 1e3:.3f}",
                human_bytes(n["saved_bytes"]),
            ]
        )
    s = data["solver"]
    mem = data["memory"]
    shape = "x".join(map(str, data["mesh"]["shape"]))
    axes = ", ".join(data["mesh"]["axis_names"])
    gap = s["gap"] if s["gap"] is not None else "unknown"
    lines = [
        table(
            [
                "node",
                "module",
                "kind",
                "strategy",
                "compute ms",
                "comm ms",
                "grad sync ms",
                "reshard in ms",
                "saved/device",
            ],
            rows,
        ),
        "",
        f"mesh {shape} ({axes}); "
        f"objective {data['objective_s'] * 1e3:.3f} ms per micro-batch: "
        + ", ".join(
            f"{k.removesuffix('_s')} {v * 1e3:.3f} ms" for k, v in data["breakdown"].items()
        ),
        f"memory per device {human_bytes(mem['total'])} of {human_bytes(data['memory_budget'])}: "
        + ", ".join(f"{k} {human_bytes(v)}" for k, v in mem.items() if k != "total"),
        f"solver {s['name']}: {s['status']}, gap {gap}, "
        f"{s['variables']} variables, {s['constraints']} constraints, build {s['build_s']:.2f} s, "
        f"solve {s['solve_s']:.2f} s; {s['nodes']} nodes, {s['unique_nodes']} after deduplicating "
        f"{s['dedup_groups']} group(s) of identical blocks",
    ]
    return "\n".join(lines)


def add_parsers(sub) -> None:
    p = sub.add_parser("shard", help="solve the sharding ILP for one stage on one mesh")
    add_model_args(p)
    add_cluster_args(p)
    p.add_argument("--mesh", required=True, help="logical mesh DPxTP, e.g. 1x8 or 2x4")
    p.add_argument("--layers", help="layer range start:end (default: the whole model)")
    p.add_argument("--batch", type=count(1, MAX_GLOBAL_BATCH), default=1, help="micro-batch size")
    p.add_argument("--seq", type=count(1, MAX_SEQ))
    p.add_argument(
        "--microbatches",
        type=count(1, MAX_MICROBATCHES),
        default=1,
        help="spreads per-step gradient sync",
    )
    add_precision_args(p)
    p.add_argument(
        "--memory-budget", type=seconds(2**20), help="GiB per device (default: device memory)"
    )
    p.add_argument("--solver", default="highs", choices=SOLVERS)
    p.add_argument("--time-limit", type=seconds(WEEK_S), default=60.0, help="solver time limit, s")
    p.add_argument("--no-dedup", action="store_true", help="solve every block separately")
    p.add_argument("--no-zero", action="store_true", help="no ZeRO-3 choices on the dp axis")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_shard)
