"""Partial checkpointing on the module path: a stage wraps only its first k blocks, which
then run their forward again in backward, with the same gradients."""

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from executor.checkpointing import apply_checkpointing
from executor.stage_model import build_full_model, build_stage

CONFIG = {"name": "gpt-350m", "config": {"layers": 3, "hidden": 32, "heads": 2, "vocab": 64}}


def _stage():
    torch.manual_seed(0)
    model, family = build_full_model(CONFIG, 8)
    return build_stage(model, family, 0, 3, True, True)


def _forward_backward(stage, calls: list[str]):
    """Gradients of one step; `calls` gets a block's key each time its forward runs (an
    instance attribute: checkpoint's recomputation does not run module hooks)."""
    for key, block in _blocks(stage).items():
        block.forward = _counted(block.forward, key, calls)
    x = torch.randint(0, 64, (2, 8))
    stage(x).float().square().mean().backward()
    return {name: p.grad.clone() for name, p in stage.named_parameters()}


def _counted(forward, key: str, calls: list[str]):
    def run(*args, **kwargs):
        calls.append(key)
        return forward(*args, **kwargs)

    return run


def _blocks(stage):
    """The blocks themselves (inside their checkpoint wrappers)."""
    return {
        key: block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
        for key, block in stage.owned_blocks().items()
    }


def test_only_the_first_k_blocks_are_checkpointed():
    plain, calls_plain = _stage(), []
    grads = _forward_backward(plain, calls_plain)
    partial, calls = _stage(), []
    apply_checkpointing(partial, "full", 2)
    wrapped = [isinstance(b, CheckpointWrapper) for b in partial.owned_blocks().values()]
    assert wrapped == [True, True, False]
    got = _forward_backward(partial, calls)
    # Forward runs each block once; backward runs the two checkpointed ones again.
    assert calls_plain == ["0", "1", "2"]
    assert sorted(calls) == ["0", "0", "1", "1", "2"]
    got = {k.replace("._checkpoint_wrapped_module", ""): g for k, g in got.items()}
    assert got.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(got[name], grad)
