"""Apply a plan to a model, in torchtitan's order: stage modules -> tensor-parallel styles ->
context and expert parallelism -> activation checkpointing -> FSDP2 on the dp axis (the
experts' on theirs) -> pipeline stages and schedule.

Every rank builds the whole model from the same seed (identical weights without a
broadcast), then keeps and parallelizes its own stages (one, or several with interleaving).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from executor.checkpointing import apply_checkpointing
from executor.context_parallel import apply_context_parallel
from executor.data_parallel import apply_data_parallel, unsynced_experts
from executor.errors import ExecutionError
from executor.expert_parallel import (
    apply_expert_parallel,
    apply_expert_tensor_parallel,
    split_modules,
)
from executor.fp8 import apply_fp8, compile_blocks
from executor.hf_stage import HFStage
from executor.mesh import own_mesh, sharding_mesh
from executor.pipeline import build_schedule, parameter_uses, tied_across_stages, tied_group
from executor.precision import LossScaler, loss_scaler
from executor.stage_model import build_stage
from executor.tensor_parallel import apply_tensor_parallel, vocab_parallel_loss
from planner.models.registry import FAMILIES
from planner.parallel import sequence
from planner.parallel.expert import ZERO1_REFUSAL
from planner.parallel.registry import stores

TIED_REFUSAL = (
    "its parameters are tied to another stage's (tied embeddings), which runs on another "
    "submesh; the executor sums tied gradients between stages on one mesh"
)

# The label torch's cross entropy (and transformers' data collators) leave out of the loss
IGNORE_INDEX = -100


@dataclass
class ParallelModel:
    """This rank's share of the model, ready to train."""

    stages: list[tuple]  # (plan stage, module), in pipeline order
    loss_fn: object
    schedule: object | None = None  # a pipelining schedule when pp > 1
    tied: list[nn.Parameter] = field(default_factory=list)  # summed across first/last stage
    tied_group: object | None = None
    scaler: LossScaler = field(default_factory=lambda: LossScaler(enabled=False))
    # Graph mode: every rank is given the global batch with its labels; the stages' reshards
    # slice it and the last stage's graph ends in the loss.
    global_inputs: bool = False
    # The loss runs on vocab-sharded logits under torch's loss_parallel (Megatron's layout)
    loss_parallel: bool = False
    # Both copies of tied embeddings are placed alike (the parallel styles shard the
    # embedding and the head by vocabulary rows), so each rank sums its own shard with its
    # counterpart's once their gradients are settled (executor.optim.settle_gradients)
    tied_alike: bool = False
    # Stages on their own submeshes (executor.submesh_pipeline): the first stage is given the
    # global batch and takes its rows itself; the group of the stages' messages and the
    # pipeline barrier, named "pp" in the ledger; the ranks holding each of this rank's
    # parameters (its stage's), for the gradient norm
    whole_batch: bool = False
    pp_group: object | None = None
    norm_holders: int | None = None
    # ZeRO-1 (executor.zero1): the units whose gradients are reduced together, and dp's group
    zero1_units: list[list[nn.Parameter]] = field(default_factory=list)
    zero1_group: object | None = None
    # Graph mode's ZeRO-0 (executor.graph_data_parallel): the units whose gradients are
    # all-reduced together over dp (mesh dim 0 of the stages' (dp, tp) mesh)
    dp_buckets: list[list[nn.Parameter]] = field(default_factory=list)
    # Expert parallelism (executor.expert_parallel): the expert modules, whose weights ep
    # ranks hold different slices of, and the dp x cp ranks, which the unwrapped ones'
    # gradients are divided by (executor.data_parallel.unsynced_experts), as the dense ones'
    # are averaged over them
    experts: list[nn.Module] = field(default_factory=list)
    ep: int = 1
    # Expert tensor parallelism (executor.expert_parallel.apply_expert_tensor_parallel): the
    # experts modules whose experts each hold 1 / tp of their features
    split_experts: list[nn.Module] = field(default_factory=list)
    tp: int = 1
    unsynced_experts: list[nn.Parameter] = field(default_factory=list)
    dp: int = 1
    # Labels with ignored positions (IGNORE_INDEX, e.g. padding): the step's counted labels
    # per micro-batch and data-parallel rank on average, so that each micro-batch's mean
    # loss is weighted by its own count (`loss`): gradients and loss are then the mean over
    # the batch's counted labels, as one process computes it. None: every label counts.
    labels_per_share: float | None = None

    def loss(self, output, target: torch.Tensor):
        """The loss of one micro-batch, as the schedule and the step back-propagate it."""
        value = self.loss_fn(output, target)
        if self.labels_per_share is None:
            return value
        counted = int((target != IGNORE_INDEX).sum())
        if counted == 0:  # all ignored: no gradient (a mean over none is NaN)
            return output.float().sum() * 0.0
        return value * (counted / self.labels_per_share)

    def expert_pieces(self) -> dict[int, int]:
        """Per expert weight (by id), into how many distinct slices the ep and tp ranks split
        it (executor.optim.clip_grad_norm)."""
        out = {id(p): self.ep for module in self.experts for p in module.parameters()}
        for module in self.split_experts:
            for p in module.parameters():
                out[id(p)] = out.get(id(p), 1) * self.tp
        return out

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for _, s in self.stages for p in s.parameters()]

    def container(self) -> nn.ModuleDict:
        return nn.ModuleDict({f"stage{st.index}": stage for st, stage in self.stages})


