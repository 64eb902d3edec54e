"""`autopar execute` (a plan on local torchrun ranks) and `autopar launch-script`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from api.cli.common import (
    MAX_STEPS,
    WEEK_S,
    count,
    seconds,
)
from api.render import human_bytes, table, versus_prediction
from planner.errors import InputError
from planner.limits import (
    MAX_DEVICES_PER_NODE,
)


def cmd_execute(args: argparse.Namespace) -> int:
    from executor.launch import execute
    from planner.plan import Plan

    try:
        plan = Plan.from_json(Path(args.plan).read_text())
    except OSError as err:
        raise InputError("plan", f"cannot read {args.plan}: {err.strerror}") from None
    check_runnable(plan)
    out = args.out or str(Path(args.plan).with_suffix("")) + "-run"
    result = execute(
        args.plan,
        out,
        steps=args.steps,
        nproc_per_node=args.nproc_per_node,
        lr=args.lr,
        seed=args.seed,
        timeout_s=args.timeout,
        max_grad_norm=args.max_grad_norm,
        data=args.data,
        model=args.model,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
    )
    summary = result.summary()
    Path(out, "result.json").write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        rows = [["status", result.status], ["wall time", f"{result.wall_s:.1f} s"]]
        if result.measured_step_s is not None:
            rows += [
                [
                    "step time",
                    f"measured {result.measured_step_s:.4f} s, predicted "
                    f"{result.predicted_step_s:.4f} s "
                    f"({versus_prediction(result.predicted_step_s, result.measured_step_s)})",
                ],
                ["memory", _memory_text(result)],
            ]
        for rank, run in sorted(result.ranks.items()):
            losses = [s["loss"] for s in run["steps"] if s["loss"] is not None]
            rows.append([f"rank {rank}", "ok" + (f", loss {losses[-1]:.4f}" if losses else "")])
        rows += error_rows(result.errors, result.failed_rank)
        print(table(["execution", ""], rows))
        if 0 in result.ranks and "ledger" in result.ranks[0]["steps"][-1]:
            print(
                table(["rank 0, one step", "predicted", "measured", ""], ledger_rows(plan, result))
            )
        cause = result.errors.get(result.failed_rank, "").strip()
        if len(cause.splitlines()) > 1:  # the table shows each error's first line
            print(f"rank {result.failed_rank}:\n{cause}", file=sys.stderr)
        print(f"results in {out}/result.json")
    if result.status != "succeeded":
        print(
            f"error: execution {result.status}; rank {result.failed_rank} failed first",
            file=sys.stderr,
        )
        return 1
    return 0


def ledger_rows(plan, result) -> list[list[str]]:
    """Rank 0's ledger (planner.evaluate.ledger, executor.ledger): each collective kind on
    each mesh axis (calls, bytes) and the bytes held, predicted beside measured."""
    from planner.evaluate.ledger import rank_ledger

    want_comm, want_held = rank_ledger(plan, 0)
    measured = result.ranks[0]["steps"][-1]["ledger"]
    got_comm = {(e["kind"], e["axis"]): (e["calls"], e["bytes"]) for e in measured["comm"]}
    # routed entries (dropless expert dispatch): the plan's bytes are the ep group's mean
    routed = {(e.kind, e.axis) for st in plan.stages for e in st.predicted.ledger.comm if e.routed}
    rows = []
    for key in sorted(set(want_comm) | set(got_comm)):
        want, got = want_comm.get(key, (0, 0)), got_comm.get(key, (0, 0))
        same = want[0] == got[0] if key in routed else want == got
        rows.append(
            [
                f"{key[0]} on {key[1]}" + (" (bytes: the group's mean)" if key in routed else ""),
                f"{want[0]} x, {human_bytes(want[1])}",
                f"{got[0]} x, {human_bytes(got[1])}",
                "=" if same else "differs",
            ]
        )
    for kind, want in want_held.items():
        got = measured["held"].get(kind, 0)
        rows.append(
            [f"{kind} held", human_bytes(want), human_bytes(got), "=" if want == got else "differs"]
        )
    if "activation_peak" in measured:  # the tensors the step makes, not exact (executor.ledger)
        want = next(st.predicted.memory.activations for st in plan.stages if 0 in st.ranks)
        got = measured["activation_peak"]
        rows.append(
            [
                "activation peak",
                human_bytes(want),
                human_bytes(got),
                versus_prediction(want, got),
            ]
        )
    return rows


def _memory_text(result) -> str:
    """The prediction beside what compares with it: the allocator's peak on a GPU; on a CPU
    the resident memory the run added to each process (torch itself and the process group
    are there before the model and are not part of the plan's figure)."""
    predicted = f"predicted {human_bytes(result.predicted_peak_bytes)} per device"
    if result.measured_memory_kind == "allocator peak":
        return f"{predicted}, allocator peak {human_bytes(result.measured_run_memory_bytes)}"
    if result.measured_memory_kind == "rss growth":
        return (
            f"{predicted}, the run added {human_bytes(result.measured_run_memory_bytes)} "
            f"to each process's RSS (peak RSS {human_bytes(result.measured_peak_rss_bytes)})"
        )
    return f"{predicted}, peak RSS {human_bytes(result.measured_peak_rss_bytes)}"


def error_rows(errors: dict[int, str], failed_rank: int | None) -> list[list[str]]:
    """One row per failed rank with its error's first line, whole (the cause's other lines
    follow the table)."""
    rows = []
    for rank, error in sorted(errors.items()):
        mark = " (cause)" if rank == failed_rank else ""
        lines = error.strip().splitlines() or [""]
        rows.append([f"rank {rank}{mark}", lines[0]])
    return rows


def check_runnable(plan) -> None:
    """The plan is one autopar's executor runs, here or on a cluster (execution_refusal)."""
    from planner.executable import execution_refusal

    if refused := execution_refusal(plan):
        raise InputError(
            f"plan.{refused[0]}",
            refused[1],
            "a plan from `autopar plan` (without --allow-non-executable) or `autopar estimate`",
        )


def cmd_launch_script(args: argparse.Namespace) -> int:
    from executor.launch_scripts import write_launch_files
    from planner.plan import Plan

    try:
        plan = Plan.from_json(Path(args.plan).read_text())
    except OSError as err:
        raise InputError("plan", f"cannot read {args.plan}: {err.strerror}") from None
    check_runnable(plan)  # the job runs autopar's executor on the cluster
    paths = write_launch_files(
        plan,
        args.target,
        args.plan_path or Path(args.plan).name,
        args.output,
        steps=args.steps,
        image=args.image,
    )
    for path in paths:
        print(f"wrote {path}")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("execute", help="run a plan locally with torchrun (gloo on CPU)")
    p.add_argument("plan", help="Plan JSON")
    p.add_argument("--steps", type=count(1, MAX_STEPS), default=3)
    p.add_argument(
        "--nproc-per-node",
        type=count(1, MAX_DEVICES_PER_NODE),
        help="default: the plan's device count",
    )
    p.add_argument(
        "--lr", type=seconds(1e3), default=None, help="learning rate (default: the optimizer's)"
    )
    p.add_argument(
        "--max-grad-norm", type=seconds(1e6), default=1.0, help="clip the global gradient L2 norm"
    )
    p.add_argument(
        "--data",
        metavar="PKG.MODULE:FUNCTION",
        help="your data factory (executor/data.py); default: synthetic tokens",
    )
    p.add_argument(
        "--model",
        metavar="PKG.MODULE:FUNCTION",
        help="your model factory, for a plan made from `autopar trace` of it (imported here)",
    )
    p.add_argument("--seed", type=count(0, 2**32 - 1), default=0)
    p.add_argument("--timeout", type=seconds(WEEK_S), default=300.0, help="whole run, s")
    p.add_argument("--out", help="result folder (default: PLAN-run next to the plan)")
    p.add_argument("--checkpoint-dir", help="save sharded checkpoints (torch DCP) here")
    p.add_argument(
        "--checkpoint-every", type=count(0, MAX_STEPS), default=0, help="steps between saves"
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest save")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_execute)

    p = sub.add_parser("launch-script", help="render Slurm / Kubernetes launch files for a plan")
    p.add_argument("plan", help="Plan JSON")
    p.add_argument("--target", required=True, choices=["slurm", "k8s", "all"])
    p.add_argument("-o", "--output", required=True, help="folder for the files")
    p.add_argument("--plan-path", help="where the plan lives on the cluster (default: its name)")
    p.add_argument("--steps", type=count(1, MAX_STEPS), default=100)
    p.add_argument("--image", default="autopar:latest", help="container image (k8s)")
    p.set_defaults(func=cmd_launch_script)
