"""Llama-style decoder configurations as numbers, without torch: the config, the zoo (its sources:
planner/models/llama.py, which builds the module) and the closed-form parameter count."""

from __future__ import annotations

from dataclasses import dataclass

from planner.models.config import require_divisible, require_positive


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def validate(self, prefix: str = "config") -> None:
        require_positive(
            prefix, hidden=self.hidden, layers=self.layers, heads=self.heads, vocab=self.vocab
        )
        require_positive(
            prefix, kv_heads=self.kv_heads, ffn_hidden=self.ffn_hidden, seq_len=self.seq_len
        )
        require_divisible(prefix, "hidden", self.hidden, "heads", self.heads)
        require_divisible(prefix, "heads", self.heads, "kv_heads", self.kv_heads)


def param_count(cfg: LlamaConfig) -> int:
    h, kv = cfg.hidden, cfg.kv_heads * cfg.head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * cfg.ffn_hidden + 2 * h
    if cfg.attention_bias:
        per_layer += h + 2 * kv
    head = 0 if cfg.tie_embeddings else cfg.vocab * h
    return cfg.vocab * h + cfg.layers * per_layer + h + head


ZOO = {
    "llama-7b": LlamaConfig(
        hidden=4096, layers=32, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000, seq_len=2048
    ),
    "llama3-8b": LlamaConfig(
        hidden=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        ffn_hidden=14336,
        vocab=128256,
        seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": LlamaConfig(
        hidden=8192,
        layers=80,
        heads=64,
        kv_heads=8,
        ffn_hidden=28672,
        vocab=128256,
        seq_len=8192,
        rope_theta=500000.0,
    ),
}
