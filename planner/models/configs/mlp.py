"""The test MLP's configurations as numbers, without torch: the config, the zoo (its sources:
planner/models/mlp.py, which builds the module) and the closed-form parameter count."""

from __future__ import annotations

from dataclasses import dataclass

from planner.models.config import require_positive


@dataclass(frozen=True)
class MLPConfig:
    hidden: int = 1024
    ffn_hidden: int = 4096
    layers: int = 2
    seq_len: int = 1  # tokens per sample; inputs are [batch, seq_len, hidden]

    def validate(self, prefix: str = "config") -> None:
        require_positive(prefix, hidden=self.hidden, ffn_hidden=self.ffn_hidden)
        require_positive(prefix, layers=self.layers, seq_len=self.seq_len)


def param_count(cfg: MLPConfig) -> int:
    return cfg.layers * (2 * cfg.hidden * cfg.ffn_hidden + cfg.hidden + cfg.ffn_hidden)


ZOO = {"mlp": MLPConfig(), "mlp-large": MLPConfig(hidden=8192, ffn_hidden=32768, layers=2)}
