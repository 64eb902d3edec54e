"""Ring attention: context parallelism whose ranks pass key/value blocks round the cp group
while they attend (Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers
for Near-Infinite Context", arXiv:2310.01889; Megatron-LM's `--cp-comm-type p2p`,
torchtitan's `context_parallel_rotate_method = "alltoall"`).

Each cp rank keeps its two load-balanced chunks of the sequence (planner.parallel.context).
Forward: cp steps; in each the rank attends its queries to the key/value block it holds
(its own first) while it sends that block to the next rank and receives the previous
rank's, merging the blocks' outputs by their log-sum-exp. Backward: the blocks go round
again, each with its key and value gradients, which end at the block's owner after a last
pass. Per layer a rank sends cp - 1 blocks of K and V forward, and cp - 1 of K and V and cp
of their gradients backward, each 1/cp of the sequence at its kv heads; it keeps 1/cp of the
keys and values for backward, where the all-gather exchange keeps the whole sequence's.

Time: a step's transfer overlaps the step's block of attention (1/cp of the rank's
attention FLOPs, at the GEMM rate); what a transfer takes beyond its block is exposed, and
backward's last pass of the gradients is not hidden. No head constraint: any cp."""

from __future__ import annotations

from planner.parallel.choice import Choice
from planner.parallel.context import LayerAttention
from planner.parallel.technique import (
    Collective,
    ExchangeTerms,
    PinValues,
    SequenceExchange,
    Technique,
)

NAME = "ring"


def terms(layer: LayerAttention, cp: int, tp: int, kernels: str) -> ExchangeTerms:
    """Blocks of K and V sent and received (send/recv on the cp group, kv heads, this rank's
    1/cp of the sequence): 2 (cp - 1) each way forward, 2 (cp - 1) + 2 cp backward (the
    blocks and their gradients); kept: K and V at their kv heads where the traced attention
    keeps them repeated to every query head."""
    del kernels  # gloo and NCCL both send and receive
    each = int(layer.gathered / tp / cp / 2)
    forward, backward = 2 * (cp - 1), 2 * (cp - 1) + 2 * cp
    return ExchangeTerms(
        (Collective("send", each, forward), Collective("recv", each, forward)),
        (Collective("send", each, backward), Collective("recv", each, backward)),
        int((layer.gathered - layer.kept) / tp / cp),
        (layer.fwd_flops / tp / cp, layer.bwd_flops / tp / cp),
    )


def exposed(terms: ExchangeTerms, cost, axis) -> tuple[float, float]:
    """Each of the cp - 1 steps' transfer beyond its block of attention (a block: 1/cp of
    the rank's attention FLOPs), and backward's last pass of the gradients."""
    cp = axis.size
    each = terms.forward[0].nbytes
    block_fwd = cost.compute_time(terms.attention_flops[0], 0) / cp
    block_bwd = cost.compute_time(terms.attention_flops[1], 0) / cp
    forward = (cp - 1) * max(0.0, cost.send_recv(2 * each, axis) - block_fwd)
    backward = (cp - 1) * max(0.0, cost.send_recv(4 * each, axis) - block_bwd)
    return forward, backward + cost.send_recv(2 * each, axis)


EXCHANGE = SequenceExchange(
    NAME,
    "ring of K/V blocks",
    refusal=lambda _config, _cp, _tp: None,
    terms=terms,
    shard="executor.ring_attention:RingShard",
    megatron="p2p",
    torchtitan="alltoall",
    exposed=exposed,
)

_TEST = "tests/executor/test_ring_attention.py::test_ring_plan_matches_the_reference"
TECHNIQUE = Technique(
    NAME,
    order=42,  # with context parallelism: the attention layers' exchange
    pins=(),
    choices=(
        Choice("mesh.cp_comm", NAME, "executor.ring_attention:RingShard", f"{_TEST}[cp4-ckpt]"),
    ),
    terms=("planner.parallel.ring_attention:terms", "planner.parallel.ring_attention:exposed"),
    extends=(
        PinValues(
            "cp_comm",
            (NAME,),
            "ring: key/value blocks passed round the cp group while each rank attends "
            "(ring attention; transfers overlapped with attention)",
        ),
    ),
    exchange=EXCHANGE,
)
