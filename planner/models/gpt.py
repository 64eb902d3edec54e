"""GPT (GPT-2/3 style): learned positions, pre-LayerNorm, GELU MLP, tied embeddings.

Sizes are Alpa's GPT benchmark suite (Zheng et al., OSDI'22, Table 4), vocab 51200, seq 1024.
Attention uses separate q/k/v projections and infers the local head count from shapes, so
column-parallel sharding of q/k/v gives whole heads per rank (tensor-parallel friendly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.models.configs.gpt import ZOO, GPTConfig, param_count  # noqa: F401 (re-exported)


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
