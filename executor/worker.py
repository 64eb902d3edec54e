"""Per-rank entry point: run a Plan for N training steps with torch.distributed.

Sets up the process group and the ("pp", "dp", "tp") DeviceMesh, then runs the plan one of
two ways (planner/executable.py): module-level parallel styles (executor/parallelize.py, then
executor/training.py), or graph mode for per-node layouts (executor/graph_mode.py).

Run with torchrun: python -m executor.worker PLAN.json --steps N --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path

from executor.lifetime import die_with_parent, exit_when_gone, launcher_gone

if __name__ == "__main__":  # a rank: it ends with its launcher even while importing torch
    die_with_parent()
    exit_when_gone(os.environ.get("AUTOPAR_LAUNCHER_PID"))

import torch
import torch.distributed as dist

from executor.data_parallel import offloaded_modules
from executor.errors import ExecutionError
from executor.expert_parallel import whole_experts
from executor.graph_mode import placement_text
from executor.graph_parallelize import parallelize_graph
from executor.mesh import build_mesh
from executor.parallelize import parallelize
from executor.stage_model import build_full_model
from executor.submesh_pipeline import build_stage_meshes
from executor.training import RunOptions, fingerprint, reset_peak_rss, rss_bytes, train
from planner.executable import execution_refusal, plan_executor_mode
from planner.plan import Plan


def _fault_injector(rank: int):
    """AUTOPAR_KILL_RANK="RANK:STEP" kills that rank at that step (tests of failure handling);
    returns the per-step check."""
    spec = os.environ.get("AUTOPAR_KILL_RANK", "")
    who, _, at = spec.partition(":")
    fatal = int(at) if at and int(who) == rank else None

    def check(step: int) -> None:
        if step == fatal:
            os.kill(os.getpid(), signal.SIGKILL)

    return check


def _device() -> tuple[torch.device, str]:
    """NCCL and one GPU per local rank where CUDA is present (as torchrun sets LOCAL_RANK);
    gloo on the CPU otherwise. The caching allocator grows segments in place
    (expandable_segments) unless the user configured it: on an H100 a plan predicted at 67.5
    GiB failed with 10.2 GiB reserved but unused (fragmentation from the loss's logits-sized
    buffers) and ran at 72.7 GiB with it (bench/results/h100_execute.md)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % gpus)
        torch.cuda.set_device(device)
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); with more local ranks
        # than GPUs (a multi-rank plan tried on one GPU) the ranks share them over gloo, which
        # takes CUDA tensors for all-reduce, broadcast and all-gather (DDP, ZeRO-0) only
        shared = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > gpus
        return device, "gloo" if shared else "nccl"
    return torch.device("cpu"), "gloo"


