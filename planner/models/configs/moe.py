"""GShard-style MoE LM configurations as numbers, without torch: the config, the zoo (its sources:
planner/models/moe.py, which builds the module) and the closed-form parameter count."""

from __future__ import annotations

from dataclasses import dataclass

from planner.models.config import require_positive


@dataclass(frozen=True)
class MoEConfig:
    hidden: int
    layers: int
    heads: int
    experts: int
    vocab: int = 32000
    seq_len: int = 1024
    expert_group_size: int = 2048
    ffn_hidden: int | None = None  # default 8 * hidden (Alpa's suite)
    top_k: int = 2
    capacity_factor: float = 1.0
    tie_embeddings: bool = True

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 8 * self.hidden

    def validate(self, prefix: str = "config") -> None:
        require_positive(prefix, hidden=self.hidden, layers=self.layers, heads=self.heads)
        require_positive(prefix, experts=self.experts, vocab=self.vocab, seq_len=self.seq_len)
        require_positive(prefix, expert_group_size=self.expert_group_size, top_k=self.top_k)
        require_positive(prefix, capacity_factor=self.capacity_factor)


def param_count(cfg: MoEConfig) -> int:
    h, f, e = cfg.hidden, cfg.ffn, cfg.experts
    attn_norms = 4 * h * h + 4 * h + 4 * h
    dense = attn_norms + 2 * h * f + f + h
    sparse = attn_norms + h * e + 2 * e * h * f
    n_moe = (cfg.layers + 1) // 2
    head = 0 if cfg.tie_embeddings else cfg.vocab * h
    body = n_moe * sparse + (cfg.layers - n_moe) * dense
    return cfg.vocab * h + cfg.seq_len * h + body + 2 * h + head


ZOO = {
    "moe-380m": MoEConfig(hidden=768, layers=8, heads=16, experts=8),
    "moe-690m": MoEConfig(hidden=768, layers=8, heads=16, experts=16),
    "moe-1.3b": MoEConfig(hidden=768, layers=16, heads=16, experts=16),
    "moe-2.4b": MoEConfig(hidden=1024, layers=16, heads=16, experts=16),
    "moe-7.1b": MoEConfig(hidden=1280, layers=16, heads=16, experts=32),
    "moe-10b": MoEConfig(hidden=1536, layers=16, heads=16, experts=32),
    "moe-27b": MoEConfig(hidden=2048, layers=16, heads=16, experts=48),
    "moe-70b": MoEConfig(hidden=2048, layers=32, heads=16, experts=64),
}
