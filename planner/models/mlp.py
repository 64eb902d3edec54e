"""A plain MLP for tests: `layers` residual-free blocks of Linear(h, f) -> GELU -> Linear(f, h)."""

from __future__ import annotations

import torch
from torch import nn

from planner.models.configs.mlp import ZOO, MLPConfig, param_count  # noqa: F401 (re-exported)
from planner.models.gpt import MLP


class MLPModel(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.config = cfg
        self.blocks = nn.ModuleList(MLP(cfg.hidden, cfg.ffn_hidden) for _ in range(cfg.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x
