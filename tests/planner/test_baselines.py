"""The baseline families' grids (planner.search.baselines) skip what the search's bounds rule
out: a configuration that fits under no split of the layers, or whose lower bound cannot beat
the best so far. The best of each family is the one predicting the whole grid finds."""

from __future__ import annotations

import json

import pytest

from planner.cluster.profile import load_cluster
from planner.parallel import fp8
from planner.parallel.tensor import MEGATRON_KINDS
from planner.request import resolve_request
from planner.search import baselines
from planner.vocab import BASELINE_KINDS

CASES = {  # model, config, cluster, nodes, global batch, seq
    "gpt-8xA100": ("gpt-1.3b", {"layers": 8}, "dgx-a100-80g", 1, 64, 1024),
    "gpt-16xV100": ("gpt-15b", {"layers": 8}, "aws-p3.16xlarge", 2, 128, 1024),
    # H100, bf16: fp8 recipes in the Megatron and torchtitan grids; 64K tokens: cp
    "llama-cp-16xH100": ("llama3-8b", {"layers": 4}, "dgx-h100", 2, 8, 65536),
    "moe-16xV100": ("moe-1.3b", {"layers": 4}, "aws-p3.16xlarge", 2, 64, 1024),
}


def _inputs(case: str, shorter: bool = False):
    model, config, cluster, nodes, batch, seq = CASES[case]
    profile = load_cluster(cluster).with_nodes(nodes)
    training = {"global_batch_size": batch, "seq_len": seq // 2 if shorter else seq}
    return resolve_request({"name": model, "config": config}, profile, training).trace()


def _plans(results) -> list:
    out = []
    for r in results:
        plan = None if r.plan is None else json.loads(r.plan.to_json())
        if plan is not None:
            for timing in ("time_s", "candidates_evaluated"):
                plan["search"].pop(timing)
        out.append((r.kind, plan))
    return out


@pytest.mark.parametrize("case", CASES)
def test_bounds_leave_each_familys_best_unchanged(case, monkeypatch):
    inputs = _inputs(case)
    pruned = [baselines.baseline(kind, inputs) for kind in BASELINE_KINDS]
    # the whole grid predicted: no configuration skipped
    monkeypatch.setattr(baselines, "fits_nowhere", lambda *a, **k: False)
    monkeypatch.setattr(baselines, "step_lower_bound", lambda *a, **k: 0.0)
    whole = [baselines.baseline(kind, inputs) for kind in BASELINE_KINDS]
    assert _plans(pruned) == _plans(whole)
    assert any(p.plan is not None for p in pruned)
    assert sum(p.evaluated for p in pruned) < sum(w.evaluated for w in whole)


def test_the_families_share_their_tables_and_find_the_same_best():
    inputs = _inputs("gpt-16xV100")
    alone = [baselines.baseline(kind, inputs) for kind in BASELINE_KINDS]
    shared = baselines.GridTables(inputs)
    together = []
    for kind in BASELINE_KINDS:
        before = len(shared.tables)
        together.append(baselines.baseline(kind, inputs, shared))
        if kind == "megatron":
            assert len(shared.tables) > before
        if kind == "fsdp_tp":  # torchtitan's grid is inside Megatron's: nothing new to price
            assert len(shared.tables) == before
    assert BASELINE_KINDS.index("megatron") < BASELINE_KINDS.index("fsdp_tp")
    assert _plans(together) == _plans(alone)
    # another request's tables are not used
    other = _inputs("gpt-16xV100", shorter=True)  # a shorter sequence: other shapes
    fresh = baselines.baseline("megatron", other, shared)
    assert _plans([fresh]) == _plans([baselines.baseline("megatron", other)])
    assert _plans([fresh]) != _plans(alone[:1])


@pytest.mark.parametrize("kind", ["megatron", "fsdp_tp"])
def test_the_grids_give_each_tp_rank_whole_heads(kind):
    profile = load_cluster("dgx-h100").with_nodes(4)  # tp up to 32 across nodes
    every = {tp for _, _, tp, _ in baselines._grid(kind, profile, 8, {})}
    assert {2, 4, 8} <= every
    heads = {"heads": 24, "kv_heads": 4}
    kept = {tp for _, _, tp, _ in baselines._grid(kind, profile, 8, heads)}
    assert kept == {tp for tp in every if 24 % tp == 0 and 4 % tp == 0}
    assert 8 not in kept and 2 in kept


@pytest.mark.parametrize("case", ["gpt-16xV100", "llama-cp-16xH100"])
def test_the_grids_adopt_the_searchs_tables_and_find_the_same_best(case, monkeypatch):
    from planner.search.search import search
    from planner.search.space import SearchOptions

    inputs = _inputs(case)
    alone = [baselines.baseline(kind, inputs) for kind in BASELINE_KINDS]
    found = search(inputs, SearchOptions(executable_only=False))
    shared = baselines.GridTables(inputs)
    shared.adopt(found.layouts)
    adopted = dict(shared.tables)
    assert adopted and shared.graphs
    for (b, tp, sp, recipe), table in adopted.items():  # Megatron's, with its sp choice
        assert found.layouts.tables[(fp8.table_kind(MEGATRON_KINDS[sp], recipe), b, tp)] is table
    priced = []
    real = baselines.build_table
    monkeypatch.setattr(baselines, "build_table", lambda g, *a: priced.append(1) or real(g, *a))
    together = [baselines.baseline(kind, inputs, shared) for kind in BASELINE_KINDS]
    assert _plans(together) == _plans(alone)
    assert all(shared.tables[key] is table for key, table in adopted.items())
    assert len(priced) == len(shared.tables) - len(adopted)  # only what the search had not
