"""`autopar plan` and `autopar baseline`: the search and the baseline families."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from api.cli_common import planning_request, progress_bar, progress_printer
from api.compare import describe
from api.render import human_bytes, plan_summary, table


def _search_options(args: argparse.Namespace):
    """The search flags as a request body's `search` (planner.request.search_options)."""
    from planner.request import search_options

    ckpt = None if args.checkpointing is None else args.checkpointing == "on"
    return search_options(
        {
            "executable_only": args.executable_only,
            "top_k": args.top_k,
            "mesh": args.mesh,
            "schedule": args.schedule,
            "zero": args.zero,
            "checkpointing": ckpt,
            "microbatch_size": args.microbatch_size,
            "workers": args.workers,
            "ilp_time_limit": args.time_limit,
            "solver": args.solver,
        }
    )


def cmd_plan(args: argparse.Namespace) -> int:
    from api.compare import baseline_entries
    from planner.search.search import NoFeasiblePlan, search

    tty = sys.stderr.isatty() and not args.json
    say = progress_printer(tty)
    options = _search_options(args)
    inputs = planning_request(args).trace(say=say)
    try:
        result = search(inputs, options, progress=progress_bar(tty))
    except NoFeasiblePlan as err:
        print(
            "does not fit:\n" + "\n".join(f"- {line}" for line in err.explanation), file=sys.stderr
        )
        return 3
    plan = result.plan
    rows = []
    if not args.no_baselines:
        say("baselines")
        rows = baseline_entries(inputs)
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
