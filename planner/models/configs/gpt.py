"""GPT (GPT-2/3 style) configurations as numbers, without torch: the config, the zoo (its sources:
planner/models/gpt.py, which builds the module) and the closed-form parameter count."""

from __future__ import annotations

from dataclasses import dataclass

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
