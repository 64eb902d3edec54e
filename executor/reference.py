"""The single-process reference a distributed run must match: the same model, seed, data and
SGD steps on the whole global batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor.stage_model import build_full_model
from executor.training import lm_loss, synthetic_batch
from planner.plan import Plan

WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def reference_run(
    plan: Plan, steps: int, lr: float = 0.1, seed: int = 0, momentum: float = 0.0
) -> dict:
    training = plan.request.training
    model, family = build_full_model(plan.request.model.model_dump(), training.seq_len, seed)
    loss_fn = lm_loss if family != "mlp" else (lambda out, y: F.mse_loss(out.float(), y.float()))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    vocab = plan.request.model.config.get("vocab") or 2
    losses = []
    for step in range(steps):
        tokens, labels = synthetic_batch(
            step, training.global_batch_size, training.seq_len, vocab, seed
        )
        optimizer.zero_grad()
        loss = loss_fn(model(tokens), labels)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    params = {
        name: p.detach().to(torch.float64).flatten().tolist()[:64]
        for name, p in model.named_parameters(remove_duplicate=False)
    }
    return {"losses": losses, "params": params}


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
