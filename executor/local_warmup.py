"""Imported once by the forkserver of executor/local_ranks.py: one tiny torch.export on the
meta device, so that every rank forked from the server finds export's machinery loaded
(the first export in a process costs ~1.3 s more than later ones on this machine). Meta
tensors run no kernels, so the server never starts torch's CPU thread pool (a pool started
before fork can hang the children)."""

import torch
import torch.nn.functional as F
from torch import nn


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.proj = nn.Linear(4, 8)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.proj(self.embed(tokens)).flatten(0, 1), labels.flatten())


with torch.device("meta"):
    _inputs = (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    torch.export.export(_Tiny(), _inputs, strict=False)