def built_on_meta(model: nn.Module, family: str) -> bool:
    """Whether `model` was built on the meta device (no values: each rank then allocates
    only its own stages' shards, and the weights are loaded afterwards)."""
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and not hasattr(model, "_init_weights"):
        raise ExecutionError(
            f"model: a {family} model built on the meta device; expected it built on a "
            "device, or a transformers model (whose _init_weights computes the buffers a "
            "checkpoint does not hold)"
        )
    return on_meta


def compute_buffers(model: nn.Module, stages: list[nn.Module]) -> None:
    """The buffers a checkpoint does not hold (rotary frequencies), computed by the model's
    own initializer for the modules that keep them, once each (interleaved chunks share
    the rotary module); parameters are left for load_state_dict."""
    seen: set[int] = set()
    for stage in stages:
        for module in stage.modules():
            if id(module) in seen or not module._non_persistent_buffers_set:
                continue
            seen.add(id(module))
            model._init_weights(module)


def tied_slots(stage: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that hold one shared parameter (tied embeddings)."""
    groups: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in stage.modules():
        for attr, p in module.named_parameters(recurse=False):
            groups.setdefault(id(p), []).append((module, attr))
    return [g for g in groups.values() if len(g) > 1]


def retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Tensor parallelism distributes each module's weight on its own; tie them again."""
    for (owner, attr), *others in groups:
        shared = getattr(owner, attr)
        for module, name in others:
            setattr(module, name, shared)


def _own_copies(stage: nn.Module, shared: list[str], held: set[int]) -> None:
    """A V schedule's device holds both ends of the model: its second chunk takes a copy of
    the tied parameters the first already holds (summed after backward, as FSDP2's own
    parameter objects are), so that no gradient is scaled or stepped twice."""
    for name in shared:
        p = stage.get_parameter(name)
        if id(p) in held:
            owner, _, attr = name.rpartition(".")
            setattr(stage.get_submodule(owner), attr, nn.Parameter(p.detach().clone()))


def units_of(stage: nn.Module) -> list[list[nn.Parameter]]:
    """A stage's parameters as FSDP2 wraps them: each layer block, then the rest."""
    blocks = [list(b.parameters()) for b in stage.owned_blocks().values()]
    inside = {id(p) for params in blocks for p in params}
    rest = [p for p in stage.parameters() if id(p) not in inside]
    return [params for params in [*blocks, rest] if params]


def parallelize(
    plan,
    model: nn.Module,
    family: str,
    mesh,
    rank: int,
    device: torch.device,
    loss_fn=None,
    pipeline_group=None,
) -> ParallelModel:
    """This rank's stages of `model` under `plan`; `loss_fn(output, labels)`: the loss on the
    last stage's output (default the family's language-model cross entropy). A plan whose
    stages run on their own submeshes: `mesh` is this rank's stage's and `pipeline_group`
    every rank's (executor.submesh_pipeline.build_stage_meshes)."""
    pp, ep = plan.mesh.shape[0], plan.mesh.ep or 1
    per_stage = plan.mesh.stage_meshes is not None
    stages, tied, zero1_units, experts, split_experts = [], [], [], [], []
    edp_mesh = mesh["edp"] if ep > 1 else None
    if ep > 1 and any(st.zero == 1 for st in plan.stages):
        raise ExecutionError(f"stages[].zero: {ZERO1_REFUSAL}")
    # the loss on vocab-sharded logits under torch's loss_parallel, as Megatron's layout has it
    vocab_loss = vocab_parallel_loss(plan)
    uses = parameter_uses(model)
    on_meta = built_on_meta(model, family)
    for st in (st for st in plan.stages if rank in st.ranks):
        first, last = st.index == 0, st.index == len(plan.stages) - 1
        stage = build_stage(model, family, st.layers[0], st.layers[1], first, last)
        stage = stage if on_meta else stage.to(device)
        if plan.fp8:
            stage.fp8_layers = apply_fp8(stage, plan.fp8, device)
        ties = tied_slots(stage)
        shared = tied_across_stages(stage, uses) if pp > 1 else []
        if shared and per_stage:
            raise ExecutionError(f"stages[{st.index}]: {TIED_REFUSAL}")
        _own_copies(stage, shared, {id(p) for _, held in stages for p in held.parameters()})
        apply_tensor_parallel(
            stage,
            st.shardings,
            mesh["tp"],
            stage.head_name,
            plan.sequence_parallel,
            share_inputs=family in sequence.FAMILIES,
            vocab_loss=vocab_loss,
            fold_experts=plan.mesh.dims.folded,
        )
        retie(ties)
        seq = plan.request.training.seq_len
        if plan.sequence_parallel and isinstance(stage, HFStage):
            stage.sequence_length = seq  # context parallelism's positions take precedence
        apply_context_parallel(stage, mesh, plan.mesh.cp or 1, seq, device, plan.mesh.cp_comm)
        stage_experts = apply_expert_parallel(stage, mesh, ep)
        experts += stage_experts
        split_experts += apply_expert_tensor_parallel(
            stage, split_modules(st.shardings), mesh["tp"]
        )
        if st.activation_checkpointing:
            apply_checkpointing(stage, st.checkpoint_policy, st.checkpointed_layers)
        if (mode := st.activation_store) is not None:  # its counter of the bytes it moved
            stage.stored_bytes = (mode, stores()[mode].apply_to(stage))
        if plan.fp8:
            compile_blocks(stage, device)
        dtype = plan.request.training.dtype
        apply_data_parallel(
            stage,
            sharding_mesh(mesh),
            st.zero,
            dtype,
            st.cpu_offload,
            stage_experts,
            edp_mesh,
            st.resharded_layers,
            own_mesh(mesh),
        )
        if on_meta:  # only this rank's shards take memory
            stage.to_empty(device=device)
            retie(ties)
        if st.zero == 1 and plan.mesh.stage_shape(st.index)[0] > 1:
            zero1_units += units_of(stage)
        stages.append((st, stage))
        tied += [stage.get_parameter(name) for name in shared]
    if on_meta:
        compute_buffers(model, [stage for _, stage in stages])
    loss_fn = loss_fn or FAMILIES[family].loss
    scaler = loss_scaler(plan.request.training.dtype)
    out = ParallelModel(
        stages,
        loss_fn,
        tied=tied,
        tied_group=None if per_stage else tied_group(mesh, pp, plan.schedule.name),
        scaler=scaler,
        loss_parallel=vocab_loss,
        tied_alike=True,
        zero1_units=zero1_units,
        zero1_group=mesh["dp"].get_group() if zero1_units else None,
        experts=experts,
        ep=ep,
        split_experts=split_experts,
        tp=mesh["tp"].size(),
        unsynced_experts=unsynced_experts(experts, edp_mesh),
        dp=mesh["dp"].size() if per_stage else plan.mesh.dims.dp * plan.mesh.dims.cp,
    )
    if per_stage:
        from executor.submesh_pipeline import SubmeshPipeline

        ((st, stage),) = stages

        def scaled(output, target):
            return out.loss(output, target) * scaler.scale

        out.schedule = SubmeshPipeline(plan, stage, st.index, mesh, pipeline_group, scaled, device)
        out.whole_batch, out.pp_group, out.norm_holders = True, pipeline_group, mesh.size()
    elif pp > 1:

        def scaled_loss(output, target):  # the schedule runs backward on what this returns
            return out.loss(output, target) * scaler.scale

        out.schedule = build_schedule(plan, stages, mesh.get_group("pp"), device, scaled_loss)
    return out
