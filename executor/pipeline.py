"""Pipeline parallelism: torch.distributed.pipelining stages and schedules for the plan's
stages, and the gradient sum of parameters tied across the first and last stage."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from executor.errors import ExecutionError
from executor.zero1 import local_of
from planner.cost.schedule_v import V_SHAPED
from planner.cost.schedules import MULTI_CHUNK
from planner.vocab import SCHEDULES

# The plan's schedule names -> torch.distributed.pipelining classes.
SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
    "dualpipe_v": "ScheduleDualPipeV",
    "looped_bfs": "ScheduleLoopedBFS",
}
assert set(SCHEDULE_CLASSES) == set(SCHEDULES), "every schedule name needs a class"


def build_schedule(
    plan, stages: list, pp_group, device: torch.device, loss_fn, examples: dict | None = None
):
    """The schedule for this rank's (plan stage, module) pairs. `examples`: per stage index,
    example (inputs, outputs) for static shapes; without them torch infers the shapes by
    running the first micro-batch."""
    from torch.distributed import pipelining

    examples = examples or {}
    pipe_stages = []
    for st, stage in stages:
        inputs, outputs = examples.get(st.index, (None, None))
        pipe_stages.append(
            pipelining.PipelineStage(
                stage,
                st.index,
                len(plan.stages),
                device,
                input_args=inputs,
                output_args=outputs,
                group=pp_group,
            )
        )
    cls = getattr(pipelining, SCHEDULE_CLASSES[plan.schedule.name])
    m = plan.schedule.microbatches
    if plan.schedule.name in MULTI_CHUNK:  # a list of this rank's chunks, even of one
        return cls(pipe_stages, n_microbatches=m, loss_fn=loss_fn)
    return cls(pipe_stages[0], n_microbatches=m, loss_fn=loss_fn)


def tied_group(mesh, pp: int, schedule: str = "1f1b"):
    """One process group per (dp, tp) coordinate joining the first and last pipeline stage
    (each holds its own copy of tied embeddings); created in the same order on every rank.
    None where one device holds both (one stage, or the first device of a V schedule:
    sum_tied_grads adds the two copies in place)."""
    if pp == 1 or schedule in V_SHAPED:
        return None
    ranks = mesh.mesh.reshape(pp, -1, mesh.mesh.shape[-1])  # [pp, dp, tp] (HSDP: dp in two)
    mine = None
    for d in range(ranks.shape[1]):
        for t in range(ranks.shape[2]):
            pair = [int(ranks[0, d, t]), int(ranks[pp - 1, d, t])]
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                mine = group
    return mine


def parameter_uses(model: nn.Module) -> dict[int, int]:
    """How many module slots hold each parameter (2 for tied embeddings), by id. Taken on
    the whole model before stages are cut from it (a stage may drop modules in place)."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    return counts


def tied_across_stages(stage: nn.Module, uses: dict[int, int]) -> list[str]:
    """Names (in `stage`) of parameters the model shares with a part outside this stage: the
    first and last pipeline stages each hold a copy of tied embeddings whose gradients must be
    summed. Taken before wrapping, since tensor parallelism and FSDP replace the objects."""
    inside: dict[int, int] = {}
    for _, p in stage.named_parameters(remove_duplicate=False):
        inside[id(p)] = inside.get(id(p), 0) + 1
    return [name for name, p in stage.named_parameters() if uses[id(p)] > inside[id(p)]]


def sum_tied_grads(tied: list[nn.Parameter], group, alike: bool = False) -> None:
    """Sum the gradients of tied copies: across the first and last stage's ranks, or, where
    one rank holds both copies (the V schedules: ZB-V, DualPipeV), of its two copies.
    `alike`: both copies are placed alike (the module path's parallel styles), so each rank
    sums its own shard with its counterpart's."""
    if group is not None:
        for p in tied:
            if alike:
                dist.all_reduce(local_of(p.grad), group=group)
            else:
                sum_tied_grad(p, group)
        return
    if not tied:
        return
    if len(tied) != 2:
        raise ExecutionError(
            f"stages[0]: {len(tied)} tied parameters on the rank holding both ends of a V "
            "schedule; one tied pair (embedding and head) is supported"
        )
    first, second = tied  # the embedding's and the head's copy
    if first is second:  # still one parameter object: autograd has summed its gradient
        return
    if alike:  # the same shard of each copy: add them in place
        mine, other = local_of(first.grad), local_of(second.grad)
        mine.add_(other)
        other.copy_(mine)
        return
    total = _whole(first.grad) + _whole(second.grad)
    for p in tied:
        p.grad = _placed_like(total, p)


def _whole(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _placed_like(whole: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
    """`whole` as p's gradient, placed as p is (its gradient may have come back partial), in
    storage of its own: gradient clipping scales each copy in place."""
    if not isinstance(p.grad, DTensor):
        return whole.clone()
    replicated = [Replicate()] * p.grad.device_mesh.ndim
    local = DTensor.from_local(whole.clone(), p.grad.device_mesh, replicated, run_check=False)
    return local.redistribute(placements=p.placements)


def sum_tied_grad(p: nn.Parameter, group) -> None:
    """Add the other stage's gradient of a tied parameter. The two copies need not share
    placements (graph mode places each as its stage's first user asks; a DTensor gradient
    may come back replicated while its weight is row-sharded), so the stages sum whole
    gradients, and each keeps its own placements' share."""
    grad = p.grad
    if isinstance(grad, DTensor):
        whole = grad.full_tensor().contiguous()
        dist.all_reduce(whole, group=group)
        replicated = [Replicate()] * grad.device_mesh.ndim
        p.grad = DTensor.from_local(
            whole, grad.device_mesh, replicated, run_check=False
        ).redistribute(placements=p.placements)
    else:
        dist.all_reduce(grad, group=group)
