"""A plain MLP for tests: `layers` residual-free blocks of Linear(h, f) -> GELU -> Linear(f, h)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from planner.models.config import require_positive
from planner.models.gpt import MLP


@dataclass(frozen=True)
class MLPConfig:
    hidden: int = 1024
    ffn_hidden: int = 4096
    layers: int = 2
    seq_len: int = 1  # tokens per sample; inputs are [batch, seq_len, hidden]

    def validate(self, prefix: str = "config") -> None:
        require_positive(prefix, hidden=self.hidden, ffn_hidden=self.ffn_hidden)
        require_positive(prefix, layers=self.layers, seq_len=self.seq_len)


class MLPModel(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.config = cfg
        self.blocks = nn.ModuleList(MLP(cfg.hidden, cfg.ffn_hidden) for _ in range(cfg.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def param_count(cfg: MLPConfig) -> int:
    return cfg.layers * (2 * cfg.hidden * cfg.ffn_hidden + cfg.hidden + cfg.ffn_hidden)


ZOO = {"mlp": MLPConfig(), "mlp-large": MLPConfig(hidden=8192, ffn_hidden=32768, layers=2)}
