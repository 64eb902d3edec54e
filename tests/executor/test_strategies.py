"""Every sharding strategy the planner can choose runs on 2 real gloo processes and matches the
single-process reference (SGD, loss and parameters after 2 steps).

Each case is a single-stage plan on a tp = 2 mesh in which every node of one kind runs one
strategy and the rest is replicated (planner/evaluate/forced_strategy.py); per-node layouts like
these run in graph mode. `test_the_cases_cover_every_strategy_the_rules_offer` keeps the list
complete: a strategy added to planner/intra_op/sharding_rules.py without a case fails it.
"""

import functools

import pytest

from executor.local_ranks import run_local
from executor.reference import distributed_losses, distributed_params, reference_run
from planner.cluster.profile import load_cluster
from planner.evaluate.forced_strategy import strategies_by_kind, strategy_plan
from planner.graph.tracing import trace_model
from planner.models import ModelSpec, resolve

MODELS = {
    "gpt": ModelSpec(name="gpt-350m", config={"layers": 2, "hidden": 64, "heads": 4, "vocab": 128}),
    "llama": ModelSpec(
        name="llama-7b",
        config={
            "layers": 2,
            "hidden": 64,
            "heads": 4,
            "kv_heads": 2,
            "ffn_hidden": 128,
            "vocab": 128,
        },
    ),
    "moe": ModelSpec(
        name="moe-380m",
        config={
            "layers": 2,
            "hidden": 64,
            "heads": 4,
            "experts": 4,
            "vocab": 128,
            "ffn_hidden": 128,
        },
    ),
}
TP, BATCH, SEQ = 2, 4, 16

# (kind, strategy) -> the model that exercises it (the first family that has the kind).
CASES = {
    **{("linear", s): "gpt" for s in ("batch", "batch+zero3", "col", "row", "seq", "seq+zero3")},
    **{
        ("embedding", s): "gpt"
        for s in ("batch", "batch+zero3", "hidden", "seq", "seq+zero3", "vocab")
    },
    **{("attention", s): "gpt" for s in ("batch", "heads")},
    **{("loss", s): "gpt" for s in ("batch", "vocab")},
    **{("norm", s): "gpt" for s in ("dim0", "dim0+zero3", "dim1", "dim1+zero3")},
    **{("elementwise", s): "gpt" for s in ("dim0", "dim1", "dim2")},
    **{("reshape", s): "gpt" for s in ("dim0", "dim1", "dim2", "dim3")},
    **{("input", s): "gpt" for s in ("dim0", "dim1")},
    ("constant", "dim0"): "gpt",
    ("elementwise", "dim3"): "llama",
    **{("concat", s): "llama" for s in ("dim0", "dim1", "dim2")},
    **{("constant", s): "moe" for s in ("dim1", "dim2", "dim3")},
    ("elementwise", "dim4"): "moe",
    **{("softmax", s): "moe" for s in ("dim0", "dim1")},
    **{("reduction", s): "moe" for s in ("dim0", "dim1", "dim2", "dim3", "dim4")},
    ("scatter", "dim0"): "moe",
    **{
        ("einsum", s): "moe"
        for s in (
            "split_c",
            "split_c+zero3",
            "split_e",
            "split_f",
            "split_g",
            "split_g+zero3",
            "split_m",
            "split_s",
        )
    },
}


@functools.cache
def _graph(family: str):
    """Each model traced once for all its cases (strategy_plan would trace it per case)."""
    return trace_model(resolve(MODELS[family]), BATCH, SEQ, "fp32")


def _cluster():
    return load_cluster("cpu-local").model_copy(update={"devices_per_node": TP})


def test_the_cases_cover_every_strategy_the_rules_offer():
    offered = set()
    for family in MODELS:
        for kind, names in strategies_by_kind(_graph(family), TP).items():
            offered |= {(kind, s) for s in names if s != "replicate"}
    assert offered == set(CASES), (
        f"without a case: {sorted(offered - set(CASES))}; "
        f"no longer offered: {sorted(set(CASES) - offered)}"
    )


@pytest.mark.distributed
@pytest.mark.parametrize(("kind", "strategy"), sorted(CASES), ids=lambda v: str(v))
def test_strategy_matches_single_process_reference(kind, strategy):
    family = CASES[kind, strategy]
    plan = strategy_plan(
        MODELS[family],
        _cluster(),
        kind,
        strategy,
        tp=TP,
        global_batch=BATCH,
        seq=SEQ,
        graph=_graph(family),
    )
    assert plan.executable and plan.tp_layout == "per_node"
    chosen = [
        s for st in plan.stages for s in st.shardings if s.kind == kind and s.strategy == strategy
    ]
    assert chosen, "the plan does not use the strategy under test"

    ranks = run_local(plan, steps=2)
    reference = reference_run(plan, steps=2)

    assert all(r["mode"] == "graph" for r in ranks)
    losses = distributed_losses(ranks, plan)
    assert losses == pytest.approx(reference["losses"], rel=1e-5)
    assert len(set(reference["losses"])) == 2  # the step trains: the loss moves
    params = distributed_params(ranks)
    assert set(params) == set(reference["params"]) - _tied_aliases(reference["params"], params)
    for name, values in params.items():
        assert values == pytest.approx(reference["params"][name], abs=1e-5), name
    # Parameters are stored as the plan places them (the first node that uses each decides).
    stored = ranks[0]["placements"]
    for s in chosen:
        for name, want in s.params.items():
            if name in stored and _first_user(plan, name) is s:
                assert stored[name] == want, (s.node, name)


def _tied_aliases(reference: dict, params: dict) -> set[str]:
    """Names the reference lists twice for one tied tensor (the LM head's weight)."""
    return {n for n in reference if n not in params and n.endswith("head.weight")}


def _first_user(plan, name: str):
    for st in plan.stages:
        for s in st.shardings:
            if name in s.params:
                return s
    return None
