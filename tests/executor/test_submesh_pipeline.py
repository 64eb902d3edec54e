"""Plans whose pipeline stages run on their own submeshes (Alpa's inter-operator pass) run on
4 gloo processes and match the single-process reference; the boundary reshards between
different (dp, tp) meshes are in the ledger the plan predicts."""

import pytest

from planner.search.search import search
from planner.search.space import SearchOptions
from planner.search.submeshes import plan_on_submeshes
from tests.conftest import planning_inputs
from tests.executor.equivalence import runs_as_planned

TINY = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128, "vocab": 128}
TRAINING = {"global_batch_size": 8, "seq_len": 16, "dtype": "fp32", "optimizer": "sgd"}


@pytest.fixture(scope="module")
def searched():
    """The search whose layouts the per-stage plans reuse (llama: untied embeddings)."""
    inputs = planning_inputs({"name": "llama3-8b", "config": TINY}, TRAINING, "cpu-local")
    return search(inputs, SearchOptions(executable_only=False))


def _stage_placements(plan, ranks) -> list[set]:
    """Per stage, the placements its ranks report for their parameters."""
    return [
        {tuple(v) for r in ranks if r["rank"] in st.ranks for v in r["placements"].values()}
        for st in plan.stages
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("zero", [0, 1])
def test_data_parallel_stage_into_a_tensor_parallel_one(searched, zero):
    """Stage 0 on dp 2 (ZeRO-0: replicated, gradients all-reduced; ZeRO-1: the sharded
    optimizer reduce-scatters them), stage 1 on tp 2: the activations go from two dp ranks'
    rows to a tp group that gathers them, the gradients back scaled from one dp rank's mean
    to two."""
    plan = plan_on_submeshes(searched, [(2, 1), (1, 2)], microbatches=2, zero=zero)
    assert plan.executable, plan.not_executable_reason
    assert [st.zero for st in plan.stages] == [zero, 0]
    assert plan.mesh.summary() == "pp2 on submeshes dp2 tp1 | dp1 tp2"
    assert [st.ranks for st in plan.stages] == [[0, 1], [2, 3]]
    ranks = runs_as_planned(plan)
    dp_stage, tp_stage = _stage_placements(plan, ranks)
    if zero == 0:
        assert dp_stage == {("R",)}  # FSDP2's replicate on the stage's dp mesh
    else:  # whole parameters, each rank stepping its shard of the flat buffers
        assert dp_stage == set()  # plain tensors: no FSDP2 wrapper
        sent = {(e["kind"], e["axis"]) for e in ranks[0]["steps"][-1]["ledger"]["comm"]}
        assert ("reduce_scatter", "dp") in sent and ("all_gather", "dp") in sent
    assert ("S(0)",) in tp_stage and ("S(1)",) in tp_stage  # column and row parallel
    # each micro-batch (4 rows): rank 0's 2 rows are stage-1 rank 2's piece, sent whole;
    # rank 2 gathers the other 2 from its tp peer (which had them from rank 1)
    sent = {(e["kind"], e["axis"]): e for e in ranks[0]["steps"][-1]["ledger"]["comm"]}
    gathered = {(e["kind"], e["axis"]): e for e in ranks[2]["steps"][-1]["ledger"]["comm"]}
    row = 16 * 64 * 4  # seq x hidden, fp32
    assert sent[("send", "pp")]["calls"] == 2
    assert sent[("send", "pp")]["bytes"] == 2 * 2 * row
    assert gathered[("all_gather", "tp")]["bytes"] == 2 * 4 * row  # its inputs' only
    assert ("all_gather", "tp") not in sent


@pytest.mark.distributed
@pytest.mark.parametrize("zero,ckpt", [(3, True), (2, "selective")])
def test_tensor_parallel_stage_into_a_sharded_one_with_recompute(searched, zero, ckpt):
    """Stage 0 on tp 2, stage 1 on dp 2 under ZeRO-3 (parameters gathered per micro-batch)
    or ZeRO-2 (kept from the first forward to the last backward), gradients reduce-scattered
    once, both stages checkpointing (every layer, or selectively): the tp group's rows split
    over the next stage's dp ranks, as the plan's ledger says."""
    shapes = [(1, 2), (2, 1)]
    plan = plan_on_submeshes(searched, shapes, microbatches=2, zero=zero, checkpointing=ckpt)
    assert plan.executable, plan.not_executable_reason
    assert [st.zero for st in plan.stages] == [0, zero]
    assert all(st.activation_checkpointing for st in plan.stages)
    policy = "full" if ckpt is True else ckpt
    assert {st.checkpoint_policy for st in plan.stages} == {policy}
    ranks = runs_as_planned(plan)
    tp_stage, sharded = _stage_placements(plan, ranks)
    assert sharded == {("S(0)",)}
    assert ("S(0)",) in tp_stage


def test_tied_embeddings_across_submeshes_are_refused_by_the_plan():
    """The executor sums tied gradients only between stages on one mesh: a GPT (tied
    embeddings) split over two submeshes is not executable, and says why."""
    gpt = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128}
    inputs = planning_inputs({"name": "gpt-350m", "config": gpt}, TRAINING, "cpu-local")
    found = search(inputs, SearchOptions(executable_only=False))
    plan = plan_on_submeshes(found, [(2, 1), (1, 2)], microbatches=2)
    assert not plan.executable
    assert "tied" in plan.not_executable_reason


def test_every_boundary_byte_sent_is_received(searched):
    """The plan's per-stage ledger: what one stage's ranks send across a boundary, the next
    stage's ranks receive (forward and gradient alike), whatever the two meshes."""
    for shapes in ([(2, 1), (1, 2)], [(1, 2), (2, 1)], [(1, 1), (1, 1), (2, 1)]):
        plan = plan_on_submeshes(searched, shapes, microbatches=2)
        totals = []
        for st in plan.stages:
            entries = {(e.kind, e.axis): e.bytes for e in st.predicted.ledger.comm}
            ranks = len(st.ranks)
            totals.append((entries[("send", "pp")] * ranks, entries[("recv", "pp")] * ranks))
        sent = sum(s for s, _ in totals)
        received = sum(r for _, r in totals)
        assert sent == received > 0, shapes
