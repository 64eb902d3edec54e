"""A single device's predicted peak, rebuilt here from the trace: model state, autocast's
low-precision weight copies (not under FSDP2's mixed precision), every saved tensor of the
micro-batch, and the loss's two logits-sized fp32 buffers once (the terms an H100 run
showed missing: bench/results/h100_execute.md)."""

from __future__ import annotations

import pytest

from planner.cluster.profile import load_cluster
from planner.evaluate.config import ParallelConfig
from planner.evaluate.predict import predict
from planner.plan import TrainingSettings
from tests.conftest import traced

CONFIG = {"layers": 2, "hidden": 256, "heads": 2, "kv_heads": 1, "ffn_hidden": 512, "vocab": 4096}


def _params(graph) -> int:
    return sum(
        p.numel for n in graph.nodes for name, p in n.params.items() if name not in n.shared_params
    )


def _peak(
    graph, dtype: str, microbatches: int, schedule: str = "1f1b", dp: int = 1, zero: int = 0
) -> int:
    cluster = load_cluster("dgx-h100").with_nodes(1)
    batch = 2 * microbatches * dp
    training = TrainingSettings(global_batch_size=batch, seq_len=256, dtype=dtype)
    config = ParallelConfig(dp, 1, 1, microbatches, schedule, zero=zero)
    return predict(graph, cluster, training, config).peak_memory_bytes


def _expected(graph, dtype: str, zero2_dp: int = 0) -> int:
    params = _params(graph)
    state = {"bf16": 2 + 2 + 12, "fp32": 4 + 4 + 8}[dtype]  # weights, grads, Adam + master
    copies = 2 if dtype == "bf16" else 0
    unsharded = 0
    if zero2_dp:  # FSDP2 gathers bf16 weights (kept to backward) and casts nothing else
        state, copies = 2 + (2 + 12) / zero2_dp, 0
        # one micro-batch: each unit's gradients are reduce-scattered in its backward, the
        # root unit's (embedding, final norm, head) after the whole backward; held unsharded
        # (2 bytes) at once, beside the others' shards: the head's and norm's (made first)
        # and the largest layer's, or at the end the embedding's (used before the layers)
        layers = [
            sum(p.numel for n in graph.nodes if n.layer == i for p in n.params.values())
            for i in range(graph.num_layers)
        ]
        first = next(i for i, n in enumerate(graph.nodes) if n.layer is not None)
        before = sum(p.numel for n in graph.nodes[:first] for p in n.params.values())
        root = params - sum(layers)
        held = root - before + max(max(layers), before)
        unsharded = held * 2 - held * 2 // zero2_dp
    saved = 0
    for n in graph.nodes:
        if n.op == "aten.rms_norm.default":  # CUDA's fused kernel: input and one rstd a row
            x = n.inputs[0]
            saved += x.nbytes + 4 * (x.numel // x.shape[-1])
        else:
            saved += n.saved_bytes
    loss = next(n for n in graph.nodes if n.op == "aten.cross_entropy_loss.default")
    return params * (state + copies) + unsharded + saved + 2 * loss.inputs[0].nbytes


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_single_device_peak_is_state_copies_saved_and_the_loss_workspace(dtype):
    graph = traced("llama3-8b", batch=2, seq=256, dtype=dtype, **CONFIG)
    assert _peak(graph, dtype, 1) == pytest.approx(_expected(graph, dtype), rel=1e-6)


def test_fsdp_sharded_stages_hold_no_autocast_copies():
    """ZeRO-2 over dp 2: the executor's FSDP2 MixedPrecisionPolicy keeps the gathered bf16
    weights (2 bytes a parameter, to backward) and shards gradients and Adam's state; no
    autocast copy. DDP (ZeRO-0) over the same dp keeps the copies."""
    graph = traced("llama3-8b", batch=2, seq=256, **CONFIG)
    zero2 = _peak(graph, "bf16", 1, dp=2, zero=2)
    assert zero2 == pytest.approx(_expected(graph, "bf16", zero2_dp=2), rel=1e-6)
    assert _peak(graph, "bf16", 1, dp=2, zero=0) == pytest.approx(_expected(graph, "bf16"))


def test_the_loss_workspace_is_held_once_not_per_micro_batch():
    """Four micro-batches of the same size under GPipe keep four times the saved tensors but
    the loss's buffers once."""
    graph = traced("llama3-8b", batch=2, seq=256, **CONFIG)
    one, four = _peak(graph, "bf16", 1, "gpipe"), _peak(graph, "bf16", 4, "gpipe")
    loss = next(n for n in graph.nodes if n.op == "aten.cross_entropy_loss.default")
    workspace = 2 * loss.inputs[0].nbytes
    saved_one = _expected(graph, "bf16") - workspace - _params(graph) * (16 + 2)
    assert four - one == pytest.approx(3 * saved_one, rel=1e-6)
