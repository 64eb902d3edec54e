"""Selective activation checkpointing (planner/parallel/checkpointing.py): the bytes the
planner says each layer keeps are the bytes torch's selective checkpointing stores under the
executor's policy; the search takes it where it fits and full checkpointing is the only other
way, and leaves it where only full checkpointing fits. The executor runs it against the
single-process reference (tests/executor/test_execute.py, cases pp2xtp2-selective-ckpt and
dp2xtp2-per-node-selective-ckpt)."""

import pytest
import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from executor.checkpointing import alternate_contexts, selective_contexts
from planner.graph.tracing import trace_model
from planner.intra_op.megatron import tensor_parallel_layout
from planner.models import ModelSpec, resolve
from planner.parallel.checkpointing import (
    ALTERNATE,
    SELECTIVE,
    linear_ordinals,
    selective_kept_bytes,
)
from planner.search.search import search
from planner.search.space import SearchOptions
from tests.conftest import planning_inputs

MODELS = {
    "gpt": ("gpt-350m", {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128}),
    "llama": (
        "llama3-8b",
        {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128, "vocab": 128},
    ),
}


def _stored_bytes(contexts) -> int:
    """Bytes of the tensors torch's selective checkpointing stored in forward (its caching
    mode's storage: op -> call index -> outputs, wrapped)."""
    stored = contexts[0].storage
    leaves = [w for per_op in stored.values() for out in per_op.values() for w in tree_leaves(out)]
    tensors = [getattr(w, "val", w) for w in leaves]
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


POLICIES = {SELECTIVE: selective_contexts, ALTERNATE: alternate_contexts}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("family", sorted(MODELS))
def test_kept_bytes_are_what_torch_stores_under_the_executors_policy(family, policy):
    name, config = MODELS[family]
    resolved = resolve(ModelSpec(name=name, config=config))
    batch, seq = 2, 16
    graph = trace_model(resolved, batch, seq, "fp32")
    layouts = tensor_parallel_layout(graph, 1)
    nth = linear_ordinals(graph)
    planned = sum(
        selective_kept_bytes(n, layouts[n.name], 1, nth.get(n.name, 0), policy)
        for n in graph.layer_nodes[1]
    )
    torch.manual_seed(0)
    model = resolved.build(device="cpu").model
    block = (model.blocks if family == "gpt" else model.layers)[1]
    x = torch.randn(batch, seq, config["hidden"], requires_grad=True)
    contexts = POLICIES[policy]()
    out = checkpoint(block, x, use_reentrant=False, context_fn=lambda: contexts)
    assert planned > 0 and _stored_bytes(contexts) == planned
    out.sum().backward()  # and the recomputation runs
    assert x.grad is not None


def test_the_alternating_policy_keeps_the_odd_linear_layers():
    """Llama's q, k, v, o, w1, w3, w2 in forward order: q, v, w1 and w2 kept (torchtitan's
    op-level policy); attention kept under both policies."""
    name, config = MODELS["llama"]
    graph = trace_model(resolve(ModelSpec(name=name, config=config)), 2, 16, "fp32")
    layouts = tensor_parallel_layout(graph, 1)
    nth = linear_ordinals(graph)
    kept = {
        n.module.rsplit(".", 1)[-1]
        for n in graph.layer_nodes[1]
        if selective_kept_bytes(n, layouts[n.name], 1, nth.get(n.name, 0), ALTERNATE)
    }
    assert kept == {"q_proj", "v_proj", "w1", "w2", "attention"}


@pytest.mark.parametrize("sp", [False, True], ids=["plain", "sequence-parallel"])
def test_a_column_output_is_kept_as_its_shard_a_row_output_whole(sp):
    name, config = MODELS["gpt"]
    graph = trace_model(resolve(ModelSpec(name=name, config=config)), 2, 16, "fp32")
    layouts = tensor_parallel_layout(graph, 4, sequence_parallel=sp)
    nodes = {n.module: n for n in graph.layer_nodes[1] if n.kind == "linear"}
    column, row = nodes["blocks.1.attn.q_proj"], nodes["blocks.1.attn.out_proj"]
    assert layouts[column.name].strategy == "col" and layouts[row.name].strategy == "row"
    kept = selective_kept_bytes(column, layouts[column.name], 4)
    assert kept * 4 == column.outputs[0].nbytes  # its input, gathered or not, is not kept
    # the matmul returns the partial sum before its all-reduce / reduce-scatter
    assert selective_kept_bytes(row, layouts[row.name], 4) == row.outputs[0].nbytes


