"""`autopar trace`: a zoo model or a private one (pkg.module:factory) into an OpGraph JSON."""

from __future__ import annotations

import argparse
import os
import sys

from api.cli.common import (
    add_model_args,
    count,
    progress_printer,
    resolve_model,
    write_or_print,
)
from api.render import human_count
from planner.errors import InputError
from planner.limits import (
    MAX_GLOBAL_BATCH,
    MAX_SEQ,
)
from planner.vocab import DTYPES


def _load_factory(target: str):
    """The user's model factory (executor.data.load_factory, the loader `--data` uses too),
    importable from the current directory; errors name the `target` argument."""
    from executor.data import load_factory
    from executor.errors import ExecutionError

    sys.path.insert(0, os.getcwd())
    try:
        return load_factory(target, "target")
    except ExecutionError as err:
        raise InputError("target", str(err).split(": ", 1)[1], "pkg.module:factory") from None


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


def add_parsers(sub) -> None:
    p = sub.add_parser("trace", help="trace a model into an OpGraph JSON (on the meta device)")
    p.add_argument("target", nargs="?", help="pkg.module:factory returning an nn.Module")
    add_model_args(p, graph=False)
    p.add_argument(
        "--batch",
        type=count(1, MAX_GLOBAL_BATCH),
        default=2,
        help="micro-batch to trace at (default 2: at 1, a batch dim cannot be told from a "
        "broadcast one, and model code such as transformers' specialises batch 1)",
    )
    p.add_argument("--seq", type=count(1, MAX_SEQ), default=None)
    p.add_argument("--dtype", default="bf16", choices=DTYPES)
    p.add_argument("-o", "--output", help="write the graph here instead of stdout")
    p.set_defaults(func=cmd_trace)
