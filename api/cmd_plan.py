"""`autopar plan` and `autopar baseline`: the search and the baseline families."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from api.cli_common import (
    cluster_from_args,
    progress_bar,
    progress_printer,
    read_graph,
    resolve_model,
    training_settings,
)
from api.compare import describe
from api.render import human_bytes, plan_summary, table


def _planning_inputs(args: argparse.Namespace, say):
    """(graph at micro-batch 1, the same at 2 (None for a graph file), cluster, training,
    model ref, tokens per sample)."""

    from planner.estimate import model_ref
    from planner.tracing import trace_model

    cluster = cluster_from_args(args)
    if args.graph:
        graph, model = read_graph(args.graph)
        seq = args.seq or graph.data.seq
        return graph, None, cluster, training_settings(args, seq), model, seq
    resolved = resolve_model(args)
    seq = args.seq or resolved.default_seq
    training = training_settings(args, seq)
    say(f"tracing {resolved.name} (seq {seq}) on the meta device")
    graph = trace_model(resolved, 1, seq, training.dtype)
    second = trace_model(resolved, 2, seq, training.dtype)
    tokens = seq if resolved.family.tokens_per_sample else 1
    return graph, second, cluster, training, model_ref(resolved, seq), tokens


def cmd_plan(args: argparse.Namespace) -> int:
    from api.compare import baseline_entries
    from planner.search import NoFeasiblePlan, SearchOptions, pinned_options, search

    tty = sys.stderr.isatty() and not args.json
    say = progress_printer(tty)
    graph, second, cluster, training, model, tokens = _planning_inputs(args, say)
    options = SearchOptions(
        executable_only=args.executable_only,
        top_k=args.top_k,
        workers=args.workers,
        ilp_time_limit=args.time_limit,
        solver=args.solver,
        **pinned_options(
            args.mesh,
            args.schedule,
            args.zero,
            None if args.checkpointing is None else args.checkpointing == "on",
            args.microbatch_size,
        ),
    )
    try:
        result = search(
            graph,
            cluster,
            training,
            model,
            tokens_per_sample=tokens,
            options=options,
            progress=progress_bar(tty),
            second_trace=second,
        )
    except NoFeasiblePlan as err:
        print(
            "does not fit:\n" + "\n".join(f"- {line}" for line in err.explanation), file=sys.stderr
        )
        return 3
    plan = result.plan
    rows = []
    if not args.no_baselines:
        say("baselines")
        rows = baseline_entries(graph, second, cluster, training, model, tokens)
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
    from planner.baselines import baseline

    say = progress_printer(sys.stderr.isatty() and not args.json)
    graph, second, cluster, training, model, tokens = _planning_inputs(args, say)
    result = baseline(args.kind, graph, cluster, training, model, tokens, second)
    if result.plan is None:
        print(
            f"does not fit: no {args.kind} configuration fits in "
            f"{human_bytes(cluster.device.memory_bytes)} per device "
            f"({result.evaluated} evaluated)",
            file=sys.stderr,
        )
        return 3
    print(result.plan.to_json() if args.json else plan_summary(result.plan))
    return 0
