"""`autopar plan` and `autopar baseline`: the search and the baseline families."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from api.cli.common import (
    WEEK_S,
    add_executable_args,
    add_model_args,
    add_training_args,
    count,
    mesh_arg,
    planning_request,
    progress_bar,
    progress_printer,
    seconds,
)
from api.cli.size import add_run_args, run_fields
from api.compare import describe
from api.render import human_bytes, plan_summary, table
from planner.pins import PINS
from planner.vocab import (
    BASELINE_KINDS,
    SOLVERS,
)

EXPORT_TARGETS = ("torchtitan", "megatron", "deepspeed")  # api.export.targets.TARGETS


def search_options_from_args(args: argparse.Namespace):
    """The search flags as a request body's `search` (planner.request.search_options)."""
    from planner.request import search_options
    from planner.search.space import default_workers

    pins = {pin.name: pin.from_cli(getattr(args, pin.name)) for pin in PINS}
    return search_options(
        {
            "executable_only": args.executable_only,
            "top_k": args.top_k,
            **pins,
            "workers": args.workers or default_workers(),
            "ilp_time_limit": args.ilp_time_limit,
            "time_limit": args.time_limit,
            "solver": args.solver,
        }
    )


def cmd_plan(args: argparse.Namespace) -> int:
    from api.compare import baseline_entries
    from planner.planning import NoFeasiblePlan, plan_request

    run = run_fields(args)
    tty = sys.stderr.isatty() and not args.json
    options = search_options_from_args(args)
    target = None
    if args.export_to:
        from api.export.targets import TARGETS, target_training

        args.runtime = target_training(args.export_to, {"runtime": args.runtime}, "--export-to")[
            "runtime"
        ]
        target = TARGETS[args.export_to]
    try:
        result = plan_request(
            planning_request(args),
            options,
            run=run,
            baselines=not args.no_baselines,
            say=progress_printer(tty),
            progress=progress_bar(tty),
            target=target,
        )
    except NoFeasiblePlan as err:
        heads = {"executable": "no executable plan", "time": "search cut"}
        heads["export"] = f"no plan {args.export_to} can express"
        head = {**heads, "schedule": "no schedule runs"}.get(err.reason, "does not fit")
        print(f"{head}:\n" + "\n".join(f"- {line}" for line in err.explanation), file=sys.stderr)
        return 3
    plan = result.plan
    rows = baseline_entries(result.baselines)
    if args.output:
        Path(args.output).write_text(plan.to_json() + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    if args.html:
        from api.viewer import render_page

        Path(args.html).write_text(render_page(plan, rows))
        print(f"wrote {args.html}", file=sys.stderr)
    if args.json:
        print(plan.to_json())
        return 0
    print(plan_summary(plan))
    if plan.alternatives:
        print(
            "\n"
            + table(
                ["alternative", "step s", "memory"],
                [
                    [a.summary, f"{a.step_time_s:.3f}", human_bytes(a.peak_memory_bytes)]
                    for a in plan.alternatives
                ],
            )
        )
    if rows:
        print("\n" + _baseline_table(plan, rows))
    s = plan.search
    print(
        f"\nsearch {s.time_s:.1f} s: {s.candidates_evaluated} configurations evaluated, "
        f"{s.ilp_calls} ILP solves (largest {s.ilp_max_vars} variables)"
    )
    return 0


def _baseline_table(plan, rows) -> str:
    out = [
        [
            "autopar plan",
            f"{plan.predicted.step_time_s:.3f}",
            f"{plan.predicted.tflops_per_device:.1f}",
            "1.00x",
            describe(plan),
        ]
    ]
    for b in rows:
        if not b["fits"]:
            out.append([f"{b['kind']} (best)", "does not fit", "-", "-", "-"])
            continue
        ratio = b["step_time_s"] / plan.predicted.step_time_s
        out.append(
            [
                f"{b['kind']} (best)",
                f"{b['step_time_s']:.3f}",
                f"{b['tflops_per_device']:.1f}",
                _versus(ratio),
                b["summary"],
            ]
        )
    return table(["configuration", "step s", "TFLOP/s/dev", "vs plan", "mesh"], out)


def _versus(ratio: float) -> str:
    if abs(ratio - 1) < 0.005:
        return "same"
    return f"{ratio:.2f}x slower" if ratio > 1 else f"{1 / ratio:.2f}x faster"


def cmd_baseline(args: argparse.Namespace) -> int:
    from planner.search.baselines import baseline

    say = progress_printer(sys.stderr.isatty() and not args.json)
    inputs = planning_request(args).trace(say=say)
    result = baseline(args.kind, inputs)
    if result.plan is None:
        print(
            f"does not fit: no {args.kind} configuration fits in "
            f"{human_bytes(inputs.cluster.device.memory_bytes)} per device "
            f"({result.evaluated} evaluated)",
            file=sys.stderr,
        )
        return 3
    print(result.plan.to_json() if args.json else plan_summary(result.plan))
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("plan", help="search the best way to split training (the planner)")
    add_model_args(p)
    add_training_args(p)
    p.add_argument("-o", "--output", help="write the Plan JSON here")
    p.add_argument("--json", action="store_true", help="print the Plan JSON")
    p.add_argument("--top-k", type=count(1, 100), default=5, help="alternatives to keep")
    p.add_argument(
        "--time-limit",
        type=seconds(WEEK_S),
        default=None,
        help="stop the search after S seconds and return the best plan found so far "
        "(the plan says it was cut); default: no limit",
    )
    p.add_argument("--ilp-time-limit", type=seconds(WEEK_S), default=60.0, help="per ILP solve, s")
    p.add_argument("--solver", default="highs", choices=SOLVERS)
    p.add_argument(
        "--workers",
        type=count(1, 256),
        default=None,
        help="processes for ILP solves and cost tables (default: one per CPU core, up to 8)",
    )
    p.add_argument("--no-baselines", action="store_true", help="skip the baseline comparison")
    add_run_args(p)
    p.add_argument("--html", help="write the plan viewer page (self-contained HTML) here")
    p.add_argument(
        "--export-to",
        choices=EXPORT_TARGETS,
        help="the best plan this framework can express (for `autopar export --to`), predicted "
        "for its runtime; the explanation says how much faster the best plan without that "
        "restriction would be",
    )
    add_executable_args(p)
    add_pins(p.add_argument_group("pin parts of the plan (default: searched)"))
    p.set_defaults(func=cmd_plan)
    _add_baseline_parser(sub)


def add_pins(pin) -> None:
    """One flag per pin of planner.pins."""
    for p in PINS:
        if p.kind == "mesh":
            pin.add_argument(p.flag, type=mesh_arg, metavar=p.metavar, help=p.help)
        elif p.kind == "count":
            pin.add_argument(p.flag, type=count(p.low, p.high), metavar=p.metavar, help=p.help)
        elif p.kind == "choice" and all(type(c) is int for c in p.choices):
            pin.add_argument(p.flag, type=int, choices=p.choices, help=p.help)
        else:
            pin.add_argument(p.flag, choices=p.cli_choices(), help=p.help)


def _add_baseline_parser(sub) -> None:
    p = sub.add_parser("baseline", help="the best configuration of one baseline family")
    add_model_args(p)
    add_training_args(p)
    p.add_argument("--kind", required=True, choices=BASELINE_KINDS)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_baseline)
