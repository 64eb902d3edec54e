"""Expert parallelism (planner.parallel.expert says what it is and how it is priced): each of
the ep ranks of a group keeps E / ep of every MoE layer's experts and runs every group
member's tokens routed to them.

- The zoo's GShard MoE (ExpertExchange): a layer's dispatch buffer [E, groups, capacity,
  hidden] (capacity-padded, so its size does not depend on the router) is cut by
  destination rank and exchanged with one all-to-all, and the outputs come back with a
  second; both are their own gradient's inverse.
- transformers' MoE models (RoutedExchange): dropless; each (token, choice) row goes to its
  expert's rank with all-to-alls of uneven splits, after a small one of the row counts.

The expert weights are then different on each rank of the group, alike across groups: their
gradients are summed over the expert-data-parallel group (the ranks holding the same
experts) by the data-parallel wrapper (executor.data_parallel.apply_expert_data_parallel),
and divided by all of dp, since each holds the sum of the ep group's contributions.

Beside tp, each expert's features split over tp (apply_expert_tensor_parallel), or with expert
tp 1 every expert whole and each MoE block on its tp rank's sequence shard (TokenShardBlock),
the ep groups then drawn from the dp x tp ranks (executor.mesh)."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.nn.utils.stateless import _reparametrize_module

from executor.errors import ExecutionError
from planner.executable import tp_name
from planner.models.moe import MoELayer


class _AllToAll(torch.autograd.Function):
    """Chunk j of the input (dim 0) to rank j of the group; chunk j of the output from rank
    j. With equal chunks its gradient is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class ExpertExchange:
    """What a MoE layer does with its dispatch buffer in place of computing all experts
    (MoELayer.exchange). Not a module: it holds no state a checkpoint would save."""

    def __init__(self, group, ep: int):
        self.group, self.ep = group, ep

    def __call__(self, x: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        e, groups, capacity, hidden = x.shape
        ep, local = self.ep, e // self.ep
        # [rank that owns the experts, its experts, ...]: chunk j goes to rank j
        received = _AllToAll.apply(x.reshape(ep, local, groups, capacity, hidden), self.group)
        # [sender, our experts, ...] -> our experts over every sender's groups
        tokens = received.transpose(0, 1).reshape(local, ep * groups, capacity, hidden)
        out = experts(tokens)
        back = out.reshape(local, ep, groups, capacity, hidden).transpose(0, 1)
        return _AllToAll.apply(back, self.group).reshape(e, groups, capacity, hidden)


class _AllToAllV(torch.autograd.Function):
    """Rows [sum(send), ...] out by `send` counts per rank, in by `receive` counts; its
    gradient goes back the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, receive: list[int], send: list[int], group):
        ctx.receive, ctx.send, ctx.group = receive, send, group
        return _exchange_rows(x, receive, send, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange_rows(grad, ctx.send, ctx.receive, ctx.group), None, None, None


def _exchange_rows(x: torch.Tensor, receive: list[int], send: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x, receive, send, group=group)
    return out


class RoutedExchange:
    """Dropless dispatch for transformers' experts modules (MixtralExperts and its kin:
    `forward(hidden_states, top_k_index, top_k_weights)` over 3-D gate_up_proj and
    down_proj): each (token, choice) row goes to the rank holding its expert, after every
    rank has learnt how many rows of each of its experts to expect; the rank's experts run
    their rows, the outputs come back, and each token sums its choices' outputs by their
    router weights, as transformers' loop does."""

    def __init__(self, group, ep: int, experts: int, rank: int):
        self.group, self.ep, self.experts, self.rank = group, ep, experts, rank

    def __call__(self, module, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        ep, local = self.ep, self.experts // self.ep
        k = top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # rows by expert, hence by owning rank
        token = order // k
        counts = torch.bincount(chosen, minlength=self.experts)
        expected = torch.empty_like(counts)  # [sender, our experts]: rows we will get
        dist.all_to_all_single(expected, counts, group=self.group)
        send = counts.view(ep, local).sum(1).tolist()
        receive = expected.view(ep, local).sum(1).tolist()
        rows = _AllToAllV.apply(hidden[token], receive, send, self.group)
        # received in (sender, expert) blocks: grouped by expert for the GEMMs, and back
        per_row = torch.arange(local, device=rows.device).repeat(ep)
        per_row = per_row.repeat_interleave(expected.view(-1).to(rows.device))
        by_expert = torch.argsort(per_row, stable=True)
        sizes = expected.view(ep, local).sum(0).tolist()
        outputs = []
        for e, x in enumerate(rows[by_expert].split(sizes)):
            gate, up = F.linear(x, module.gate_up_proj[e]).chunk(2, dim=-1)
            outputs.append(F.linear(module.act_fn(gate) * up, module.down_proj[e]))
        done = torch.cat(outputs)[torch.argsort(by_expert)]
        back = _AllToAllV.apply(done, send, receive, self.group)
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(hidden)
        return out.index_add(0, token, (back * weights).to(hidden.dtype))


def _is_hf_experts(module: nn.Module) -> bool:
    weights = [getattr(module, n, None) for n in ("gate_up_proj", "down_proj")]
    return all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights)


