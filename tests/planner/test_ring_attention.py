"""Ring attention (planner/parallel/ring_attention.py): where its transfers hide behind
attention and what it keeps, against figures computed here from the model's config and the
profile's YAML; where the search takes it and where it does not; its exports. The executor
runs it against the single-process reference: tests/executor/test_ring_attention.py."""

from pathlib import Path

import pytest
import yaml

from api.export import megatron, torchtitan
from tests.planner.test_ulysses import HEAD_DIM, HIDDEN, KV_HEADS, LAYERS, _estimate, _searched

ROOT = Path(__file__).resolve().parents[2]


def _send_recv(nbytes: float) -> float:
    """One ring step on dgx-h100's NVLink (a block out, the previous rank's in), from the
    profile's YAML."""
    profile = yaml.safe_load((ROOT / "cluster_profiles" / "dgx-h100.yaml").read_text())
    link = profile["links"]["intra_node"]
    beta = float(link["bandwidth"]) * float(profile["efficiency"]["comm"])
    return float(link["latency"]) + nbytes / beta


def test_at_long_sequences_only_the_gradients_last_pass_is_exposed():
    # 128K tokens, cp 4: a block is 32K tokens, whose attention takes far longer than
    # passing its keys and values on; backward's last pass of the K/V gradients is not hidden
    seq, cp = 131072, 4
    ring = _estimate(seq, cp, "ring")
    block = seq / cp * KV_HEADS * HEAD_DIM * 2  # a rank's K (or V), bf16
    assert ring.stages[0].predicted.comm_s == pytest.approx(LAYERS * _send_recv(2 * block))
    # kept: 1/cp of everything, K and V at their kv heads (the traced model repeats them)
    whole = _estimate(seq, 1, "all_gather").stages[0].predicted.memory.activations
    repeated, own = 2 * seq * HIDDEN * 2, 2 * seq * KV_HEADS * HEAD_DIM * 2
    acts = ring.stages[0].predicted.memory.activations
    assert acts == pytest.approx(whole / cp + LAYERS * (own - repeated) / cp, rel=1e-6)


def test_at_short_sequences_the_transfers_beyond_each_block_are_exposed():
    seq, cp = 8192, 8
    short = _estimate(seq, cp, "ring", kv_heads=32).stages[0].predicted.comm_s
    block = seq / cp * HIDDEN * 2
    # at least the gradients' last pass; at most every transfer unhidden
    everything = LAYERS * (
        (cp - 1) * _send_recv(2 * block) + (cp - 1) * _send_recv(4 * block) + _send_recv(2 * block)
    )
    assert LAYERS * _send_recv(2 * block) < short < everything


def test_the_search_takes_the_ring_where_attention_hides_it_and_not_elsewhere():
    # grouped-query attention at cp 2: each block's K/V are small beside its attention
    gqa = _searched(kv_heads=8, cp=2)
    assert gqa.mesh.cp_comm == "ring" and gqa.mesh.dims.summary().endswith("cp2 (ring) tp1")
    # multi-head attention at 8K tokens and cp 8: 1K-token blocks hide little; Ulysses
    assert _searched(kv_heads=32, cp=8).mesh.cp_comm == "ulysses"


def test_exports_name_the_ring():
    plan = _estimate(16384, 2, "ring", layers=32)  # torchtitan's 8B flavor, whole
    assert "--cp-comm-type p2p" in megatron.export(plan)
    assert 'context_parallel_rotate_method = "alltoall"' in torchtitan.export(plan)
