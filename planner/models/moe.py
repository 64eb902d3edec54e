"""GShard-style mixture of experts LM (Lepikhin et al. 2020): every other layer's MLP is a
top-2 mixture of experts with per-group capacity, dispatched by dense einsums.

Sizes are Alpa's MoE suite (vocab 32000, seq 1024, expert group 2048). Alpa's model uses an
FFN of 8 x hidden in every MLP and expert, and puts the MoE on even layers; with that, the
parameter counts match the suite's names (moe-380m: 383M, moe-1.3b: 1.35B).
Expert groups are formed within a sample (gcd(seq, expert_group_size) tokens: 1024 at seq
1024, where Alpa's groups of 2048 span two samples), which keeps the cost linear in the batch.
The expert dimension is a leading tensor dim ("egcm"), so expert parallelism is a Shard(0)
of the expert weights and the token<->expert exchange is a resharding (all-to-all).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from planner.models.configs.moe import ZOO, MoEConfig, param_count  # noqa: F401 (re-exported)
from planner.models.gpt import GPT, MLP, SelfAttention


class Experts(nn.Module):
    """E independent FFNs as batched weights [E, h, f] and [E, f, h]."""

    def __init__(self, experts: int, hidden: int, ffn: int):
        super().__init__()
        self.wi = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.wo = nn.Parameter(torch.empty(experts, ffn, hidden))
        nn.init.normal_(self.wi, std=0.02)
        nn.init.normal_(self.wo, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [E, groups, capacity, hidden]
        h = F.gelu(torch.einsum("egcm,emf->egcf", x, self.wi))
        return torch.einsum("egcf,efm->egcm", h, self.wo)


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.group_size = cfg.expert_group_size
        self.capacity_factor = cfg.capacity_factor
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg.experts, cfg.hidden, cfg.ffn)
        # (dispatch buffer, experts) -> their outputs, where the experts are split over ranks
        # (executor.expert_parallel); None: this module computes all of them
        self.exchange = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        # Groups are formed within each sample (at most expert_group_size tokens), so the
        # cost per token does not depend on the batch size.
        group = math.gcd(t, self.group_size)
        xg = x.reshape(b * t // group, group, h)
        probs = F.softmax(self.router(xg), dim=-1)  # [G, S, E]
        n_exp = probs.shape[-1]
        capacity = max(1, math.ceil(self.capacity_factor * self.top_k * group / n_exp))
        gate, index = probs.topk(self.top_k, dim=-1)  # [G, S, k]
        choice = torch.zeros(*index.shape, n_exp, dtype=x.dtype, device=x.device)
        choice = choice.scatter(-1, index.unsqueeze(-1), 1.0)  # [G, S, k, E]
        # Slot of each token in its expert's buffer: first choices are served first.
        ordered = choice.transpose(1, 2).reshape(choice.shape[0], -1, n_exp)  # [G, k*S, E]
        slot = torch.cumsum(ordered, dim=1) - 1.0
        kept = ordered * (slot < capacity).to(x.dtype)
        slot_onehot = torch.zeros(*slot.shape, capacity, dtype=x.dtype, device=x.device)
        slot_onehot = slot_onehot.scatter(-1, slot.clamp(0, capacity - 1).long().unsqueeze(-1), 1)
        dispatch_k = (kept.unsqueeze(-1) * slot_onehot).view(-1, self.top_k, group, n_exp, capacity)
        dispatch = dispatch_k.sum(dim=1)  # [G, S, E, C]
        gate_k = gate.transpose(1, 2).unsqueeze(-1).unsqueeze(-1)  # [G, k, S, 1, 1]
        combine = (dispatch_k * gate_k).sum(dim=1)
        expert_in = torch.einsum("gsec,gsm->egcm", dispatch, xg)
        if self.exchange is None:
            expert_out = self.experts(expert_in)
        else:
            expert_out = self.exchange(expert_in, self.experts)
        y = torch.einsum("gsec,egcm->gsm", combine, expert_out)
        return y.reshape(b, t, h)


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig, use_moe: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden)
        self.attn = SelfAttention(cfg.hidden, cfg.heads)
        self.ln_2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MoELayer(cfg) if use_moe else MLP(cfg.hidden, cfg.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MoELM(GPT):
    """The GPT skeleton with MoE blocks on even layers (GShard, as in Alpa's suite)."""

    def make_block(self, cfg: MoEConfig, index: int) -> nn.Module:
        return MoEBlock(cfg, use_moe=index % 2 == 0)
