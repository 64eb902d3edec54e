"""`autopar estimate`: one hand-written dp x tp x pp configuration under the cost model."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from api.cli.common import (
    add_model_args,
    add_training_args,
    count,
    planning_request,
    progress_printer,
)
from api.render import plan_summary
from planner.errors import InputError
from planner.limits import (
    MAX_DEVICES,
    MAX_LAYERS,
    MAX_MICROBATCHES,
)
from planner.parallel.registry import DEFAULT_EXCHANGE
from planner.pins import PINS
from planner.search.batch import refuse_range
from planner.vocab import FP8_RECIPES, SCHEDULES, ZERO_LEVELS

PIN_BY_NAME = {p.name: p for p in PINS}
CHECKPOINTING = PIN_BY_NAME["checkpointing"]


def cmd_estimate(args: argparse.Namespace) -> None:
    from planner.cost.schedule_v import V_SHAPED
    from planner.evaluate.config import ParallelConfig
    from planner.evaluate.predict import predict
    from planner.evaluate.remedies import remedies, remedy_lines
    from planner.evaluate.to_plan import to_plan
    from planner.intra_op.megatron import tensor_parallel_layout
    from planner.parallel import context, expert, sequence
    from planner.parallel_dims import pinned_grid

    started = time.perf_counter()
    say = progress_printer(sys.stderr.isatty() and not args.json)
    request = planning_request(args)
    refuse_range(request.batches, "autopar estimate")
    devices = request.cluster.num_devices
    _, grid_dp, _ = pinned_grid((args.pp, args.dp, args.tp), args.cp, devices, "mesh")
    config = ParallelConfig(
        dp=grid_dp,
        tp=args.tp,
        pp=args.pp,
        microbatches=args.microbatches,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages or (2 if args.schedule in V_SHAPED else 1),
        zero=args.zero,
        checkpointing={None: False, "full": True}.get(args.checkpointing, args.checkpointing),
        dp_shard=0 if args.dp_shard in (None, args.dp) else args.dp_shard,
        cp=args.cp,
        cp_comm=args.cp_comm,
        offload=args.cpu_offload,
        fp8=args.fp8,
        ep=args.ep,
        etp=args.etp or 0,
        layerwise_zero=bool(args.layerwise_zero),
    )
    training = request.training
    config.validate(
        request.cluster,
        training.global_batch_size,
        request.layers,
        request.model.config,
        training.dtype,
        training.runtime,
    )
    sp = args.sequence_parallel
    why = context.refusal(
        request.model.family,
        training.seq_len,
        config.cp,
        config.dp,
        comm=config.cp_comm,
        model_config=request.model.config,
    )
    if why:
        raise InputError("mesh.cp", why, "a cp the model and sequence allow")
    why = expert.refusal(
        *(request.model.family, request.model.config, config.ep, config.dp, config.tp),
        config.cp,
        etp=config.etp,
    )
    if why:
        raise InputError("mesh.ep", why, "an ep the model's experts allow")
    model = request.model
    if sp and (why := sequence.refusal(model.family, training.seq_len, config.tp, model.config)):
        raise InputError("sequence_parallel", why, "tp > 1 that divides the sequence")
    mbs = config.microbatch_size(training.global_batch_size)
    inputs = request.trace(batches=(mbs,), say=say)
    say("evaluating")
    graph = inputs.at(mbs)
    if config.folded and not sp:
        why = "expert tp 1 runs each MoE block on its tp rank's sequence shard"
        raise InputError("mesh.etp", why, "--sequence-parallel")
    layouts = tensor_parallel_layout(
        graph, config.tp, sequence_parallel=sp, fold_experts=config.folded
    )
    plan = to_plan(
        predict(graph, inputs.cluster, training, config, layouts=layouts),
        graph,
        inputs.cluster,
        training,
        inputs.model,
        tokens_per_sample=inputs.tokens_per_sample,
        layouts=layouts,
        started=started,
        tp_layout="megatron",
        sequence_parallel=sp,
    )
    if not plan.predicted.fits_in_memory:
        say("looking for changes that fit")
        found = remedies(
            graph, inputs.cluster, training, config, request.layers, request.model.config, sp
        )
        lines = remedy_lines(found, inputs.cluster.usable_memory_bytes)
        plan = plan.model_copy(update={"explanation": [*plan.explanation, *lines]})
    if args.output:
        Path(args.output).write_text(plan.to_json() + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    print(plan.to_json() if args.json else plan_summary(plan))


def add_parsers(sub) -> None:
    p = sub.add_parser("estimate", help="evaluate a hand-written dp x tp x pp configuration")
    add_model_args(p)
    add_training_args(p)
    p.add_argument("--dp", type=count(1, MAX_DEVICES), default=1)
    p.add_argument("--tp", type=count(1, MAX_DEVICES), default=1)
    p.add_argument("--pp", type=count(1, MAX_DEVICES), default=1)
    p.add_argument("--microbatches", type=count(1, MAX_MICROBATCHES), default=1)
    p.add_argument(
        "--checkpointing",
        nargs="?",
        const="full",
        choices=["full", *(c for c in CHECKPOINTING.choices if isinstance(c, str))],
        help=f"full with the bare flag, else as `autopar plan`'s {CHECKPOINTING.help}",
    )
    p.add_argument("--zero", type=int, choices=ZERO_LEVELS, default=0, help="ZeRO stage over dp")
    p.add_argument(
        "--dp-shard",
        type=count(1, MAX_DEVICES),
        metavar="N",
        help="HSDP: ZeRO shards over groups of N dp ranks and replicates across them "
        "(default: all of dp)",
    )
    p.add_argument(
        "--layerwise-zero",
        action="store_true",
        help="with --zero 3 and --pp 1: ZeRO-3 on the fewest first layers that fit, ZeRO-2 on "
        "the rest (Galvatron's per-layer choice)",
    )
    p.add_argument(
        "--cpu-offload",
        action="store_true",
        help="ZeRO-3's shards of weights, gradients and optimizer state in host memory, the "
        "optimizer stepping on the CPU (FSDP2's CPUOffloadPolicy; with --zero 3)",
    )
    p.add_argument(
        "--fp8",
        choices=FP8_RECIPES,
        help="fp8 matmuls (torchao float8 training) in every eligible linear layer, with "
        "this scaling recipe (a bf16 run on a device with fp8 tensor cores)",
    )
    p.add_argument(
        "--cp",
        type=count(1, MAX_DEVICES),
        default=1,
        metavar="N",
        help="context parallelism: groups of N ranks split each sample's sequence (2N "
        "load-balanced chunks); counted as torchtitan and Megatron-LM count it, the world is "
        "pp x dp x cp x tp",
    )
    cp_comm = PIN_BY_NAME["cp_comm"]
    p.add_argument(
        cp_comm.flag, choices=cp_comm.choices, default=DEFAULT_EXCHANGE, help=cp_comm.help
    )
    ep = PIN_BY_NAME["ep"]
    p.add_argument(ep.flag, type=count(1, MAX_DEVICES), default=1, metavar="N", help=ep.help)
    etp = PIN_BY_NAME["etp"]
    p.add_argument(etp.flag, type=count(1, 1), metavar="1", help=etp.help)
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron's sequence parallelism (norms and residuals sharded on the sequence)",
    )
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    p.add_argument(
        "--virtual-stages",
        type=count(1, MAX_LAYERS),
        help="model chunks per device (default: 2 with zbv_zero_bubble, else 1)",
    )
    p.add_argument("--json", action="store_true", help="print the Plan JSON")
    p.add_argument("-o", "--output", help="also write the Plan JSON here")
    p.set_defaults(func=cmd_estimate)
