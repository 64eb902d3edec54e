"""`autopar export PLAN --to torchtitan|megatron|deepspeed`: the plan as another framework's
configuration (api/export)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from api.cli.common import write_or_print
from planner.errors import InputError


def cmd_export(args: argparse.Namespace) -> int:
    from api.export import EXPORTERS, ExportError, megatron
    from planner.plan import Plan

    try:
        plan = Plan.from_json(Path(args.plan).read_text())
    except OSError as err:
        raise InputError("plan", f"cannot read {args.plan}: {err.strerror}") from None
    try:
        text = EXPORTERS[args.to](plan)
    except ExportError as err:
        raise InputError(f"plan.{err.field}", str(err).split(": ", 1)[1]) from None
    write_or_print(text.rstrip("\n"), args.output)
    if args.to == "megatron" and (env := megatron.environment(plan)):
        settings = " ".join(f"{k}={v}" for k, v in env.items())
        print(f"run Megatron-LM with {settings} in its environment", file=sys.stderr)
    print(prediction_note(plan, args.to), file=sys.stderr)
    return 0


def prediction_note(plan, target: str) -> str:
    """What autopar predicts for the exported run: the plan's step time and peak memory,
    which are the target's where the plan was made for it (--runtime)."""
    runtime = plan.request.training.runtime
    p = plan.predicted
    figures = (
        f"{p.step_time_s:.3f} s per step, peak {p.peak_memory_bytes / 2**30:.1f} GiB per device"
    )
    if runtime == target:  # its memory layout and ZeRO levels; kernel rates are autopar's
        return f"autopar predicts for {target}: {figures} ({target}'s memory layout)"
    return (
        f"autopar predicts {figures} for {runtime}, not {target}: {target} lays out memory "
        f"otherwise (planner/runtime/{target}.py); plan with --runtime {target} for its figures"
    )


def add_parsers(sub) -> None:
    from api.export import EXPORTERS

    p = sub.add_parser(
        "export", help="write a plan as a torchtitan TOML, Megatron-LM arguments or DeepSpeed JSON"
    )
    p.add_argument("plan", help="Plan JSON")
    p.add_argument("--to", required=True, choices=sorted(EXPORTERS))
    p.add_argument("-o", "--output", help="write here instead of stdout")
    p.set_defaults(func=cmd_export)
