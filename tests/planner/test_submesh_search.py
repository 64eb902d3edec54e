"""Stages on their own submeshes in the search (planner.search.submeshes, Alpa's inter-op
pass): the per-stage prediction prices one mesh exactly as predict() does; the search takes a
per-stage plan where it is predicted faster and keeps the uniform plan otherwise; the plan
says where each stage runs, loads back through its invariants, and is refused by the
executor and the exporters, which run one mesh."""

from __future__ import annotations

import json

import pytest

from api.export import EXPORTERS
from api.export.common import ExportError
from planner.cluster.profile import load_cluster
from planner.errors import InputError
from planner.evaluate.config import split_layers
from planner.evaluate.predict import GraphFacts, predict
from planner.evaluate.submeshes import StageMesh, predict_per_stage, stage_config
from planner.executable import execution_refusal
from planner.plan import Plan
from planner.request import resolve_request
from planner.search.search import search
from planner.search.space import SearchOptions
from tests.conftest import planning_inputs


def _p3(gpus: int):
    return load_cluster("aws-p3.16xlarge").with_nodes(gpus // 8)


@pytest.mark.parametrize(
    "dp,tp,pp,zero,ckpt,shard",
    [
        (4, 2, 2, 1, False, 0),
        (2, 2, 4, 3, True, 0),
        (8, 1, 2, 2, "selective", 0),
        (16, 1, 1, 3, False, 8),  # HSDP: sharded in a node, replicated across the two
        (4, 1, 4, 0, False, 0),
    ],
)
def test_one_mesh_for_every_stage_is_priced_as_predict_prices_it(dp, tp, pp, zero, ckpt, shard):
    """predict_per_stage with every stage on the same (dp, tp) at the places a uniform mesh
    puts them is predict(): the same step, memory and stage times, to the bit."""
    cluster = _p3(dp * tp * pp)
    model = {"name": "gpt-350m", "config": {"layers": 8, "hidden": 512, "heads": 8}}
    training = {"global_batch_size": 64, "seq_len": 256, "dtype": "fp16"}
    inputs = resolve_request(model, cluster, training).trace()
    mbs = 2
    m = 64 // (dp * mbs)
    graph = inputs.at(mbs)
    cfg = stage_config(dp, tp, pp, m, "1f1b", zero, ckpt, None, shard)
    ranges = [(0, 3), (3, 8)] if pp == 2 else split_layers(graph.num_layers, pp)
    whole = predict(graph, cluster, inputs.training, cfg, ranges=ranges)
    table = _table(graph, cluster, inputs.training, tp)
    meshes = [StageMesh(s * dp * tp, cfg, "megatron", mbs, table) for s in range(pp)]
    staged = predict_per_stage(GraphFacts.of(graph), cluster, inputs.training, meshes, ranges)
    got = staged.prediction
    assert got.step_time_s == pytest.approx(whole.step_time_s, rel=1e-12)
    assert got.peak_memory_bytes == whole.peak_memory_bytes
    assert [s.time for s in got.stages] == pytest.approx([s.time for s in whole.stages], rel=1e-12)
    assert got.dp_sync_s == pytest.approx(whole.dp_sync_s, rel=1e-12)
    assert staged.uniform


def _table(graph, cluster, training, tp):
    from planner.cluster.mesh import LogicalMesh
    from planner.cost.model import CostModel
    from planner.evaluate.layer_table import build_table
    from planner.intra_op.megatron import tensor_parallel_layout

    cm = CostModel(cluster, training.dtype, attention=training.attention)
    mesh = LogicalMesh.contiguous(cluster, 0, (1, tp))
    return build_table(graph, tensor_parallel_layout(graph, tp), cm, mesh)[0]


# Alpa's MoE-10B (experts on every other layer) on four p3.16xlarge nodes, batch 1024 fp16:
# the first stage (embeddings) on dp 1 x tp 8, the others on dp 4 x tp 2 or dp 2 x tp 4
# (bench/results/submeshes.md has the suite). Expert parallelism and
# checkpointing are left out to keep the search short (neither is in its best plans).
OPTIONS = {"ep": 1, "checkpointing": (False,), "executable_only": False}


@pytest.fixture(scope="module")
def moe_plans():
    inputs = resolve_request(
        {"name": "moe-10b"}, _p3(32), {"global_batch_size": 1024, "dtype": "fp16"}
    ).trace()
    return inputs, search(inputs, SearchOptions(**OPTIONS)).plan


def test_the_search_takes_stages_on_their_own_submeshes_where_faster(moe_plans):
    """Faster than the uniform search's best, which stays as the first alternative (the
    uniform search pinned on its own: test_where_one_mesh_is_best_the_search_keeps_one_mesh)."""
    _, searched = moe_plans
    uniform_best = searched.alternatives[0]
    meshes = searched.mesh.stage_meshes
    assert meshes is not None and len({tuple(m) for m in meshes}) > 1
    assert searched.predicted.step_time_s < uniform_best.step_time_s
    assert searched.mesh.shape == [len(meshes), 0, 0]
    # every stage on its own ranks, all ranks once, each laid out [dp][tp]
    flat = sorted(r for st in searched.stages for r in st.ranks)
    assert flat == list(range(32))
    for st, (dp, tp, *_), grid in zip(searched.stages, meshes, searched.mesh.ranks, strict=True):
        assert (st.logical_mesh.dp, st.logical_mesh.tp) == (dp, tp)
        assert len(grid) == dp and {len(row) for row in grid} == {tp}
    # the explanation names the margin
    assert any("its own submesh" in line for line in searched.explanation)
    assert any("every stage on one mesh" in line for line in searched.explanation)
    # its layouts are per node (graph mode) and its embeddings tied across submeshes: the
    # executor's per-stage pipeline takes neither (executor.submesh_pipeline)
    assert not searched.executable
    assert "graph mode" in searched.not_executable_reason
    assert "tied embeddings" in searched.not_executable_reason
    assert "stage-submesh DP" in searched.search.solver


def test_a_per_stage_plan_loads_back_and_a_broken_one_is_refused_by_field(moe_plans):
    _, searched = moe_plans
    assert Plan.from_json(searched.to_json()) == searched
    data = json.loads(searched.to_json())
    data["mesh"]["ranks"][0], data["mesh"]["ranks"][1] = (
        data["mesh"]["ranks"][1],
        data["mesh"]["ranks"][0],
    )
    with pytest.raises(InputError) as err:
        Plan.from_json(json.dumps(data))
    assert err.value.field.startswith("plan.mesh.ranks") or ".stages[" in err.value.field
    data = json.loads(searched.to_json())
    data["mesh"]["stage_meshes"] = None
    with pytest.raises(InputError, match="stage_meshes"):
        Plan.from_json(json.dumps(data))


def test_one_mesh_runtimes_refuse_a_per_stage_plan(moe_plans):
    _, searched = moe_plans
    refused = execution_refusal(searched)
    assert refused is not None and refused[0] == "executable"
    for target, export in EXPORTERS.items():
        with pytest.raises(ExportError) as err:
            export(searched)
        assert err.value.field == "mesh.stage_meshes", target


def test_where_one_mesh_is_best_the_search_keeps_one_mesh(moe_plans):
    """Without tensor parallelism nothing per stage beats one mesh here: the plan keeps one
    mesh for every stage. The pass may still find a faster layer split on that mesh (the
    uniform stage DP balances the slowest stage; the pass prices the whole step): here
    on pp4 dp4, 9.60 s with the last two stages on layers [7, 11) and [11, 16) against the
    uniform search's [7, 12) and [12, 16) at 10.60 s."""
    inputs, _ = moe_plans
    narrow = {**OPTIONS, "max_tp": 1}
    uniform = search(inputs, SearchOptions(stage_meshes=("uniform",), **narrow)).plan
    searched = search(inputs, SearchOptions(**narrow)).plan
    assert searched.mesh.stage_meshes is None
    assert searched.mesh == uniform.mesh
    assert searched.executable
    assert searched.predicted.step_time_s <= uniform.predicted.step_time_s


def test_per_stage_pins_the_search_cannot_honour_are_refused_by_name():
    from planner.request import search_options

    with pytest.raises(InputError) as err:
        search_options({"stage_meshes": "per_stage", "mesh": [1, 8, 1]})
    assert err.value.field == "search.stage_meshes"
    with pytest.raises(InputError) as err:
        search_options({"stage_meshes": "sideways"})
    assert err.value.field == "search.stage_meshes"
    # the executor runs per-stage plans: the pin is taken in an executable search, whose
    # plan is one the executor runs (here the pass's best split is on one mesh)
    inputs = planning_inputs(
        {"name": "gpt-350m", "config": {"layers": 2, "hidden": 256, "heads": 4}},
        {"global_batch_size": 8, "seq_len": 64},
    )
    plan = search(inputs, SearchOptions(stage_meshes=("per_stage",))).plan
    assert plan.executable and "stage-submesh DP" in plan.search.solver


def test_the_viewer_and_the_terminal_name_each_stages_submesh(moe_plans):
    from api.render import plan_summary
    from api.viewer import render_page

    _, searched = moe_plans
    meshes = searched.mesh.stage_meshes
    page = render_page(searched, [])
    per = " | ".join(f"dp{m[0]} tp{m[1]}" for m in meshes)
    assert f"pp{len(meshes)} on submeshes {per}" in page
    for s, (dp, tp, *_) in enumerate(meshes):
        assert f"stage {s} on dp{dp} × tp{tp}" in page  # the device grid's labels
    assert f"on submeshes {per}" in plan_summary(searched)
