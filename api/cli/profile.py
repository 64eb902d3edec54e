"""`autopar profile-cluster` and `autopar profile-ops`: measure the machine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from api.cli.common import (
    add_model_args,
    count,
    progress_bar,
    resolve_model,
)
from api.render import table
from planner.errors import InputError
from planner.limits import (
    MAX_DEVICES_PER_NODE,
    MAX_NODES,
    MAX_SEQ,
)
from planner.vocab import DTYPES


def add_profile_parsers(sub) -> None:
    p = sub.add_parser(
        "profile-cluster",
        help="time collectives, matmuls and memory with torchrun workers; write a profile",
    )
    p.add_argument("--nproc-per-node", type=count(1, MAX_DEVICES_PER_NODE), required=True)
    p.add_argument("--nnodes", type=count(1, MAX_NODES), default=1)
    p.add_argument("--node-rank", type=count(0, MAX_NODES - 1), default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=count(1, 65535), default=29511)
    p.add_argument("--base", default="cpu-local", help="profile whose device facts to start from")
    p.add_argument("--name", help="name of the written profile (default: BASE-measured)")
    p.add_argument("--repeats", type=count(1, 1000), default=5)
    p.add_argument(
        "--max-bytes", type=count(0, 2**40), default=0, help="largest message (default: all)"
    )
    p.add_argument("--dtypes", default="fp32", help="matmul dtypes, e.g. fp32,bf16")
    p.add_argument("--op-db", help="copy this operator database's rows into the profile")
    p.add_argument("-o", "--output", required=True, help="profile YAML to write")
    p.set_defaults(func=cmd_profile_cluster)

    p = sub.add_parser(
        "profile-executor",
        help="measure the executor's own overhead (FSDP, tensor and pipeline parallelism)",
    )
    p.add_argument("--cluster", required=True, help="profile to extend (e.g. profile-cluster's)")
    p.add_argument("--op-db", default="autopar-ops.db", help="operator database to use/extend")
    p.add_argument("-o", "--output", required=True, help="profile YAML to write")
    p.set_defaults(func=cmd_profile_executor)

    p = sub.add_parser("profile-ops", help="time a model's operators on this device")
    add_model_args(p, graph=False)
    p.add_argument("--seq", type=count(1, MAX_SEQ))
    p.add_argument("--batches", default="1,2", help="micro-batch sizes to trace and time")
    p.add_argument("--dtype", default="fp32", choices=DTYPES)
    p.add_argument("--cluster", default="cpu-local", help="profile whose device name keys rows")
    p.add_argument("--device", default="cpu", help="torch device to time on (cpu, cuda)")
    p.add_argument("--concurrency", type=count(1, 256), default=1, help="processes timing at once")
    p.add_argument("--threads", type=count(1, 1024), help="torch threads per process")
    p.add_argument("--repeats", type=count(1, 1000), default=10)
    p.add_argument("--db", default="autopar-ops.db", help="SQLite profile database")
    p.set_defaults(func=cmd_profile_ops)


def cmd_profile_cluster(args: argparse.Namespace) -> int:
    from executor.profile_cluster import profile_cluster
    from planner.cluster.profile import load_cluster

    for name in ("nproc_per_node", "nnodes", "repeats"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')}", f"{getattr(args, name)} < 1", ">= 1")
    base = load_cluster(args.base, field="--base")
    print(
        f"profiling {args.nnodes} x {args.nproc_per_node} processes (node {args.node_rank})",
        file=sys.stderr,
    )
    profile = profile_cluster(
        base,
        args.output,
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        repeats=args.repeats,
        max_bytes=args.max_bytes,
        dtypes=args.dtypes,
        name=args.name,
        op_db=args.op_db,
        say=lambda line: print(line, file=sys.stderr, flush=True),
    )
    if profile is None:
        return 0
    m = profile.measured
    rows = [
        [
            tier,
            name,
            f.group_size,
            f"{f.bandwidth / 1e9:.3f}",
            f"{f.latency * 1e6:.1f}",
            f"{f.rel_residual:.0%}",
        ]
        for tier, by in m.fits.items()
        for name, f in by.items()
    ]
    print(table(["tier", "collective", "group", "GB/s", "latency us", "fit residual"], rows))
    for dtype, rate in m.achieved_flops.items():
        print(f"matmul {dtype}: {rate / 1e9:.1f} GFLOP/s achieved per process")
    if m.memory_bandwidth:
        print(f"memory copy: {m.memory_bandwidth / 1e9:.1f} GB/s")
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def cmd_profile_ops(args: argparse.Namespace) -> int:
    from planner.cluster.profile import load_cluster
    from planner.cluster.profiling import (
        OpProfileDB,
        distinct_ops,
        profile_concurrently,
        profile_nodes,
    )
    from planner.graph.tracing import trace_model

    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise InputError("--batches", f"{args.batches!r}", "comma-separated integers") from None
    if any(b < 1 for b in batches) or args.concurrency < 1 or args.repeats < 1:
        raise InputError("--batches/--concurrency/--repeats", "must be >= 1")
    cluster = load_cluster(args.cluster)
    resolved = resolve_model(args)
    seq = args.seq or resolved.default_seq
    graphs = [trace_model(resolved, b, seq, args.dtype) for b in batches]
    nodes = distinct_ops(graphs)
    print(
        f"timing {len(nodes)} distinct operators of {resolved.name} (batches {batches}, seq "
        f"{seq}, {args.dtype}) on {args.device}"
        + (f", {args.concurrency} processes at once" if args.concurrency > 1 else ""),
        file=sys.stderr,
    )
    if args.concurrency > 1:
        rows = profile_concurrently(
            nodes, args.concurrency, args.device, args.repeats, args.threads or 1
        )
    else:
        rows = profile_nodes(
            nodes, args.device, args.repeats, args.threads, progress_bar(sys.stderr.isatty())
        )
    OpProfileDB(args.db).put(cluster.device.name, args.dtype, rows)
    total = sum(r["fwd_s"] + r["bwd_s"] for r in rows)
    print(
        f"{len(rows)} of {len(nodes)} operators timed (sum fwd+bwd {total * 1e3:.1f} ms); "
        f"stored in {Path(args.db)} under device {cluster.device.name!r}, dtype {args.dtype}"
    )
    return 0


def cmd_profile_executor(args: argparse.Namespace) -> int:
    import yaml

    from executor.overhead import calibrate
    from planner.cluster.profile import load_cluster

    profile = load_cluster(args.cluster)
    if profile.devices_per_node < 4 or profile.devices_per_node % 2:
        raise InputError(
            "--cluster",
            f"{profile.devices_per_node} devices per node",
            "an even number >= 4 (calibration runs tp 2 and pp 2 with data parallelism)",
        )
    result = calibrate(profile, args.op_db, say=lambda line: print(line, file=sys.stderr))
    o = result.measured.executor_overhead

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.2f}"

    print(
        table(
            ["executor overhead", "ms"],
            [
                ["FSDP, per layer per step", f"{o.fsdp_layer_step_s * 1e3:.2f}"],
                [
                    "tensor parallel, per layer per micro-batch",
                    f"{o.tp_layer_microbatch_s * 1e3:.2f}",
                ],
                ["pipeline, per micro-batch per stage", f"{o.pp_microbatch_s * 1e3:.2f}"],
            ],
        )
    )
    Path(args.output).write_text(
        yaml.safe_dump(result.model_dump(mode="json", exclude_none=True), sort_keys=False)
    )
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
