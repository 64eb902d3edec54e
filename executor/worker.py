"""Per-rank entry point: run a Plan for N training steps with torch.distributed.

Order of application (DESIGN.md, TORCH_NOTES.md): mesh -> stage modules -> tensor-parallel
styles -> activation checkpointing -> FSDP2 on the dp axis -> PipelineStage + schedule.
Weights are identical on every rank because every rank builds the whole model from the same
seed. Data: synthetic token ids from a seeded generator, the same global batch on every rank,
each dp rank taking its slice. Gradients are full-batch means (schedules scale by micro-batch
count, FSDP averages over dp), so a run matches a single-process step on the whole batch.

Data parallelism runs through FSDP2 for every ZeRO level: ZeRO-3 reshards parameters after
forward; levels 0-2 keep them unsharded between forward and backward (numerically the same
step; the memory of ZeRO-0/1 is what the plan predicts, not what this run uses).

Run with torchrun: python -m executor.worker PLAN.json --steps N --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from executor import graph_mode
from executor.errors import ExecutionError
from executor.lifetime import die_with_parent, launcher_gone
from executor.mesh import build_mesh
from executor.stage_model import PARTS, build_full_model, build_stage
from executor.tensor_parallel import apply_tensor_parallel
from planner.executable import plan_executor_mode
from planner.plan import Plan

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def synthetic_batch(step: int, batch: int, seq: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def tied_slots(stage: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that hold one shared parameter (tied embeddings)."""
    groups: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in stage.modules():
        for attr, p in module.named_parameters(recurse=False):
            groups.setdefault(id(p), []).append((module, attr))
    return [g for g in groups.values() if len(g) > 1]


def retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Tensor parallelism distributes each module's weight on its own; tie them again."""
    for (owner, attr), *others in groups:
        shared = getattr(owner, attr)
        for module, name in others:
            setattr(module, name, shared)


def apply_checkpointing(stage: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = getattr(stage, stage.block_attr)
    for key in list(blocks.keys()):
        blocks[key] = checkpoint_wrapper(blocks[key])


def apply_data_parallel(stage: nn.Module, dp_mesh, zero: int) -> None:
    if dp_mesh.size() == 1:
        return
    from torch.distributed.fsdp import fully_shard

    reshard = zero == 3
    for block in getattr(stage, stage.block_attr).values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard)


def _tied_groups(mesh, pp: int):
    """One process group per (dp, tp) coordinate joining the first and last pipeline stage
    (each holds its own copy of tied embeddings); created in the same order on every rank."""
    if pp == 1:
        return None
    ranks = mesh.mesh  # [pp, dp, tp]
    mine = None
    for d in range(ranks.shape[1]):
        for t in range(ranks.shape[2]):
            pair = [int(ranks[0, d, t]), int(ranks[pp - 1, d, t])]
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                mine = group
    return mine


