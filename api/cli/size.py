"""`autopar size`: plan a model on a sweep of cluster sizes and price the whole run on each;
and the run-time flags `autopar plan` shares (--train-tokens, --gpu-hour-price)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from api.cli.common import (
    add_executable_args,
    add_model_args,
    add_training_args,
    count,
    planning_request,
    progress_bar,
    progress_printer,
)
from api.render import table
from planner.errors import InputError
from planner.limits import MAX_NODES
from planner.units import human_count


def add_run_args(p: argparse.ArgumentParser) -> None:
    from planner.search.sizing import GOODPUT_HELP

    p.add_argument(
        "--train-tokens",
        metavar="TOKENS",
        help="tokens the whole run trains on (15T, 300B, 2e12): adds its wall-clock time, "
        "GPU-hours and (with --gpu-hour-price) cost",
    )
    p.add_argument(
        "--gpu-hour-price",
        type=float,
        metavar="PRICE",
        help="price of one GPU-hour, in your currency",
    )
    p.add_argument("--goodput", type=float, metavar="SHARE", help=GOODPUT_HELP.replace("%", "%%"))


def run_fields(args: argparse.Namespace):
    """The run asked by the flags (planner.search.sizing.RunAsked, None: none), checked."""
    from planner.search.sizing import read_run

    flags = ("--train-tokens", "--gpu-hour-price", "--goodput")
    return read_run(args.train_tokens, args.gpu_hour_price, "", fields=flags, goodput=args.goodput)


def cmd_size(args: argparse.Namespace) -> int:
    from api.cli.plan import search_options_from_args
    from api.sizing_chart import sizing_svg
    from planner.planning import size_request
    from planner.search.sizing import node_counts, parse_duration

    if args.nodes is not None:
        raise InputError("--nodes", "autopar size sweeps node counts", "--min-nodes/--max-nodes")
    run = run_fields(args)
    if run is None:
        raise InputError("--train-tokens", "missing", "the tokens the run trains on, e.g. 15T")
    if args.budget is not None and run.gpu_hour_price is None:
        raise InputError("--budget", "given without --gpu-hour-price", "a price to compare with")
    if args.budget is not None and not 0 < args.budget < 1e15:
        raise InputError("--budget", f"{args.budget}", "a positive amount")
    deadline = None if args.deadline is None else parse_duration(args.deadline, "--deadline")
    counts = node_counts(args.min_nodes, args.max_nodes, "--min-nodes/--max-nodes")
    tty = sys.stderr.isatty() and not args.json
    sizing = size_request(
        planning_request(args),
        search_options_from_args(args),
        counts,
        run,
        deadline_s=deadline,
        budget=args.budget,
        say=progress_printer(tty),
        progress=progress_bar(tty),
    )
    if args.output:
        Path(args.output).write_text(sizing.model_dump_json(indent=2) + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    if args.chart:
        Path(args.chart).write_text(sizing_svg(sizing) + "\n")
        print(f"wrote {args.chart}", file=sys.stderr)
    if args.json:
        print(sizing.model_dump_json(indent=2))
        return 0
    print(sizing_table(sizing))
    print("\n".join(f"- {line}" for line in sizing.explanation))
    return 0


def sizing_rows(sizing) -> tuple[list[str], list[list[object]]]:
    """The sizing's table (headers, rows) for the terminal and the sizing page."""
    money = sizing.gpu_hour_price is not None
    rows: list[list[object]] = []
    for r in sizing.rows:
        if not r.fits:
            rows.append([r.nodes, r.gpus, "does not fit", "-", "-", "-", "-", "-", "", r.summary])
            continue
        marks = []
        if r.nodes == sizing.cheapest_within_deadline:
            marks.append("cheapest in deadline")
        if r.nodes == sizing.fastest_within_budget:
            marks.append("fastest in budget")
        rows.append(
            [
                r.nodes,
                r.gpus,
                f"{r.step_time_s:.2f}",
                f"{human_count(r.tokens_per_s)}",
                f"{r.mfu:.0%}",
                f"{r.run.time_s / 86400:.1f}",
                f"{r.run.gpu_hours:,.0f}",
                f"{r.run.cost:,.0f}" if money else "-",
                ", ".join(marks),
                r.summary,
            ]
        )
    headers = [
        "nodes",
        "GPUs",
        "step s",
        "tokens/s",
        "MFU",
        "days",
        "GPU-hours",
        "cost",
        "",
        "plan",
    ]
    return headers, rows


def sizing_table(sizing) -> str:
    return table(*sizing_rows(sizing))


def add_parsers(sub) -> None:
    from api.cli.plan import add_pins

    p = sub.add_parser(
        "size", help="how many GPUs: plan on a sweep of cluster sizes, time and cost of the run"
    )
    add_model_args(p)
    add_training_args(p)
    add_run_args(p)
    p.add_argument("--min-nodes", type=count(1, MAX_NODES), default=1, help="smallest size")
    p.add_argument(
        "--max-nodes", type=count(1, MAX_NODES), default=16, help="largest size (doubling)"
    )
    p.add_argument("--deadline", metavar="TIME", help="the run must end within it: 30d, 12h")
    p.add_argument("--budget", type=float, help="the run must cost at most this much")
    p.add_argument("--chart", metavar="SVG", help="write the throughput and cost chart here")
    p.add_argument("--json", action="store_true", help="print the sizing as JSON")
    p.add_argument("-o", "--output", help="also write the sizing JSON here")
    p.add_argument("--workers", type=count(1, 256), default=None, help="planning processes")
    add_executable_args(p)
    p.add_argument("--top-k", type=count(1, 100), default=1, help=argparse.SUPPRESS)
    p.add_argument("--time-limit", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ilp-time-limit", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--solver", default="highs", help=argparse.SUPPRESS)
    add_pins(p.add_argument_group("pin parts of every plan (default: searched)"))
    p.set_defaults(func=cmd_size)
