"""Apply a plan in graph mode: export the training forward once, then run it whole (one
stage) or cut into the plan's pipeline stages (executor/graph_pipeline.py) under the plan's
schedule. The result trains with the same loop as the module path (executor/training.py)."""

from __future__ import annotations

import torch

from executor.errors import ExecutionError
from executor.graph_data_parallel import unit_buckets
from executor.graph_mode import GraphStage, export_training
from executor.graph_pipeline import cut
from executor.parallelize import ParallelModel
from executor.pipeline import build_schedule, tied_group
from executor.precision import loss_scaler
from planner.executable import GRAPH_FAMILIES, graph_mode_refusal


def _loss_is_output(loss: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    return loss.sum()  # the graph ends in the loss; the labels went in with the tokens


def parallelize_graph(plan, model, family: str, mesh, rank: int, device, micro) -> ParallelModel:
    """`micro`: one global micro-batch (tokens, labels), to export and size the stages with."""
    if family not in GRAPH_FAMILIES:
        raise ExecutionError(
            f"graph mode runs {', '.join(sorted(GRAPH_FAMILIES))} models; this plan's is {family}"
        )
    from planner.models.registry import TrainingModule, family_loss

    dp = plan.mesh.shape[1]
    why = graph_mode_refusal(
        dp,
        max(st.zero for st in plan.stages),
        0 < (plan.mesh.dp_shard or 0) < dp,
        cpu_offload=any(st.cpu_offload for st in plan.stages),
        checkpointing=next((m for st in plan.stages if (m := st.activation_store)), False),
        fp8=plan.fp8,
        expert_parallel=(plan.mesh.ep or 1) > 1,
    )
    if why is not None:  # the planner marks such plans not executable: the same function
        raise ExecutionError(why)
    module = TrainingModule(model, family_loss(family))
    exported = export_training(module, micro)
    scaler = loss_scaler(plan.request.training.dtype)
    stage_mesh = mesh["dp", "tp"]
    if len(plan.stages) == 1:
        (st,) = plan.stages
        stage = GraphStage(exported, module, st.shardings, stage_mesh).to(device)
        if st.activation_checkpointing:
            stage.checkpoint_blocks(st.modules, st.checkpoint_policy, st.checkpointed_layers)
        stages = [(st, stage)]
        return ParallelModel(
            stages,
            _loss_is_output,
            scaler=scaler,
            global_inputs=True,
            dp_buckets=unit_buckets(stages),
        )
    pipeline = cut(plan, exported, module, stage_mesh, rank, micro, device)
    pp = plan.mesh.shape[0]
    out = ParallelModel(
        pipeline.stages,
        _loss_is_output,
        tied=pipeline.tied,
        tied_group=tied_group(mesh, pp, plan.schedule.name),
        scaler=scaler,
        global_inputs=True,
        dp_buckets=unit_buckets(pipeline.stages),
    )

    def scaled_loss(loss, target):  # the schedule runs backward on what this returns
        return _loss_is_output(loss, target) * scaler.scale

    out.schedule = build_schedule(
        plan, pipeline.stages, mesh.get_group("pp"), device, scaled_loss, pipeline.examples
    )
    return out
