"""The `autopar` command line."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from api.render import human_bytes, human_count, plan_summary, table
from planner.errors import AutoparError, InputError


def _progress(enabled: bool) -> Callable[[str], None]:
    started = time.perf_counter()

    def say(step: str) -> None:
        if enabled:
            print(f"  [{time.perf_counter() - started:5.1f}s] {step}", file=sys.stderr, flush=True)

    return say


def _write_or_print(text: str, output: str | None) -> None:
    if output:
        Path(output).write_text(text + "\n")
        print(f"wrote {output}", file=sys.stderr)
    else:
        print(text)


# --- model inputs ----------------------------------------------------------------------
def _add_model_args(p: argparse.ArgumentParser, graph: bool = True) -> None:
    g = p.add_argument_group("model (one of)")
    g.add_argument("--model", help="zoo model name (see `autopar models`)")
    g.add_argument("--hf-config", help="Hugging Face config.json of a Llama-family model")
    if graph:
        g.add_argument("--graph", help="OpGraph JSON written by `autopar trace`")
    g.add_argument(
        "--config", nargs="*", metavar="KEY=VALUE", help="override model parameters: layers=12"
    )


def _resolve_model(args: argparse.Namespace):
    from planner.models import ModelSpec, resolve
    from planner.models.config import parse_key_values
    from planner.models.hf_config import load_hf_config

    overrides = parse_key_values(args.config)
    if args.hf_config:
        return resolve(ModelSpec(hf_config=load_hf_config(args.hf_config), config=overrides))
    if not args.model:
        raise InputError("--model", "missing", "a zoo model name, --hf-config or --graph")
    return resolve(ModelSpec(name=args.model, config=overrides))


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
    from planner.cluster import bundled_names, load_cluster

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
    from planner.models import TrainingModule, torch_dtype
    from planner.models.registry import _lm_inputs, _lm_loss
    from planner.tracing import trace, trace_model

    say = _progress(sys.stderr.isatty())
    if args.target:
        import torch

        factory = _load_factory(args.target)
        dtype = torch_dtype(args.dtype, "--dtype")
        with torch.device("meta"):
            model = factory().to(dtype)
        if hasattr(model, "example_inputs"):
            inputs, module = tuple(model.example_inputs(args.batch, args.seq)), model
        else:  # language-model convention: token ids in, logits out, cross-entropy loss
            module = TrainingModule(model, _lm_loss)
            inputs = _lm_inputs(None, args.batch, args.seq, dtype, "meta")
        graph = trace(
            module,
            inputs,
            name=args.target,
            seq=args.seq,
            strip_prefix="" if hasattr(model, "example_inputs") else "model.",
            progress=say,
        )
    else:
        resolved = _resolve_model(args)
        graph = trace_model(resolved, args.batch, args.seq, args.dtype, progress=say)
    _write_or_print(graph.to_json(indent=None), args.output)
    s = graph.summary()
    print(
        f"{s['model']}: {s['nodes']} nodes, {s['layers']} layers, "
        f"{human_count(s['params'])} params, "
        f"{(s['fwd_flops'] + s['bwd_flops']) / 1e12:.1f} TFLOP per step of batch {args.batch}",
        file=sys.stderr,
    )


def _training(args: argparse.Namespace, seq: int):
    from pydantic import ValidationError

    from planner.errors import input_error_from
    from planner.plan import TrainingSettings

    try:
        return TrainingSettings(
            global_batch_size=args.global_batch,
            seq_len=seq,
            dtype=args.dtype,
            optimizer=args.optimizer,
            attention=args.attention,
        )
    except ValidationError as err:
        raise input_error_from(err, prefix="training") from None


def cmd_estimate(args: argparse.Namespace) -> None:
    from planner.cluster import load_cluster
    from planner.estimate import ParallelConfig, _hash, evaluate, model_ref
    from planner.graph import OpGraph, cluster_layers, rescale_batch
    from planner.plan import ModelRef
    from planner.tracing import trace_model

    started = time.perf_counter()
    say = _progress(sys.stderr.isatty() and not args.json)
    cluster = load_cluster(args.cluster, args.nodes)
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
    if args.graph:
        try:
            text = Path(args.graph).read_text()
        except OSError as err:
            raise InputError("--graph", f"cannot read {args.graph}: {err.strerror}") from None
        graph = cluster_layers(OpGraph.from_json(text, field="--graph"))
        seq = args.seq or graph.data.seq
        training = _training(args, seq)
        config.validate(cluster, training.global_batch_size, max(graph.num_layers, 1))
        graph = rescale_batch(graph, config.microbatch_size(training.global_batch_size))
        model = ModelRef(
            name=graph.data.model or "graph",
            family="graph",
            config={},
            params=graph.param_count,
            content_hash=_hash(text),
        )
        tokens = seq
    else:
        resolved = _resolve_model(args)
        seq = args.seq or resolved.default_seq
        training = _training(args, seq)
        layers = resolved.with_seq(seq)
        probe = getattr(layers.config, "layers", 1)
        config.validate(cluster, training.global_batch_size, probe if isinstance(probe, int) else 1)
        mbs = config.microbatch_size(training.global_batch_size)
        say(f"tracing {resolved.name} at micro-batch {mbs}")
        graph = trace_model(
            resolved,
            config.microbatch_size(training.global_batch_size),
            seq,
            training.dtype,
            progress=say,
        )
        model = model_ref(resolved, seq)
        tokens = seq if resolved.family.tokens_per_sample else 1
    say("evaluating")
    plan = evaluate(
        graph, cluster, training, config, model, tokens_per_sample=tokens, started=started
    )
    if args.output:
        Path(args.output).write_text(plan.to_json() + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    print(plan.to_json() if args.json else plan_summary(plan))


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
    from planner.cluster import load_cluster
    from planner.cost_model import CostModel
    from planner.graph import OpGraph, rescale_batch
    from planner.ilp import InfeasibleError, ShardingProblem, solution_to_dict, solve
    from planner.mesh import LogicalMesh
    from planner.tracing import trace_model

    say = _progress(sys.stderr.isatty() and not args.json)
    cluster = load_cluster(args.cluster, args.nodes)
    dp, tp = _mesh_shape(args.mesh)
    if dp * tp > cluster.num_devices:
        raise InputError(
            "--mesh", f"{dp}x{tp} needs {dp * tp} devices, the cluster has {cluster.num_devices}"
        )
    if args.graph:
        try:
            graph = OpGraph.from_json(Path(args.graph).read_text(), field="--graph")
        except OSError as err:
            raise InputError("--graph", f"cannot read {args.graph}: {err.strerror}") from None
        graph = rescale_batch(graph, args.batch)
    else:
        resolved = _resolve_model(args)
        say(f"tracing {resolved.name}")
        graph = trace_model(resolved, args.batch, args.seq, args.dtype, progress=say)
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
    cm = CostModel(cluster, args.dtype, attention=args.attention)
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
        zero=not args.no_zero,
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


def _progress_bar(enabled: bool):
    """A one-line progress bar on stderr (only on a terminal)."""
    started = time.perf_counter()

    def show(step: str, done: int, total: int) -> None:
        if not enabled:
            return
        width = 24
        filled = int(width * done / max(total, 1))
        bar = "#" * filled + "-" * (width - filled)
        elapsed = time.perf_counter() - started
        end = "\n" if done >= total else ""
        print(
            f"\r  [{bar}] {done}/{total} {step} ({elapsed:.1f} s)",
            end=end,
            file=sys.stderr,
            flush=True,
        )

    return show


def _planning_inputs(args: argparse.Namespace, say):
    """(graph at micro-batch 1, the same at 2 (None for a graph file), cluster, training,
    model ref, tokens per sample)."""
    from planner.cluster import load_cluster
    from planner.estimate import _hash, model_ref
    from planner.graph import OpGraph
    from planner.plan import ModelRef
    from planner.tracing import trace_model

    cluster = load_cluster(args.cluster, args.nodes)
    if args.graph:
        try:
            text = Path(args.graph).read_text()
        except OSError as err:
            raise InputError("--graph", f"cannot read {args.graph}: {err.strerror}") from None
        graph = OpGraph.from_json(text, field="--graph")
        seq = args.seq or graph.data.seq
        model = ModelRef(
            name=graph.data.model or "graph",
            family="graph",
            config={},
            params=graph.param_count,
            content_hash=_hash(text),
        )
        return graph, None, cluster, _training(args, seq), model, seq
    resolved = _resolve_model(args)
    seq = args.seq or resolved.default_seq
    training = _training(args, seq)
    say(f"tracing {resolved.name} (seq {seq}) on the meta device")
    graph = trace_model(resolved, 1, seq, training.dtype)
    second = trace_model(resolved, 2, seq, training.dtype)
    tokens = seq if resolved.family.tokens_per_sample else 1
    return graph, second, cluster, training, model_ref(resolved, seq), tokens


def cmd_plan(args: argparse.Namespace) -> int:
    from planner.baselines import baseline
    from planner.search import NoFeasiblePlan, SearchOptions, search

    tty = sys.stderr.isatty() and not args.json
    say = _progress(tty)
    graph, second, cluster, training, model, tokens = _planning_inputs(args, say)
    options = SearchOptions(
        top_k=args.top_k, workers=args.workers, ilp_time_limit=args.time_limit, solver=args.solver
    )
    try:
        result = search(
            graph,
            cluster,
            training,
            model,
            tokens_per_sample=tokens,
            options=options,
            progress=_progress_bar(tty),
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
        for kind in ("megatron", "dp", "fsdp"):
            b = baseline(kind, graph, cluster, training, model, tokens, second).plan
            rows.append((kind, b))
    if args.output:
        Path(args.output).write_text(plan.to_json() + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
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
            _mesh_text(plan),
        ]
    ]
    for kind, b in rows:
        if b is None:
            out.append([f"{kind} (best)", "does not fit", "-", "-", "-"])
            continue
        ratio = b.predicted.step_time_s / plan.predicted.step_time_s
        out.append(
            [
                f"{kind} (best)",
                f"{b.predicted.step_time_s:.3f}",
                f"{b.predicted.tflops_per_device:.1f}",
                _versus(ratio),
                _mesh_text(b),
            ]
        )
    return table(["configuration", "step s", "TFLOP/s/dev", "vs plan", "mesh"], out)


def _versus(ratio: float) -> str:
    if abs(ratio - 1) < 0.005:
        return "same"
    return f"{ratio:.2f}x slower" if ratio > 1 else f"{1 / ratio:.2f}x faster"


def _mesh_text(plan) -> str:
    pp, dp, tp = plan.mesh.shape
    st = plan.stages[0]
    extra = f", zero{st.zero}" + (", ckpt" if st.activation_checkpointing else "")
    return f"pp{pp} dp{dp} tp{tp}, {plan.schedule.microbatches} mb{extra}"


def cmd_baseline(args: argparse.Namespace) -> int:
    from planner.baselines import baseline

    say = _progress(sys.stderr.isatty() and not args.json)
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


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, help="bundled profile name or YAML path")
    p.add_argument("--nodes", type=int, help="override the profile's node count")


def _add_precision_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "sgd_momentum"])
    p.add_argument(
        "--attention", default="flash", choices=["flash", "math"], help="attention kernel"
    )


def _add_training_args(p: argparse.ArgumentParser) -> None:
    _add_cluster_args(p)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--seq", type=int)
    _add_precision_args(p)


# --- parser ------------------------------------------------------------------------------
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
    _add_model_args(p, graph=False)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("-o", "--output", help="write the graph here instead of stdout")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("estimate", help="evaluate a hand-written dp x tp x pp configuration")
    _add_model_args(p)
    _add_training_args(p)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing per layer"
    )
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3 over dp")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved_1f1b"])
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the Plan JSON")
    p.add_argument("-o", "--output", help="also write the Plan JSON here")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("shard", help="solve the sharding ILP for one stage on one mesh")
    _add_model_args(p)
    _add_cluster_args(p)
    p.add_argument("--mesh", required=True, help="logical mesh DPxTP, e.g. 1x8 or 2x4")
    p.add_argument("--layers", help="layer range start:end (default: the whole model)")
    p.add_argument("--batch", type=int, default=1, help="micro-batch size")
    p.add_argument("--seq", type=int)
    p.add_argument("--microbatches", type=int, default=1, help="spreads per-step gradient sync")
    _add_precision_args(p)
    p.add_argument("--memory-budget", type=float, help="GiB per device (default: device memory)")
    p.add_argument("--solver", default="highs", choices=["highs", "cbc"])
    p.add_argument("--time-limit", type=float, default=60.0, help="solver time limit, s")
    p.add_argument("--no-dedup", action="store_true", help="solve every block separately")
    p.add_argument("--no-zero", action="store_true", help="no ZeRO-3 choices on the dp axis")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_shard)

    p = sub.add_parser("plan", help="search the best way to split training (the planner)")
    _add_model_args(p)
    _add_training_args(p)
    p.add_argument("-o", "--output", help="write the Plan JSON here")
    p.add_argument("--json", action="store_true", help="print the Plan JSON")
    p.add_argument("--top-k", type=int, default=5, help="alternatives to keep")
    p.add_argument("--time-limit", type=float, default=60.0, help="per ILP solve, s")
    p.add_argument("--solver", default="highs", choices=["highs", "cbc"])
    p.add_argument("--workers", type=int, default=1, help="processes for ILP solves")
    p.add_argument("--no-baselines", action="store_true", help="skip the baseline comparison")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("baseline", help="the best configuration of one baseline family")
    _add_model_args(p)
    _add_training_args(p)
    p.add_argument("--kind", required=True, choices=["megatron", "dp", "fsdp"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_baseline)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except AutoparError as err:
        print(f"error: {err}", file=sys.stderr)
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
