"""fp8 training (executor.fp8): which layers are converted and the refusal off a capable GPU
(here, on the CPU), and, marked `gpu`, torchao's float8 training on autopar's Llama against
the same model trained in bf16 (run on the device tool's H100: bench/results/h100_fp8.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from executor.fp8 import FP8_RECIPES, apply_fp8, fp8_eligible, fp8_refusal
from planner.models.llama import Llama, LlamaConfig

CFG = LlamaConfig(
    hidden=256, layers=2, heads=2, kv_heads=1, ffn_hidden=768, vocab=1024, seq_len=256
)
LINEARS_PER_LAYER = 7  # q, k, v, o, w1, w2, w3


def _capable() -> bool:
    return torch.cuda.is_available() and fp8_refusal(torch.device("cuda")) is None


def test_eligible_layers_skip_the_head_and_odd_sizes():
    model = Llama(CFG)
    names = [n for n, m in model.named_modules() if fp8_eligible(m, n)]
    assert len(names) == CFG.layers * LINEARS_PER_LAYER
    assert "output" not in names
    assert not fp8_eligible(nn.Linear(256, 100), "layers.0.feed_forward.w1")
    assert not fp8_eligible(nn.LayerNorm(256), "layers.0.norm")


def test_cpu_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="CUDA GPU"):
        apply_fp8(Llama(CFG), "tensorwise", torch.device("cpu"))
    with pytest.raises(ValueError, match="tensorwise, rowwise"):
        apply_fp8(Llama(CFG), "blockwise", torch.device("cpu"))


def _train(recipe: str | None, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of `steps` AdamW steps on one fixed batch, and the first step's gradients."""
    from executor.precision import autocast

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = Llama(CFG).to(device)
    if recipe:
        assert apply_fp8(model, recipe, device) == CFG.layers * LINEARS_PER_LAYER
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab, (8, CFG.seq_len + 1), generator=g).to(device)
    losses, first = [], {}
    for step in range(steps):
        with autocast("bf16", device):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first


@pytest.mark.gpu
@pytest.mark.skipif(not _capable(), reason="needs a CUDA GPU with fp8 tensor cores")
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_training_follows_bf16(recipe):
    reference, ref_grads = _train(None, 40)
    losses, grads = _train(recipe, 40)
    for name, ref in ref_grads.items():
        cos = F.cosine_similarity(grads[name].flatten(), ref.flatten(), dim=0)
        assert cos > 0.98, (name, float(cos))
    for ref, got in zip(reference, losses, strict=True):
        assert abs(got - ref) / ref < 0.05, (reference, losses)
    assert losses[-1] < 0.5 * losses[0]  # it learns the batch, as bf16 does