def _keep_local(experts: nn.Module, ep: int, rank: int) -> None:
    for name, p in list(experts.named_parameters(recurse=False)):
        local = p.shape[0] // ep
        mine = p.detach()[rank * local : (rank + 1) * local].clone()
        setattr(experts, name, nn.Parameter(mine, requires_grad=p.requires_grad))


def apply_expert_parallel(stage: nn.Module, mesh, ep: int) -> list[nn.Module]:
    """Keep this rank's E / ep experts of each MoE layer of the stage and exchange tokens
    over the mesh's ep group; returns the stages' expert modules (none where ep is 1)."""
    if ep == 1:
        return []
    group, rank = mesh["ep"].get_group(), mesh["ep"].get_local_rank()
    exchange = ExpertExchange(group, ep)
    found = []
    for layer in (m for m in stage.modules() if isinstance(m, MoELayer)):
        _keep_local(layer.experts, ep, rank)
        layer.exchange = exchange
        found.append(layer.experts)
    for experts in [m for m in stage.modules() if _is_hf_experts(m)]:
        routed = RoutedExchange(group, ep, experts.gate_up_proj.shape[0], rank)
        _keep_local(experts, ep, rank)
        experts.forward = partial(routed, experts)
        found.append(experts)
    return found


class _CopyToTensorParallel(torch.autograd.Function):
    """The same tensor on every tp rank, whose gradient there is a partial sum: identity
    forward, all-reduce backward (Megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """A partial sum on every tp rank made whole: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _split_forward(inner, group, hidden, top_k_index, top_k_weights) -> torch.Tensor:
    """An experts module whose experts each hold 1 / tp of their features: the tokens and
    router weights as given (their gradients summed over tp), the output summed over tp."""
    hidden = _CopyToTensorParallel.apply(hidden, group)
    top_k_weights = _CopyToTensorParallel.apply(top_k_weights, group)
    return _ReduceFromTensorParallel.apply(inner(hidden, top_k_index, top_k_weights), group)


def feature_slice(weight: torch.Tensor, name: str, tp: int, rank: int) -> torch.Tensor:
    """Tp rank `rank`'s features of an experts module's weight `name`: slice r of the gate and
    of the up halves of gate_up_proj [E, 2F, H], columns r of down_proj [E, H, F] (F / tp)."""
    if name == "gate_up_proj":
        f = weight.shape[1] // 2 // tp
        gate, up = weight.chunk(2, dim=1)
        return torch.cat([gate[:, rank * f : (rank + 1) * f], up[:, rank * f : (rank + 1) * f]], 1)
    f = weight.shape[2] // tp
    return weight[:, :, rank * f : (rank + 1) * f].clone()


def _keep_features(experts: nn.Module, tp: int, rank: int) -> None:
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(experts, name)
        mine = feature_slice(p.detach(), name, tp, rank)
        setattr(experts, name, nn.Parameter(mine, requires_grad=p.requires_grad))


