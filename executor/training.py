"""The training step shared by every executor path: the step loop, one step's
record, and a parameter fingerprint for comparisons with the single-process reference."""

from __future__ import annotations

import inspect
import resource
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from executor.data_parallel import kept_blocks
from executor.zero1 import ShardedOptimizer


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; the peak so far elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    """This process's peak resident memory since reset_peak_rss (Linux's VmHWM), or since it
    started (getrusage, elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> None:
    """Start the peak over from the memory held now, where Linux allows it: a rank kept for
    the next run (executor.local_ranks) reports that run's peak, not an earlier one's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def step_record(step: int, started: float, loss: float | None) -> dict:
    return {
        "step": step,
        "time_s": time.perf_counter() - started,
        "loss": loss,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def fingerprint(p: torch.Tensor) -> list:
    """128 values spread evenly over the whole parameter (gathered if it is a DTensor), so
    that every shard of it is sampled (its first values alone would all come from one tp
    rank's rows of a column-sharded weight)."""
    t = p.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    flat = t.flatten()
    # The sample first, then the copy: converting the whole tensor copied every parameter of
    # a 1.9B model to the host as float64 lists on an H100 (11.8 s of device-to-host copies
    # at the end of a run: bench/results/h100_step_profile.txt).
    # Integer positions: a float32 linspace rounds the last index of a 525M-element embedding
    # past the end (an out-of-bounds gather, a device-side assert on a GPU).
    n, count = flat.numel(), min(flat.numel(), 128)
    index = torch.arange(count, dtype=torch.int64) * max(n - 1, 0) // max(count - 1, 1)
    return flat[index.to(flat.device)].to(torch.float64).tolist()


@dataclass(frozen=True)
class RunOptions:
    """How long and how to train: the worker's command line. What to train with (dtype,
    optimizer) is the plan's."""

    steps: int = 3
    lr: float | None = None  # None: the plan optimizer's default (executor/optim.py)
    seed: int = 0
    momentum: float = 0.0  # plain SGD's momentum
    max_grad_norm: float = 1.0  # global gradient clipping; 0 turns it off
    data: str | None = None  # a user data factory, pkg.module:function (executor/data.py)
    model: str | None = None  # the model factory of a plan traced from it (`autopar trace`)
    timeout_s: float = 60.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False


def train(plan, parallel, mesh, device: torch.device, opts: RunOptions, fault) -> list[dict]:
    """Train `parallel` (executor.parallelize.ParallelModel) for the plan's steps: each dp
    rank takes its slice of the global batch; gradients are full-batch means (schedules scale
    by micro-batch count, FSDP averages over dp), so a run matches a single-process step.
    The step is the plan's: its dtype (autocast, fp32 master weights, fp16 loss scaling),
    its optimizer, global gradient clipping."""
    from executor import checkpoint
    from executor.context_parallel import local_batch
    from executor.data import plan_data_source
    from executor.ledger import (
        CollectiveRecorder,
        LiveBytes,
        group_axes,
        held_bytes,
    )
    from executor.optim import build_optimizer, state_bytes
    from executor.precision import autocast

    training = plan.request.training
    gb, m = training.global_batch_size, plan.schedule.microbatches

    def build(params):
        return build_optimizer(training.optimizer, params, opts.lr, opts.momentum)

    optimizer = plan_optimizer(parallel, build)
    container = parallel.container()
    ep_rank = mesh["ep"].get_local_rank() if parallel.ep > 1 else 0
    tp_rank = mesh["tp"].get_local_rank() if parallel.split_experts else 0
    slices = checkpoint.expert_slices(container, parallel, ep_rank, tp_rank)
    first_step = 0
    if opts.resume and opts.checkpoint_dir:
        found = checkpoint.latest_step(opts.checkpoint_dir)
        if found is not None:
            checkpoint.load(opts.checkpoint_dir, found, container, optimizer, slices)
            first_step = found
    dp_rank = mesh["dp"].get_local_rank()
    pp_group = parallel.pp_group
    if pp_group is None and plan.mesh.shape[0] > 1:
        pp_group = mesh.get_group("pp")
    batches = plan_data_source(plan, opts.data, opts.seed)
    axes = group_axes(mesh, parallel.tied_group)
    if parallel.pp_group is not None:  # stages on their own submeshes: their messages' group
        axes[parallel.pp_group.group_name] = "pp"
    records = []
    for step in range(first_step, opts.steps):
        fault(step)
        # The last step's collectives are recorded (planner.evaluate.ledger predicts them):
        # the steps before it are timed without the recorder's per-op cost, and the first
        # step's one-off exchanges (pipelining's shape inference) are not a step's.
        recorded = step == opts.steps - 1
        recorder = CollectiveRecorder(axes) if recorded else nullcontext()
        live = LiveBytes(parallel.parameters, axes) if recorded else nullcontext()
        t0 = time.perf_counter()
        tokens, labels = batches(step, gb)
        if parallel.global_inputs or parallel.whole_batch:  # the stages slice the batch
            x, y = tokens.to(device), labels.to(device)
        else:
            x, y = local_batch(tokens, labels, plan, dp_rank)
            x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        with recorder:
            with live, autocast(training.dtype, device):
                loss = forward_backward(plan, parallel, x, y, m)
            if finish_gradients(parallel, opts.max_grad_norm, pp_group, optimizer):
                optimizer.step()
        every = opts.checkpoint_every
        if opts.checkpoint_dir and every and (step + 1) % every == 0:
            checkpoint.save(opts.checkpoint_dir, step + 1, container, optimizer, slices)
        records.append(step_record(step, t0, loss))
        records[-1]["optimizer_state_bytes"] = state_bytes(optimizer)
        if isinstance(recorder, CollectiveRecorder):
            held = held_bytes(parallel.parameters, optimizer)
            peak = live.peak()
            records[-1]["ledger"] = {
                "comm": recorder.comm(),
                "held": held,
                "activation_peak": peak,
                "gradient_peak": live.gradient_peak(),
            }
            if recorder.trace is not None:
                records[-1]["ledger"]["trace"] = recorder.trace
                records[-1]["ledger"]["at_peak"] = live.at_peak()
    return records


def plan_optimizer(parallel, build):
    """`build(params)` over this rank's parameters, or under ZeRO-1 over its master shards
    (executor.zero1), which reduces the gradients and gathers the parameters itself."""
    if not parallel.zero1_units:
        return build(parallel.parameters)
    tied = {id(p) for p in _tied_copies(parallel)}
    return ShardedOptimizer(parallel.zero1_units, parallel.zero1_group, build, tied)


def finish_gradients(parallel, max_grad_norm: float, pp_group, optimizer) -> bool:
    """After a step's backward: sum tied embeddings' gradients across the first and last
    stage, under ZeRO-1 reduce-scatter them (executor.zero1), undo fp16 loss scaling, clip the
    global norm. False when the step overflowed (fp16) and the optimizer step must be
    skipped."""
    from executor.graph_data_parallel import reduce_unit_gradients
    from executor.optim import clip_grad_norm, settle_gradients
    from executor.pipeline import sum_tied_grads

    if pp_group is not None:
        # The schedule may return while its last backward send is still in flight; the
        # tied gradients are complete only once every stage is done. (Every stage waits:
        # a barrier on the pp group that only some of its ranks entered would hang.)
        dist.barrier(group=pp_group)
    reduce_unit_gradients(parallel.dp_buckets, "dp")  # graph mode's ZeRO-0
    for p in parallel.unsynced_experts:  # the sums of their ep group's micro-batch means
        if p.grad is not None:
            p.grad.div_(parallel.dp)
    settle_gradients(parallel.parameters)  # both tied copies then placed as their weights
    sum_tied_grads(parallel.tied, parallel.tied_group, alike=parallel.tied_alike)
    stages = dist.get_world_size(pp_group) if pp_group is not None else 1
    holders = parallel.norm_holders or dist.get_world_size() // stages
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.reduce_gradients()
        if not parallel.scaler.unscale_and_check(optimizer.masters):
            return False
        clip_grad_norm(
            optimizer.masters,
            max_grad_norm,
            holders,
            skip=optimizer.uncounted(),
            pieces=optimizer.norm_shards(),
        )
        return True
    if not parallel.scaler.unscale_and_check(parallel.parameters):
        return False
    clip_grad_norm(
        parallel.parameters,
        max_grad_norm,
        holders,
        skip=_tied_copies(parallel),
        pieces=parallel.expert_pieces(),
    )
    return True


def _tied_copies(parallel) -> list:
    """Tied parameters held by a stage other than the first: the first stage's copy is the
    one counted in the gradient norm."""
    tied = {id(p) for p in parallel.tied}
    return [
        p
        for st, stage in parallel.stages
        if st.index != 0
        for p in stage.parameters()
        if id(p) in tied
    ]


def accumulate(stage, zero: int, last: bool, resharded_layers: int | None = None) -> None:
    """Gradient accumulation as torch's pipeline schedules run it (and as the plan prices
    it): under ZeRO 0-2 gradients are reduced once, in the last micro-batch's backward, and
    parameters stay gathered until then; ZeRO-3 gathers and reduce-scatters each
    micro-batch's, so that nothing unsharded is kept between them; under layer-wise ZeRO
    the blocks after the first `resharded_layers` as ZeRO-2. (FSDP2's fully_shard and
    replicate; nothing to do where dp does not wrap the stage.)"""
    if not hasattr(stage, "set_requires_gradient_sync"):
        return
    every = zero == 3
    stage.set_requires_gradient_sync(every or last)
    stage.set_reshard_after_backward(every or last)
    stage.set_is_last_backward(every or last)
    for block in kept_blocks(stage, resharded_layers):
        block.set_requires_gradient_sync(last, recurse=False)
        block.set_reshard_after_backward(last, recurse=False)


def forward_backward(plan, parallel, x, y, m: int, inputs: dict | None = None) -> float | None:
    """One step's forward and backward over m micro-batches; the (unscaled) loss where this
    rank has it. `inputs`: further per-sample model inputs (packed documents' position_ids),
    split into micro-batches as the tokens are and given to every stage."""
    with _loss_context(parallel):
        return _forward_backward(plan, parallel, x, y, m, inputs or {})


def _forward_backward(plan, parallel, x, y, m: int, extra: dict) -> float | None:
    scale = parallel.scaler.scale
    if parallel.schedule is None:
        ((st, stage),) = parallel.stages
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        chunks = {k: v.chunk(m) for k, v in extra.items()}
        for i, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
            accumulate(stage, st.zero, last=i == m - 1, resharded_layers=st.resharded_layers)
            given = {k: v[i] for k, v in chunks.items()}
            out = stage(xm, ym) if parallel.global_inputs else stage(xm, **given)
            loss = parallel.loss(out, ym) / m
            (loss * scale).backward()
            total += _plain(loss.detach()).float()
        return float(total)
    last_index = len(plan.stages) - 1
    is_first = any(st.index == 0 for st, _ in parallel.stages)
    is_last = any(st.index == last_index for st, _ in parallel.stages)
    losses: list[torch.Tensor] = []
    inputs = (x, y) if parallel.global_inputs else (x,)  # graph mode: labels go in with x
    # return_outputs=False (where this torch has it): the last stage need not keep every
    # micro-batch's output (the logits) to the end of the step; the losses are all we read
    step = parallel.schedule.step
    if "return_outputs" in inspect.signature(step).parameters:
        step = partial(step, return_outputs=False)
    if is_first and is_last:
        step(*inputs, target=y, losses=losses, **extra)
    elif is_first:
        step(*inputs, **extra)
    elif is_last:
        step(target=y, losses=losses, **extra)
    else:
        step(**extra)
    if not losses:
        return None
    return float(torch.stack([_plain(v.detach()).float() for v in losses]).mean()) / scale


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under loss_parallel it is a replicated DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _loss_context(parallel):
    """torch's loss_parallel around forward and backward where the plan's loss is
    vocab-parallel (executor.tensor_parallel)."""
    if not parallel.loss_parallel:
        return nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
