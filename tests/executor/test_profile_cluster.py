"""`autopar profile-cluster` on 2 gloo ranks writes a profile that loads and validates."""

from __future__ import annotations

import pytest

from api.cli import main
from planner.cluster.profile import load_cluster
from planner.cost.model import CostModel


@pytest.mark.distributed
def test_profile_cluster_two_gloo_ranks(tmp_path, capsys):
    out = tmp_path / "measured.yaml"
    code = main(
        [
            "profile-cluster",
            "--nproc-per-node",
            "2",
            "--max-bytes",
            str(2**18),
            "--repeats",
            "2",
            "-o",
            str(out),
        ]
    )
    assert code == 0
    profile = load_cluster(str(out))
    m = profile.measured
    assert profile.devices_per_node == 2 and m.when and "gloo" in m.where
    points = m.collectives["intra_node"]["all_reduce"]
    assert len(points) >= 4 and all(p.group_size == 2 for p in points)
    assert m.fits["intra_node"]["all_reduce"].bandwidth > 0
    assert m.achieved_flops["fp32"] > 0 and m.memory_bandwidth > 0
    assert CostModel(profile, "fp32").matmul_rate == m.achieved_flops["fp32"]
    shown = capsys.readouterr().out
    assert "all_reduce" in shown and "GFLOP/s" in shown