def tied_across_stages(stage: nn.Module, model: nn.Module) -> list[str]:
    """Names (in `stage`) of parameters the model shares with a part outside this stage: the
    first and last pipeline stages each hold a copy of tied embeddings whose gradients must be
    summed. Taken before wrapping, since tensor parallelism and FSDP replace the objects."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    inside: dict[int, int] = {}
    for _, p in stage.named_parameters(remove_duplicate=False):
        inside[id(p)] = inside.get(id(p), 0) + 1
    return [name for name, p in stage.named_parameters() if counts[id(p)] > inside[id(p)]]


def _sum_tied_grad(p: nn.Parameter, group) -> None:
    """Add the other stage's gradient of a tied parameter. A DTensor gradient need not have
    its parameter's placements (an embedding's may come back replicated while the weight is
    row-sharded): bring it to them first so both stages reduce matching local shards."""
    grad = p.grad
    if hasattr(grad, "redistribute"):
        grad = grad.redistribute(placements=p.placements)
        dist.all_reduce(grad.to_local(), group=group)
        p.grad = grad
    else:
        dist.all_reduce(grad, group=group)


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


def run(
    plan: Plan,
    steps: int,
    lr: float,
    seed: int,
    timeout_s: float,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    momentum: float = 0.0,
) -> dict:
    # NCCL and one GPU per local rank where CUDA is present (as torchrun sets LOCAL_RANK);
    # gloo on the CPU otherwise. (Only the CPU path is exercised by this repo's tests.)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    mesh = build_mesh(plan, device.type)
    fault = _fault_injector(rank)
    mode = plan_executor_mode(plan)
    if mode is None:
        raise ExecutionError(
            "plan.executable: this plan cannot be executed (a per-node tensor-parallel layout "
            "runs on one pipeline stage only, and only for gpt, llama and moe models)"
        )
    if mode == "graph":
        if checkpoint_dir or resume:
            raise ExecutionError(
                "--checkpoint-dir/--resume: checkpoints are not supported yet for plans that run "
                "in graph mode (a per-node tensor-parallel layout)"
            )
        records, state, where = graph_mode.train(plan, mesh, steps, lr, seed, momentum, fault)
        dist.barrier()
        dist.destroy_process_group()
        return {"rank": rank, "steps": records, "params": state, "placements": where, "mode": mode}
    pp, dp, _tp = plan.mesh.shape
    training = plan.request.training
    cfg = plan.request.model.config
    seq, gb = training.seq_len, training.global_batch_size
    vocab = cfg.get("vocab")
    model, family = build_full_model(plan.request.model.model_dump(), seq, seed)
    head = PARTS[family][3]
    mine = [st for st in plan.stages if rank in st.ranks]
    stages = []
    tied: list[nn.Parameter] = []
    for st in mine:
        first, last = st.index == 0, st.index == len(plan.stages) - 1
        stage = build_stage(model, family, st.layers[0], st.layers[1], first, last).to(device)
        ties = tied_slots(stage)
        shared = tied_across_stages(stage, model) if pp > 1 else []
        apply_tensor_parallel(stage, st.shardings, mesh["tp"], head if last else None)
        retie(ties)
        if st.activation_checkpointing:
            apply_checkpointing(stage)
        apply_data_parallel(stage, mesh["dp"], st.zero)
        stages.append((st, stage))
        tied += [stage.get_parameter(name) for name in shared]
    tied_group = _tied_groups(mesh, pp)
    params = [p for _, s in stages for p in s.parameters()]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum)
    m = plan.schedule.microbatches
    dp_rank = mesh["dp"].get_local_rank()
    per_replica = gb // dp
    is_first = any(st.index == 0 for st, _ in stages)
    is_last = any(st.index == len(plan.stages) - 1 for st, _ in stages)
    loss_fn = lm_loss if family != "mlp" else (lambda out, y: F.mse_loss(out.float(), y.float()))
    schedule = None
    if pp > 1:
        from torch.distributed import pipelining

        pp_group = mesh.get_group("pp")
        pipe_stages = [
            pipelining.PipelineStage(
                stage, st.index, len(plan.stages), torch.device("cpu"), group=pp_group
            )
            for st, stage in stages
        ]
        cls = getattr(pipelining, SCHEDULES[plan.schedule.name])
        if plan.schedule.name == "interleaved_1f1b":
            schedule = cls(pipe_stages, n_microbatches=m, loss_fn=loss_fn)
        else:
            schedule = cls(pipe_stages[0], n_microbatches=m, loss_fn=loss_fn)
    container = nn.ModuleDict({f"stage{st.index}": stage for st, stage in stages})
    first_step = 0
    if resume and checkpoint_dir:
        from executor import checkpoint

        found = checkpoint.latest_step(checkpoint_dir)
        if found is not None:
            checkpoint.load(checkpoint_dir, found, container, optimizer)
            first_step = found
    records = []
    for step in range(first_step, steps):
        fault(step)
        t0 = time.perf_counter()
        tokens, labels = synthetic_batch(step, gb, seq, vocab or 2, seed)
        tokens, labels = tokens.to(device), labels.to(device)
        x = tokens[dp_rank * per_replica : (dp_rank + 1) * per_replica]
        y = labels[dp_rank * per_replica : (dp_rank + 1) * per_replica]
        optimizer.zero_grad()
        loss_value = None
        if schedule is None:
            ((_, stage),) = stages
            total = 0.0
            for xm, ym in zip(x.chunk(m), y.chunk(m), strict=True):
                loss = loss_fn(stage(xm), ym) / m
                loss.backward()
                total += float(loss.detach())
            loss_value = total
        else:
            losses: list[torch.Tensor] = []
            if is_first and is_last:
                schedule.step(x, target=y, losses=losses)
            elif is_first:
                schedule.step(x)
            elif is_last:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            if losses:
                loss_value = float(torch.stack([v.detach() for v in losses]).mean())
        if tied_group is not None:
            # The schedule may return while its last backward send is still in flight; the
            # tied gradients are complete only once every stage is done.
            dist.barrier(group=mesh.get_group("pp"))
            for p in tied:
                _sum_tied_grad(p, tied_group)
        optimizer.step()
        if checkpoint_dir and checkpoint_every and (step + 1) % checkpoint_every == 0:
            from executor import checkpoint

            checkpoint.save(checkpoint_dir, step + 1, container, optimizer)
        records.append(
            {
                "step": step,
                "time_s": time.perf_counter() - t0,
                "loss": loss_value,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        )
    if device.type == "cuda":
        for r in records:
            r["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    state = {name: _full(p) for _, s in stages for name, p in s.named_parameters()}
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "steps": records, "params": state, "mode": mode}


def _full(p: torch.Tensor) -> list:
    t = p.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.to(torch.float64).flatten().tolist()[:64]  # a fingerprint, for comparisons


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m executor.worker")
    parser.add_argument("plan")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint-dir", help="save sharded checkpoints here")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between saves")
    parser.add_argument("--resume", action="store_true", help="continue from the latest save")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum")
    args = parser.parse_args(argv)
    die_with_parent()  # a rank never outlives its torchrun agent
    if launcher_gone():
        return 1
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        plan = Plan.from_json(Path(args.plan).read_text())
        result = run(
            plan,
            args.steps,
            args.lr,
            args.seed,
            args.timeout,
            args.checkpoint_dir,
            args.checkpoint_every,
            args.resume,
            args.momentum,
        )
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        return 0
    except Exception as err:  # report, then fail the job
        (out / f"rank{rank}.error.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "error": f"{type(err).__name__}: {err}",
                    "traceback": traceback.format_exc(),
                    "user_error": isinstance(err, ExecutionError),
                }
            )
        )
        print(f"rank {rank}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