def run(plan: Plan, opts: RunOptions) -> dict:
    device, backend = _device()
    dist.init_process_group(backend, timeout=timedelta(seconds=opts.timeout_s))
    rank = dist.get_rank()
    pipeline_group = None
    if plan.mesh.stage_meshes is not None:  # each stage on its own submesh
        mesh, pipeline_group = build_stage_meshes(plan, device.type)
    else:
        mesh = build_mesh(plan, device.type)
    fault = _fault_injector(rank)
    mode = plan_executor_mode(plan)
    if refused := execution_refusal(plan):
        raise ExecutionError(f"plan.{refused[0]}: {refused[1]}")
    if mode is None:
        raise ExecutionError("plan.executable: its tp layout or model has no executor path")
    if pipeline_group is not None and (mode != "modules" or plan.schedule.name != "1f1b"):
        raise ExecutionError(
            "plan.mesh.stage_meshes: stages on their own submeshes run on the module path "
            f"under 1F1B (executor.submesh_pipeline); this plan runs {mode} mode under "
            f"{plan.schedule.name}"
        )
    seq = plan.request.training.seq_len
    # what the process holds before the model: torch, the process group; the run's growth
    # above it is what compares with the plan's per-device prediction on a CPU
    reset_peak_rss()
    start_rss = rss_bytes()
    model, family = build_full_model(plan.request.model.model_dump(), seq, opts.seed, opts.model)
    if mode == "graph":
        parallel = parallelize_graph(
            plan, model, family, mesh, rank, device, _micro_batch(plan, opts)
        )
    else:
        parallel = parallelize(
            plan, model, family, mesh, rank, device, pipeline_group=pipeline_group
        )
    records = train(plan, parallel, mesh, device, opts, fault)
    if device.type == "cuda":
        for r in records:
            r["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
            r["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    named = [_canonical(s) for _, s in parallel.stages]
    # each rank has E / ep experts, each of F / tp features where they are split
    whole = whole_experts(parallel.experts, mesh, parallel.ep, parallel.split_experts)
    state = {name: fingerprint(whole.get(id(p), p)) for params in named for name, p in params}
    where = {
        name: _plan_placements(stage, p)
        for (_, stage), params in zip(parallel.stages, named, strict=True)
        for name, p in params
        if hasattr(p, "placements")
    }
    dist.barrier()
    dist.destroy_process_group()
    offloaded = sum(offloaded_modules(s) for _, s in parallel.stages)
    stored: dict[str, int] = {}  # activation store -> bytes moved off the device
    for _, s in parallel.stages:
        if hasattr(s, "stored_bytes"):
            mode, counter = s.stored_bytes
            stored[mode] = stored.get(mode, 0) + counter[0]
    return {
        "rank": rank,
        "steps": records,
        "params": state,
        "placements": where,
        "mode": mode,
        "cpu_offloaded_modules": offloaded,
        "activation_stored_bytes": stored,
        "fp8_layers": sum(getattr(s, "fp8_layers", 0) for _, s in parallel.stages),
        "start_rss_bytes": start_rss,
    }


def _plan_placements(stage, p) -> list[str]:
    """A parameter's placements as the plan spells them (a graph stage leaves out mesh dims
    of size 1)."""
    if hasattr(stage, "placement_texts"):
        return stage.placement_texts(p)
    return [placement_text(x) for x in p.placements]


def _canonical(stage) -> list:
    """A stage's parameters under the plan's names."""
    if hasattr(stage, "canonical_parameters"):
        return stage.canonical_parameters()
    return list(stage.named_parameters())


def _micro_batch(plan, opts: RunOptions) -> tuple:
    """The first global micro-batch (graph mode exports the training forward on it)."""
    from executor.data import plan_data_source

    training = plan.request.training
    tokens, labels = plan_data_source(plan, opts.data, opts.seed)(0, training.global_batch_size)
    size = training.global_batch_size // plan.schedule.microbatches
    return tokens[:size], labels[:size]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m executor.worker")
    parser.add_argument("plan")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=None, help="default: the optimizer's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint-dir", help="save sharded checkpoints here")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between saves")
    parser.add_argument("--resume", action="store_true", help="continue from the latest save")
    parser.add_argument("--momentum", type=float, default=0.0, help="plain SGD's momentum")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    parser.add_argument("--data", help="a data factory, pkg.module:function (executor/data.py)")
    parser.add_argument("--model", help="the model factory of a traced plan, pkg.module:function")
    args = parser.parse_args(argv)
    die_with_parent()  # a rank never outlives its torchrun agent
    if launcher_gone():
        return 1
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    opts = RunOptions(
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        momentum=args.momentum,
        max_grad_norm=args.max_grad_norm,
        data=args.data,
        model=args.model,
        timeout_s=args.timeout,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
    )
    try:
        plan = Plan.from_json(Path(args.plan).read_text())
        result = run(plan, opts)
        _report(out / f"rank{rank}.json", result)
        return 0
    except Exception as err:  # report, then fail the job
        _report(
            out / f"rank{rank}.error.json",
            {
                "rank": rank,
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(),
                "user_error": isinstance(err, ExecutionError),
            },
        )
        print(f"rank {rank}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1


def _report(path: Path, payload: dict) -> None:
    """Written whole or not at all: torchrun kills the other ranks when one fails, and a rank
    killed mid-write left an empty report the launcher could not read (it is then named from
    torchrun's log instead)."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(payload))
    os.replace(partial, path)


if __name__ == "__main__":
    sys.exit(main())
