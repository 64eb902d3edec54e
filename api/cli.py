"""The `autopar` command line."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

from api.cli_common import (
    add_cluster_args,
    add_model_args,
    add_precision_args,
    add_training_args,
    count,
    flag_for,
    mesh_arg,
    planning_request,
    progress_printer,
    resolve_model,
    seconds,
    write_or_print,
)
from api.cmd_plan import cmd_baseline, cmd_plan
from api.cmd_profile import add_profile_parsers
from api.cmd_serve import cmd_serve
from api.cmd_shard import cmd_shard
from api.render import human_bytes, human_count, plan_summary, table
from planner.errors import AutoparError, InputError
from planner.limits import (
    MAX_DEVICES,
    MAX_DEVICES_PER_NODE,
    MAX_GLOBAL_BATCH,
    MAX_LAYERS,
    MAX_MICROBATCHES,
    MAX_SEQ,
)

MAX_STEPS = 10_000_000  # training steps of one run
WEEK_S = 7 * 24 * 3600.0  # the longest wait any timeout here may ask for

# --- model inputs ----------------------------------------------------------------------


# --- commands ----------------------------------------------------------------------------
def cmd_models(args: argparse.Namespace) -> None:
    from planner.models import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        table(
            ["model", "family", "params", "config"],
            [
                [
                    r["name"],
                    r["family"],
                    human_count(r["params"]),
                    " ".join(f"{k}={v}" for k, v in r["config"].items() if v is not None),
                ]
                for r in rows
            ],
        )
    )


def _peak(profile) -> float:
    return max(profile.device.peak_flops.get(k, 0) for k in ("bf16", "fp16", "fp32"))


def cmd_clusters(args: argparse.Namespace) -> None:
    from planner.cluster.profile import bundled_names, load_cluster

    profiles = [load_cluster(n) for n in bundled_names()]
    if args.json:
        print(json.dumps([p.model_dump(mode="json") for p in profiles], indent=2))
        return
    print(
        table(
            [
                "cluster",
                "devices",
                "device",
                "memory",
                "bf16/fp16 peak",
                "intra-node",
                "inter-node",
            ],
            [
                [
                    p.name,
                    f"{p.nodes}x{p.devices_per_node}",
                    p.device.name,
                    human_bytes(p.device.memory_bytes),
                    f"{_peak(p) / 1e12:.1f} TF/s",
                    f"{p.links.intra_node.bandwidth / 1e9:.1f} GB/s",
                    f"{p.links.inter_node.bandwidth / 1e9:.2f} GB/s/node",
                ]
                for p in profiles
            ],
        )
    )


def _load_factory(target: str):
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise InputError("target", f"{target!r} is not module:function", "pkg.module:factory")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise InputError("target", f"cannot import {module_name!r}: {err}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise InputError("target", f"{module_name} has no callable {attr!r}")
    return factory


def cmd_trace(args: argparse.Namespace) -> None:
    from planner.graph.tracing import trace, trace_model
    from planner.models import TrainingModule, torch_dtype
    from planner.models.registry import lm_inputs, lm_loss

    say = progress_printer(sys.stderr.isatty())
    if args.target:
        import torch

        factory = _load_factory(args.target)
        dtype = torch_dtype(args.dtype, "--dtype")
        with torch.device("meta"):
            model = factory().to(dtype)
        if hasattr(model, "example_inputs"):
            inputs, module = tuple(model.example_inputs(args.batch, args.seq)), model
        else:  # language-model convention: token ids in, logits out, cross-entropy loss
            module = TrainingModule(model, lm_loss)
            inputs = lm_inputs(None, args.batch, args.seq, dtype, "meta")
        graph = trace(
            module,
            inputs,
            name=args.target,
            seq=args.seq,
            strip_prefix="" if hasattr(model, "example_inputs") else "model.",
            progress=say,
        )
    else:
        resolved = resolve_model(args)
        graph = trace_model(resolved, args.batch, args.seq, args.dtype, progress=say)
    write_or_print(graph.to_json(indent=None), args.output)
    s = graph.summary()
    print(
        f"{s['model']}: {s['nodes']} nodes, {s['layers']} layers, "
        f"{human_count(s['params'])} params, "
        f"{(s['fwd_flops'] + s['bwd_flops']) / 1e12:.1f} TFLOP per step of batch {args.batch}",
        file=sys.stderr,
    )


def cmd_estimate(args: argparse.Namespace) -> None:
    from planner.evaluate.config import ParallelConfig
    from planner.evaluate.predict import predict
    from planner.evaluate.to_plan import to_plan

    started = time.perf_counter()
    say = progress_printer(sys.stderr.isatty() and not args.json)
    request = planning_request(args)
    config = ParallelConfig(
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        microbatches=args.microbatches,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        zero=args.zero,
        checkpointing=args.checkpointing,
    )
    training = request.training
    config.validate(request.cluster, training.global_batch_size, request.layers)
    mbs = config.microbatch_size(training.global_batch_size)
    inputs = request.trace(batches=(mbs,), say=say)
    say("evaluating")
    graph = inputs.at(mbs)
    plan = to_plan(
        predict(graph, inputs.cluster, training, config),
        graph,
        inputs.cluster,
        training,
        inputs.model,
        tokens_per_sample=inputs.tokens_per_sample,
        started=started,
    )
    if args.output:
        Path(args.output).write_text(plan.to_json() + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    print(plan.to_json() if args.json else plan_summary(plan))


# --- parser ------------------------------------------------------------------------------
def cmd_execute(args: argparse.Namespace) -> int:
    from executor.launch import execute
    from planner.plan import Plan

    try:
        plan = Plan.from_json(Path(args.plan).read_text())
    except OSError as err:
        raise InputError("plan", f"cannot read {args.plan}: {err.strerror}") from None
    if not plan.executable:
        raise InputError(
            "plan.executable",
            "this plan uses strategies or a model family the executor cannot run yet",
            "a plan from `autopar plan --executable-only` or `autopar estimate`",
        )
    out = args.out or str(Path(args.plan).with_suffix("")) + "-run"
    result = execute(
        args.plan,
        out,
        steps=args.steps,
        nproc_per_node=args.nproc_per_node,
        lr=args.lr,
        seed=args.seed,
        timeout_s=args.timeout,
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
                    f"{result.predicted_step_s:.4f} s",
                ],
                [
                    "memory",
                    f"peak RSS {human_bytes(result.measured_peak_rss_bytes)}, predicted "
                    f"{human_bytes(result.predicted_peak_bytes)} per device",
                ],
            ]
        for rank, run in sorted(result.ranks.items()):
            losses = [s["loss"] for s in run["steps"] if s["loss"] is not None]
            rows.append([f"rank {rank}", "ok" + (f", loss {losses[-1]:.4f}" if losses else "")])
        for rank, error in sorted(result.errors.items()):
            mark = " (cause)" if rank == result.failed_rank else ""
            rows.append([f"rank {rank}{mark}", error.strip().splitlines()[0][:120]])
        print(table(["execution", ""], rows))
        print(f"results in {out}/result.json")
    if result.status != "succeeded":
        print(
            f"error: execution {result.status}; rank {result.failed_rank} failed first",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_launch_script(args: argparse.Namespace) -> int:
    from executor.launch_scripts import write_launch_files
    from planner.plan import Plan

    try:
        plan = Plan.from_json(Path(args.plan).read_text())
    except OSError as err:
        raise InputError("plan", f"cannot read {args.plan}: {err.strerror}") from None
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar", description="Auto-parallelism planner for PyTorch training."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("models", help="list the model zoo")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("clusters", help="list the bundled cluster profiles")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_clusters)

    p = sub.add_parser("trace", help="trace a model into an OpGraph JSON (on the meta device)")
    p.add_argument("target", nargs="?", help="pkg.module:factory returning an nn.Module")
    add_model_args(p, graph=False)
    p.add_argument("--batch", type=count(1, MAX_GLOBAL_BATCH), default=1)
    p.add_argument("--seq", type=count(1, MAX_SEQ), default=None)
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("-o", "--output", help="write the graph here instead of stdout")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("estimate", help="evaluate a hand-written dp x tp x pp configuration")
    add_model_args(p)
    add_training_args(p)
    p.add_argument("--dp", type=count(1, MAX_DEVICES), default=1)
    p.add_argument("--tp", type=count(1, MAX_DEVICES), default=1)
    p.add_argument("--pp", type=count(1, MAX_DEVICES), default=1)
    p.add_argument("--microbatches", type=count(1, MAX_MICROBATCHES), default=1)
    p.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing per layer"
    )
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage over dp")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved_1f1b"])
    p.add_argument("--virtual-stages", type=count(1, MAX_LAYERS), default=1)
    p.add_argument("--json", action="store_true", help="print the Plan JSON")
    p.add_argument("-o", "--output", help="also write the Plan JSON here")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("execute", help="run a plan locally with torchrun (gloo on CPU)")
    p.add_argument("plan", help="Plan JSON")
    p.add_argument("--steps", type=count(1, MAX_STEPS), default=3)
    p.add_argument(
        "--nproc-per-node",
        type=count(1, MAX_DEVICES_PER_NODE),
        help="default: the plan's device count",
    )
    p.add_argument("--lr", type=seconds(1e3), default=0.1, help="SGD learning rate")
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
    p.add_argument("--solver", default="highs", choices=["highs", "cbc"])
    p.add_argument("--time-limit", type=seconds(WEEK_S), default=60.0, help="solver time limit, s")
    p.add_argument("--no-dedup", action="store_true", help="solve every block separately")
    p.add_argument("--no-zero", action="store_true", help="no ZeRO-3 choices on the dp axis")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_shard)

    p = sub.add_parser("plan", help="search the best way to split training (the planner)")
    add_model_args(p)
    add_training_args(p)
    p.add_argument("-o", "--output", help="write the Plan JSON here")
    p.add_argument("--json", action="store_true", help="print the Plan JSON")
    p.add_argument("--top-k", type=count(1, 100), default=5, help="alternatives to keep")
    p.add_argument("--time-limit", type=seconds(WEEK_S), default=60.0, help="per ILP solve, s")
    p.add_argument("--solver", default="highs", choices=["highs", "cbc"])
    p.add_argument("--workers", type=count(1, 256), default=1, help="processes for ILP solves")
    p.add_argument("--no-baselines", action="store_true", help="skip the baseline comparison")
    p.add_argument("--html", help="write the plan viewer page (self-contained HTML) here")
    p.add_argument(
        "--executable-only",
        action="store_true",
        help="only strategies `autopar execute` can run today",
    )
    pin = p.add_argument_group("pin parts of the plan (default: searched)")
    pin.add_argument("--mesh", type=mesh_arg, metavar="PPxDPxTP", help="e.g. 2x2x1")
    pin.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved_1f1b"])
    pin.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="ZeRO stage on dp")
    pin.add_argument("--checkpointing", choices=["on", "off"], help="activation checkpointing")
    pin.add_argument(
        "--microbatch-size",
        type=count(1, MAX_GLOBAL_BATCH),
        metavar="N",
        help="samples per micro-batch",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("baseline", help="the best configuration of one baseline family")
    add_model_args(p)
    add_training_args(p)
    p.add_argument("--kind", required=True, choices=["megatron", "dp", "fsdp"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_baseline)

    add_profile_parsers(sub)

    p = sub.add_parser("serve", help="run the REST service (uvicorn)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=count(1, 65535), default=8000)
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback host without AUTOPAR_API_TOKENS",
    )
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except AutoparError as err:
        flag = flag_for(err.field) if isinstance(err, InputError) else None
        where = f" ({flag})" if flag and flag != err.field else ""
        text = f"{err.field}{where}: {str(err).split(': ', 1)[1]}" if where else str(err)
        print(f"error: {text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # an internal error: say so briefly, keep the trace for debugging
        if os.environ.get("AUTOPAR_DEBUG"):
            raise
        print(
            f"internal error: {type(err).__name__}: {err} (set AUTOPAR_DEBUG=1 for details)",
            file=sys.stderr,
        )
        return 1
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
