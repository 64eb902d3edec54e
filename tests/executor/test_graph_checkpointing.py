"""Activation checkpointing in graph mode: a checkpointed stage runs layer blocks' nodes again
in backward (and only those; under partial checkpointing only the first blocks'), with the
same gradients."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from executor.graph_mode import GraphStage, export_training
from executor.stage_model import build_full_model
from planner.cluster.profile import load_cluster
from planner.models.registry import FAMILIES, TrainingModule
from planner.request import resolve_request
from planner.search.search import search


def _plan():
    cluster = load_cluster("cpu-local").model_copy(update={"nodes": 1, "devices_per_node": 1})
    config = {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64}
    fields = {"global_batch_size": 2, "seq_len": 8, "dtype": "fp32", "optimizer": "sgd"}
    inputs = resolve_request({"name": "gpt-350m", "config": config}, cluster, fields).trace()
    return search(inputs).plan


def test_checkpointed_blocks_run_again_in_backward(tmp_path, monkeypatch):
    plan = _plan()
    (stage_plan,) = plan.stages
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        model, family = build_full_model(plan.request.model.model_dump(), 8)
        module = TrainingModule(model, FAMILIES[family].loss)
        x = torch.randint(0, 64, (2, 8))
        y = torch.randint(0, 64, (2, 8))
        exported = export_training(module, (x, y))
        calls: list[str] = []
        original = GraphStage._call

        def counting(self, node, env, resharded):
            calls.append(node.name)
            return original(self, node, env, resharded)

        monkeypatch.setattr(GraphStage, "_call", counting)
        runs, grads = {}, {}
        for checkpointed, count in (("none", 0), ("all", None), ("first", 1)):
            stage = GraphStage(exported, module, stage_plan.shardings, mesh)
            if count != 0:
                stage.checkpoint_blocks(stage_plan.modules, count=count)
            calls.clear()
            stage(x, y).backward()
            runs[checkpointed] = list(calls)
            grads[checkpointed] = {
                name: p.grad.full_tensor() for name, p in stage.canonical_parameters()
            }
        block_of = {
            s.node: s.module.split(".")[1]
            for s in stage_plan.shardings
            if s.module.startswith("blocks.")
        }
        again = runs["all"][len(runs["none"]) :]
        assert runs["all"][: len(runs["none"])] == runs["none"]
        # Backward recomputes block nodes only (torch stops a block's recompute once the
        # tensors backward needs are back), and some of each block.
        assert set(again) <= set(block_of)
        assert {block_of[n] for n in again} == {"0", "1"}
        # Partial checkpointing: the first block only.
        first = runs["first"][len(runs["none"]) :]
        assert first and {block_of.get(n) for n in first} == {"0"}
        for name, grad in grads["none"].items():
            torch.testing.assert_close(grads["all"][name], grad)
            torch.testing.assert_close(grads["first"][name], grad)
    finally:
        dist.destroy_process_group()
