"""Where a run's batches come from: synthetic tokens by default, or the user's own data
factory (`pkg.module:function`, named on the command line of their own machine; the service
never passes one).

A data factory is called once per run as `factory(seq_len=..., vocab=..., seed=...)` and
returns a callable `batch(step, global_batch_size) -> (tokens, labels)`: LongTensors of shape
(global_batch_size, seq_len), the same on every rank (each data-parallel rank takes its
slice), labels already shifted for next-token prediction.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from executor.errors import ExecutionError

Batch = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def synthetic_batch(step: int, batch: int, seq: int, vocab: int, seed: int):
    """Token ids and next-token labels of one global batch, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def synthetic_images(step: int, batch: int, size: int, classes: int, seed: int):
    """Images (batch, 3, size, size) ~ N(0, 1) and class labels, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    images = torch.randn(batch, 3, size, size, generator=g)
    return images, torch.randint(0, classes, (batch,), generator=g)


def plan_data_source(plan, spec: str | None, seed: int) -> Batch:
    """The batches of a plan's model: images and classes for an image model (synthetic only),
    tokens for a language model (synthetic, or the user's factory)."""
    config = plan.request.model.config
    if "image_size" in config:
        if spec is not None:
            raise ExecutionError(
                f"--data: {spec}: data factories give token batches; this plan's model "
                f"({plan.request.model.name}) takes images"
            )
        size, classes = config["image_size"], config["classes"]
        return lambda step, batch: synthetic_images(step, batch, size, classes, seed)
    vocab = config.get("vocab") or 2
    return data_source(spec, plan.request.training.seq_len, vocab, seed)


def load_factory(spec: str, what: str = "--data") -> Callable:
    """`pkg.module:function` -> the function (imported on the user's own machine)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ExecutionError(f"{what}: {spec!r} is not module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ExecutionError(f"{what}: cannot import {module_name!r}: {err}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ExecutionError(f"{what}: {module_name} has no callable {attr!r}")
    return factory


def data_source(spec: str | None, seq: int, vocab: int, seed: int) -> Batch:
    """The run's batch function: the user's factory, or synthetic tokens."""
    if spec is None:
        return lambda step, batch: synthetic_batch(step, batch, seq, vocab, seed)
    batch_fn = load_factory(spec)(seq_len=seq, vocab=vocab, seed=seed)

    def checked(step: int, batch: int):
        tokens, labels = batch_fn(step, batch)
        for name, t in (("tokens", tokens), ("labels", labels)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (batch, seq):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ExecutionError(
                    f"--data: {spec} returned {name} of shape {shape}; expected "
                    f"({batch}, {seq}) token ids"
                )
        return tokens.long(), labels.long()

    return checked
