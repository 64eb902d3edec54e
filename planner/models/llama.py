"""Llama-style decoder: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention.

Published shapes: Llama 1 7B (Touvron et al. 2023, Table 2), Llama 3 8B/70B (Meta's model
cards: hidden 4096/8192, 32/80 layers, 32/64 heads, 8 KV heads, FFN 14336/28672, vocab 128256,
RoPE theta 500000). Local head counts are inferred from shapes, so q/k/v column sharding and
o row sharding work under tensor parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.models.configs.llama import ZOO, LlamaConfig, param_count  # noqa: F401 (re-exported)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables as non-persistent buffers (no parameters)."""

    def __init__(self, head_dim: int, seq_len: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [batch, heads, seq, head_dim]
        t = x.shape[2]
        cos = self.cos[:t].to(x.dtype)
        sin = self.sin[:t].to(x.dtype)
        return x * cos + rotate_half(x) * sin

    def at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x rotated at the given global positions (a context-parallel rank's tokens)."""
        cos = self.cos[positions].to(x.dtype)
        sin = self.sin[positions].to(x.dtype)
        return x * cos + rotate_half(x) * sin


class GQAttention(nn.Module):
    # Context parallelism (executor.context_parallel.ContextShard) sets this to attend a
    # rank's share of the sequence to the whole; None: the whole sequence is local.
    context = None

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        kv_dim = cfg.kv_heads * cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden, kv_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden, kv_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.seq_len, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.context is not None:
            y = self.context(q, k, v, self.rope)
            return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        q, k = self.rope(q), self.rope(k)
        groups = q.shape[1] // k.shape[1]  # local query heads per local KV head
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attention = GQAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg.hidden, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))
