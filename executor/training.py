"""The training step shared by every executor path: synthetic data, the loss, one step's
record, and a parameter fingerprint for comparisons with the single-process reference."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target.float())


def synthetic_batch(step: int, batch: int, seq: int, vocab: int, seed: int):
    """Token ids and next-token labels of one global batch, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def step_record(step: int, started: float, loss: float | None) -> dict:
    return {
        "step": step,
        "time_s": time.perf_counter() - started,
        "loss": loss,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def fingerprint(p: torch.Tensor) -> list:
    """The first 64 values of the whole parameter (gathered if it is a DTensor)."""
    t = p.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.to(torch.float64).flatten().tolist()[:64]


@dataclass(frozen=True)
class RunOptions:
    """How long and how to train: the worker's command line."""

    steps: int = 3
    lr: float = 0.1
    seed: int = 0
    momentum: float = 0.0  # SGD momentum
    timeout_s: float = 60.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False


def train(plan, parallel, mesh, device: torch.device, opts: RunOptions, fault) -> list[dict]:
    """Train `parallel` (executor.parallelize.ParallelModel) for the plan's steps: each dp
    rank takes its slice of the global batch; gradients are full-batch means (schedules scale
    by micro-batch count, FSDP averages over dp), so a run matches a single-process step."""
    from executor import checkpoint
    from executor.pipeline import sum_tied_grad

    _pp, dp, _tp = plan.mesh.shape
    training = plan.request.training
    seq, gb, m = training.seq_len, training.global_batch_size, plan.schedule.microbatches
    vocab = plan.request.model.config.get("vocab") or 2
    optimizer = torch.optim.SGD(parallel.parameters, lr=opts.lr, momentum=opts.momentum)
    container = parallel.container()
    first_step = 0
    if opts.resume and opts.checkpoint_dir:
        found = checkpoint.latest_step(opts.checkpoint_dir)
        if found is not None:
            checkpoint.load(opts.checkpoint_dir, found, container, optimizer)
            first_step = found
    dp_rank, per_replica = mesh["dp"].get_local_rank(), gb // dp
    records = []
    for step in range(first_step, opts.steps):
        fault(step)
        t0 = time.perf_counter()
        tokens, labels = synthetic_batch(step, gb, seq, vocab, opts.seed)
        x = tokens[dp_rank * per_replica : (dp_rank + 1) * per_replica].to(device)
        y = labels[dp_rank * per_replica : (dp_rank + 1) * per_replica].to(device)
        optimizer.zero_grad()
        loss = _forward_backward(plan, parallel, x, y, m)
        if parallel.tied_group is not None:
            # The schedule may return while its last backward send is still in flight; the
            # tied gradients are complete only once every stage is done.
            dist.barrier(group=mesh.get_group("pp"))
            for p in parallel.tied:
                sum_tied_grad(p, parallel.tied_group)
        optimizer.step()
        every = opts.checkpoint_every
        if opts.checkpoint_dir and every and (step + 1) % every == 0:
            checkpoint.save(opts.checkpoint_dir, step + 1, container, optimizer)
        records.append(step_record(step, t0, loss))
    return records


def _forward_backward(plan, parallel, x, y, m: int) -> float | None:
    """One step's forward and backward over m micro-batches; the loss where this rank has it."""
    if parallel.schedule is None:
        ((_, stage),) = parallel.stages
        total = 0.0
        for xm, ym in zip(x.chunk(m), y.chunk(m), strict=True):
            loss = parallel.loss_fn(stage(xm), ym) / m
            loss.backward()
            total += float(loss.detach())
        return total
    last_index = len(plan.stages) - 1
    is_first = any(st.index == 0 for st, _ in parallel.stages)
    is_last = any(st.index == last_index for st, _ in parallel.stages)
    losses: list[torch.Tensor] = []
    if is_first and is_last:
        parallel.schedule.step(x, target=y, losses=losses)
    elif is_first:
        parallel.schedule.step(x)
    elif is_last:
        parallel.schedule.step(target=y, losses=losses)
    else:
        parallel.schedule.step()
    return float(torch.stack([v.detach() for v in losses]).mean()) if losses else None