def _inputs(memory_gib=None):
    training = {"global_batch_size": 16, "seq_len": 1024, "dtype": "bf16"}
    return planning_inputs({"name": "gpt-350m"}, training, memory_gib=memory_gib)


def _plan(inputs, checkpointing):
    options = SearchOptions(
        mesh=(1, 1, 8), layouts=("megatron",), checkpointing=checkpointing, microbatch_sizes=(16,)
    )
    return search(inputs, options).plan


def _peak(plan) -> float:
    return plan.predicted.peak_memory_bytes / 2**30


def test_selective_wins_between_the_peaks_and_loses_below_its_own():
    ample = _inputs()
    none, selective, full = (_plan(ample, (c,)) for c in (False, "selective", True))
    # Less recomputation than full checkpointing, more memory; less memory than none.
    assert none.predicted.step_time_s < selective.predicted.step_time_s
    assert selective.predicted.step_time_s < full.predicted.step_time_s
    assert _peak(full) < _peak(selective) < _peak(none)
    between = _plan(_inputs((_peak(selective) + _peak(none)) / 2), (False, "selective", True))
    assert {st.checkpoint_policy for st in between.stages} == {"selective"}
    assert all(st.activation_checkpointing for st in between.stages)
    below = _plan(_inputs((_peak(full) + _peak(selective)) / 2), (False, "selective", True))
    assert {st.checkpoint_policy for st in below.stages} == {"full"}
    assert below.predicted.step_time_s > between.predicted.step_time_s


def test_alternating_wins_where_selective_does_not_fit_and_loses_where_it_does():
    ample = _inputs()
    modes = (False, "selective", "selective_alternate", True)
    selective, alternate, full = (_plan(ample, (c,)) for c in modes[1:])
    # Half the matmul outputs recomputed: between selective and full in time and memory.
    assert selective.predicted.step_time_s < alternate.predicted.step_time_s
    assert alternate.predicted.step_time_s < full.predicted.step_time_s
    assert _peak(full) < _peak(alternate) < _peak(selective)
    between = _plan(_inputs((_peak(alternate) + _peak(selective)) / 2), modes)
    assert {st.checkpoint_policy for st in between.stages} == {"selective_alternate"}
    roomy = _plan(_inputs((_peak(selective) + _peak(_plan(ample, (False,)))) / 2), modes)
    assert {st.checkpoint_policy for st in roomy.stages} == {"selective"}
    below = _plan(_inputs((_peak(full) + _peak(alternate)) / 2), modes)
    assert {st.checkpoint_policy for st in below.stages} == {"full"}


def test_zero_bubble_schedules_are_not_offered_with_checkpointing():
    """torch's selective checkpointing allows one backward through a region; the zero-bubble
    schedules run two (a ZB-V run failed: "Trying to backward an extra time"). Full and
    partial checkpointing run, but keep what they rebuild for the first until the second:
    more memory than without (the activation peak measured). A pin of both is refused
    naming the field; the search leaves the pair out. An activation store (activation
    offload) recomputes nothing and stays."""
    from planner.errors import InputError
    from planner.parallel.checkpointing import schedule_refusal
    from planner.parallel.registry import stores
    from planner.search.space import pinned_options

    for schedule in ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipe_v"):
        for mode in ("selective", "selective_alternate", True, "partial"):
            assert schedule_refusal(schedule, mode)
        for pin in ("selective", "selective_alternate", "on", "partial"):
            with pytest.raises(InputError, match=r"search\.checkpointing"):
                pinned_options(schedule=schedule, checkpointing=pin)
        assert all(schedule_refusal(schedule, mode) is None for mode in stores())
        assert schedule_refusal(schedule, False) is None
    assert schedule_refusal("1f1b", "selective") is None
    assert schedule_refusal("1f1b", True) is None
