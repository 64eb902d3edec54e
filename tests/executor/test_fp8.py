"""fp8 training (executor.fp8): which layers are converted and the refusal off a capable GPU
(here, on the CPU), and, marked `gpu`, torchao's float8 training on autopar's Llama against
the same model trained in bf16 (run on the device tool's H100: bench/results/h100_fp8.md)."""

from __future__ import annotations

import dataclasses

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


def test_unknown_recipes_and_devices_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="tensorwise, rowwise"):
        apply_fp8(Llama(CFG), "blockwise", torch.device("cpu"))
    assert fp8_refusal(torch.device("cpu")) is None  # torch's software float8 GEMM
    assert "CUDA" in fp8_refusal(torch.device("meta"))


def test_the_planner_prices_the_layers_the_executor_converts():
    """planner.parallel.fp8.eligible on the traced graph names the modules apply_fp8
    swaps (the head and misaligned layers left out by both)."""
    from planner.graph.tracing import trace_model
    from planner.models import ModelSpec, resolve
    from planner.parallel.fp8 import eligible

    for ffn in (768, 760):  # 760: not a multiple of 16
        cfg = dataclasses.replace(CFG, ffn_hidden=ffn)
        sizes = ("hidden", "layers", "heads", "kv_heads", "ffn_hidden", "vocab")
        spec = ModelSpec(name="llama3-8b", config={k: getattr(cfg, k) for k in sizes})
        graph = trace_model(resolve(spec), batch=1, seq=cfg.seq_len)
        priced = {n.module for n in graph.nodes if eligible(n)}
        model = Llama(cfg)
        converted = {n for n, m in model.named_modules() if fp8_eligible(m, n)}
        assert priced == converted and priced


def test_fp8_runs_on_the_cpu_and_differs_from_bf16_by_its_rounding():
    torch.manual_seed(0)
    model, reference = Llama(CFG), Llama(CFG)
    reference.load_state_dict(model.state_dict())
    assert apply_fp8(model, "tensorwise", torch.device("cpu")) == CFG.layers * LINEARS_PER_LAYER
    tokens = torch.randint(0, CFG.vocab, (2, CFG.seq_len))
    out, ref = model(tokens), reference(tokens)
    error = (out - ref).abs().max() / ref.abs().max()
    assert 0 < error < 0.1  # e4m3's 3 mantissa bits: a few percent


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
