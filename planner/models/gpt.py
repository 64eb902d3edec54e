"""GPT (GPT-2/3 style): learned positions, pre-LayerNorm, GELU MLP, tied embeddings.

Sizes are Alpa's GPT benchmark suite (Zheng et al., OSDI'22, Table 4), vocab 51200, seq 1024.
Attention uses separate q/k/v projections and infers the local head count from shapes, so
column-parallel sharding of q/k/v gives whole heads per rank (tensor-parallel friendly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from planner.models.config import require_divisible, require_positive


@dataclass(frozen=True)
class GPTConfig:
    hidden: int
    layers: int
    heads: int
    vocab: int = 51200
    seq_len: int = 1024
    ffn_hidden: int | None = None  # default 4 * hidden
    tie_embeddings: bool = True

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    def validate(self, prefix: str = "config") -> None:
        require_positive(
            prefix, hidden=self.hidden, layers=self.layers, heads=self.heads, vocab=self.vocab
        )
        require_positive(prefix, seq_len=self.seq_len, ffn_hidden=self.ffn)
        require_divisible(prefix, "hidden", self.hidden, "heads", self.heads)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, bias: bool = True):
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, hidden, bias=bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden)
        self.attn = SelfAttention(cfg.hidden, cfg.heads)
        self.ln_2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, cfg.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Embeddings, a stack of blocks (`make_block`), final LayerNorm, LM head."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(self.make_block(cfg, i) for i in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def make_block(self, cfg: GPTConfig, index: int) -> nn.Module:
        return GPTBlock(cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def param_count(cfg: GPTConfig) -> int:
    """Closed form: embeddings + L * (attention + MLP + 2 LayerNorms) + final LN (+ head)."""
    h, f = cfg.hidden, cfg.ffn
    per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    head = 0 if cfg.tie_embeddings else cfg.vocab * h
    return cfg.vocab * h + cfg.seq_len * h + cfg.layers * per_layer + 2 * h + head


ZOO = {
    "gpt-350m": GPTConfig(hidden=1024, layers=24, heads=16),
    "gpt-760m": GPTConfig(hidden=1536, layers=24, heads=16),
    "gpt-1.3b": GPTConfig(hidden=2048, layers=24, heads=32),
    "gpt-2.6b": GPTConfig(hidden=2560, layers=32, heads=32),
    "gpt-6.7b": GPTConfig(hidden=4096, layers=32, heads=32),
    "gpt-15b": GPTConfig(hidden=5120, layers=48, heads=40),
    "gpt-39b": GPTConfig(hidden=8192, layers=48, heads=64),
    "gpt-76b": GPTConfig(hidden=10240, layers=60, heads=80),
}