def split_modules(shardings) -> frozenset[str]:
    """The experts modules a stage's shardings split over tp (their gate/up matmul "cols")."""
    return frozenset(
        s.module for s in shardings if s.kind == "grouped_mm" and tp_name(s.strategy) == "cols"
    )


def apply_expert_tensor_parallel(stage: nn.Module, modules: frozenset[str], tp_mesh) -> list:
    """Expert tensor parallelism (planner.intra_op.expert_layout): each of
    the stage's experts `modules` (transformers' experts modules the plan splits) keeps this
    tp rank's features of every expert it holds and sums its output over tp; returns them."""
    if tp_mesh.size() == 1 or not modules:
        return []
    group, rank, tp = tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size()
    names = dict(stage.named_modules())
    found = []
    for name in sorted(m for m in modules if m in names):
        experts = names[name]
        if not _is_hf_experts(experts):
            raise ExecutionError(
                f"module {name}: the plan splits its experts over tp, which needs "
                "transformers' experts module (3-D gate_up_proj and down_proj); it is "
                f"{type(experts).__name__}"
            )
        _keep_features(experts, tp, rank)
        experts.forward = partial(_split_forward, experts.forward, group)
        found.append(experts)
    return found


def whole_experts(
    experts: list[nn.Module], mesh, ep: int, split: list[nn.Module] = ()
) -> dict[int, torch.Tensor]:
    """Each expert weight (by id) with every rank's experts, gathered over the ep group, and
    with every tp rank's features for the `split` modules (expert tensor parallelism), for
    comparing a run with the single-process reference."""
    out: dict[int, torch.Tensor] = {}
    if split:
        group, tp = mesh["tp"].get_group(), mesh["tp"].size()
        for module in split:
            gate_up, down = (
                _gathered(p, tp, group) for p in (module.gate_up_proj, module.down_proj)
            )
            halves = [part.chunk(2, dim=1) for part in gate_up]
            gates, ups = (torch.cat([h[i] for h in halves], dim=1) for i in (0, 1))
            out[id(module.gate_up_proj)] = torch.cat([gates, ups], dim=1)
            out[id(module.down_proj)] = torch.cat(down, dim=2)
    if ep == 1:
        return out
    group = mesh["ep"].get_group()
    for module in experts:
        for p in module.parameters():
            parts = _gathered(out.get(id(p), p), ep, group)
            out[id(p)] = torch.cat(parts)
    return out


def _gathered(p: torch.Tensor, ranks: int, group) -> list[torch.Tensor]:
    local = p.detach()
    local = local.full_tensor() if hasattr(local, "full_tensor") else local
    parts = [torch.empty_like(local) for _ in range(ranks)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return parts


class TokenShardBlock(ParallelStyle):
    """Under sequence parallelism with expert tp 1, a MoE block run on this tp rank's sequence
    shard as it comes (planner.intra_op.expert_layout.token_shard_layout): its router's and
    shared experts' weights are replicated DTensors on tp, each forward using their local
    values with gradients marked partial sums (DTensor reduces them over tp once, as
    sequence parallelism's norms'); its experts module keeps plain weights, split over ep
    (apply_expert_parallel)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        experts = {id(p) for m in module.modules() if _is_hf_experts(m) for p in m.parameters()}
        replicated = []
        for owner_name, owner in module.named_modules():
            for attr, p in list(owner.named_parameters(recurse=False)):
                if id(p) in experts:
                    continue
                whole = distribute_tensor(p.detach(), device_mesh, [Replicate()])
                setattr(owner, attr, nn.Parameter(whole, requires_grad=p.requires_grad))
                replicated.append(f"{owner_name}.{attr}" if owner_name else attr)
        inner = module.forward

        def forward(*args, **kwargs):
            args = tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)
            kwargs = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in kwargs.items()}
            params = dict(module.named_parameters())
            local = {
                name: params[name].to_local(grad_placements=[Partial()])
                for name in replicated
                if isinstance(params.get(name), DTensor)
            }
            # torch.func.functional_call's own swap (functional_call itself would call
            # this forward again); a checkpointed layer's recompute comes through here too
            with _reparametrize_module(module, local):
                return inner(*args, **kwargs)

        module.forward = forward
        return module
