"""The single-process reference a distributed run must match: the same model, seed, data,
precision and optimizer steps on the whole global batch."""

from __future__ import annotations

import torch

from executor.data import plan_data_source
from executor.fp8 import apply_fp8
from executor.optim import build_optimizer, clip_grad_norm
from executor.precision import autocast, cast_parameters_dtype, loss_scaler
from executor.stage_model import build_full_model
from executor.training import fingerprint
from planner.models.registry import family_loss, model_output
from planner.plan import Plan

WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def reference_run(
    plan: Plan,
    steps: int,
    lr: float | None = None,
    seed: int = 0,
    momentum: float = 0.0,
    max_grad_norm: float = 1.0,
    model_factory: str | None = None,
) -> dict:
    """The plan's training (dtype, optimizer, clipping) on one process: the whole global
    batch, in the plan's micro-batches."""
    training = plan.request.training
    spec = plan.request.model.model_dump()
    model, family = build_full_model(spec, training.seq_len, seed, model_factory)
    if plan.fp8:
        apply_fp8(model, plan.fp8, torch.device("cpu"))
    loss_fn = family_loss(family)
    optimizer = build_optimizer(training.optimizer, list(model.parameters()), lr, momentum)
    scaler = loss_scaler(training.dtype)
    batches = plan_data_source(plan, None, seed)
    device = torch.device("cpu")
    forward = _forward(model, cast_parameters_dtype(plan))
    m = plan.schedule.microbatches
    losses = []
    for step in range(steps):
        tokens, labels = batches(step, training.global_batch_size)
        optimizer.zero_grad()
        loss = 0.0
        # the plan's micro-batches (gradient accumulation): batch norm sees what it sees there
        for x, y in zip(tokens.chunk(m), labels.chunk(m), strict=True):
            with autocast(training.dtype, device):
                part = loss_fn(model_output(forward(x)), y) / m
            (part * scaler.scale).backward()
            loss += float(part.detach())
        if scaler.unscale_and_check(list(model.parameters())):
            clip_grad_norm(model.parameters(), max_grad_norm)
            optimizer.step()
        losses.append(loss)
    params = {name: fingerprint(p) for name, p in model.named_parameters(remove_duplicate=False)}
    return {"losses": losses, "params": params}


def _forward(model: torch.nn.Module, cast: torch.dtype | None):
    """The model's forward, with its parameters cast to `cast` (their gradients flow back to
    the fp32 parameters), as FSDP2's mixed precision computes."""
    if cast is None:
        return model
    from torch.func import functional_call

    def forward(x):
        params = {n: p.to(cast) for n, p in model.named_parameters()}
        return functional_call(model, params, (x,))

    return forward


def distributed_losses(results: list[dict], plan: Plan) -> list[float]:
    """Per-step loss of a distributed run: the mean over data-parallel replicas of what the
    last pipeline stage (or the single stage) reports."""
    steps = len(results[0]["steps"])
    out = []
    for s in range(steps):
        values = [r["steps"][s]["loss"] for r in results if r["steps"][s]["loss"] is not None]
        # tp ranks of one replica report the same loss; the mean over all reports is the
        # mean over replicas.
        out.append(sum(values) / len(values))
    return out


def distributed_params(results: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in results:
        for name, values in r["params"].items():
            out.setdefault(name.replace(WRAPPER_PREFIX, ""), values)
    return out
