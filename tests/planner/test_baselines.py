"""The baseline families' grids (planner.search.baselines) skip what the search's bounds rule
out: a configuration that fits under no split of the layers, or whose lower bound cannot beat
the best so far. The best of each family is the one predicting the whole grid finds."""

from __future__ import annotations

import json

import pytest

from planner.cluster.profile import load_cluster
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
    model, config, cluster, nodes, batch, seq = CASES[case]
    profile = load_cluster(cluster).with_nodes(nodes)
    training = {"global_batch_size": batch, "seq_len": seq}
    inputs = resolve_request({"name": model, "config": config}, profile, training).trace()
    pruned = [baselines.baseline(kind, inputs) for kind in BASELINE_KINDS]
    # the whole grid predicted: no configuration skipped
    monkeypatch.setattr(baselines, "fits_nowhere", lambda *a, **k: False)
    monkeypatch.setattr(baselines, "step_lower_bound", lambda *a, **k: 0.0)
    whole = [baselines.baseline(kind, inputs) for kind in BASELINE_KINDS]
    assert _plans(pruned) == _plans(whole)
    assert any(p.plan is not None for p in pruned)
    assert sum(p.evaluated for p in pruned) < sum(w.evaluated for w in whole)
