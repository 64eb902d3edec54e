"""Context parallelism (cp) on the dp axis: groups of `cp` neighbouring dp ranks split each
sample's sequence instead of taking samples of their own. The sequence is cut into 2 x cp
chunks and rank r keeps chunks r and 2 cp - 1 - r, so that every rank holds as much of the
causal score matrix as the others; each rank computes its own tokens, and per layer its
attention gets what it needs of the others' tokens through the group's sequence exchange
(SequenceExchange, the plan's mesh.cp_comm): this module's all-gather of the whole
sequence's keys and values, as Llama 3 trained its long-context stage (Dubey et al. 2024,
"The Llama 3 Herd of Models", section 3.3.2: cp 16 at 128K tokens), or another declared one
(planner.parallel.ulysses, planner.parallel.ring_attention).

Time: every node's work is proportional to the rank's tokens, divided by cp (linear layers,
norms, the loss; causal attention too: a rank's two chunks together see exactly 1/cp of the
causal score matrix), plus the exchange's time per layer and micro-batch (forward, again in
any recomputation, and backward; the all-gather's K/V gathers and gradient reduce-scatters
are not overlapped with compute: the executor gathers, then attends). GEMMs are priced at
the rates of the unsplit sequence's shapes: at the lengths cp is searched for (MIN_SEQ and
up) a rank's GEMMs keep >= 8K/cp x micro-batch rows, where the measured tables are within a
few percent of their large-shape rate.
Memory: activations saved for backward divide by cp, plus what the exchange keeps beyond
that (the all-gather: the whole sequence's K and V at their kv heads, the executor attending
with the kernel's grouped-query support rather than repeating them to every query head, as
the traced model does); pipeline sends carry 1/cp of the boundary activations. Weights,
gradients and optimizer state do not change: cp ranks are dp ranks for the weights (FSDP
shards them and reduces gradients over all of dp, as torchtitan shards over dp_shard x cp).
Batch: the global batch is split over dp / cp replicas.
Search: cp in powers of two dividing dp where 2 cp divides the sequence, for sequences of
MIN_SEQ tokens and more (or pinned), each exchange the model's heads allow, with Megatron's
layouts on the model families the executor applies it to. Plan fields: mesh.cp, mesh.cp_comm.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cluster.mesh import contiguous_axes
from planner.cost.model import CostModel
from planner.errors import InputError
from planner.evaluate.layer_table import FIXED_PARTS, TOKEN_INDEPENDENT, LayerTable
from planner.graph.opgraph import OpGraph
from planner.limits import MAX_DEVICES
from planner.parallel.choice import Choice
from planner.parallel.registry import DEFAULT_EXCHANGE, exchange_of, exchanges
from planner.parallel.technique import (
    Collective,
    ExchangeTerms,
    ModelSupport,
    Pin,
    SequenceExchange,
    Technique,
)
from planner.parallel_dims import Combination

_TEST = "tests/executor/test_execute.py::test_plan_matches_single_process_reference"
CHOICES = (
    Choice("mesh.cp", 1, "executor.context_parallel:apply_context_parallel", f"{_TEST}[dp4-zero1]"),
    Choice(
        "mesh.cp",
        "2 or more",
        "executor.context_parallel:apply_context_parallel",
        f"{_TEST}[llama-dp2xcp2-zero1-selective-ckpt]",
    ),
)
# Families whose attention module the executor's context parallelism drives (the zoo's
# Llama: rotary positions per token, grouped-query attention), and the Hugging Face model
# types whose attention goes through transformers' attention interface with rotary
# positions from position_ids and the default 1/sqrt(head_dim) scale.
FAMILIES = frozenset({"llama"})
HF_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma"}
    | {"gemma2", "gemma3_text", "deepseek_v3"}
)  # the MoE types' attention is their dense siblings'; Gemma 1's is Llama's; Gemma 2's and
# 3's scale by query_pre_attn_scalar (the exchanges take transformers' scale) and window or
# soft-cap their scores (ring attention only: masked_attention_refusal); DeepSeek-V3's
# latent attention hands the interface whole heads' q, k (rope and no-rope parts) and v


SUPPORT = ModelSupport("context parallelism", FAMILIES, HF_TYPES)


MIN_SEQ = 8192  # shorter sequences are searched without cp (its gathers rarely pay there)
MAX_CP = 64


def refusal(
    family: str,
    seq_len: int,
    cp: int,
    dp: int,
    tp_layout: str = "megatron",
    comm: str | None = None,
    model_config: dict | None = None,
    tp: int = 1,
) -> str | None:
    """Why this model and mesh cannot use context parallelism of degree cp with the sequence
    exchange `comm` (None: all-gather), or None."""
    if cp == 1:
        return None
    if not isinstance(cp, int) or cp < 1 or dp % cp:
        return f"cp {cp!r} does not divide dp {dp}"
    if why := SUPPORT.refusal(family, model_config):
        return why
    if seq_len % (2 * cp):
        return f"2 x cp = {2 * cp} does not divide the sequence length {seq_len}"
    if tp_layout != "megatron":
        return "context parallelism runs with Megatron's tensor-parallel layout only"
    if comm is None:  # any exchange the model allows
        whys = [exchange_of(name).refusal(model_config or {}, cp, tp) for name in exchanges()]
        return None if None in whys else whys[0]
    if comm not in exchanges():
        return f"{comm!r} is not a sequence exchange: one of {', '.join(exchanges())}"
    return exchange_of(comm).refusal(model_config or {}, cp, tp)


def masked_attention_refusal(model_config: dict, exchange: str) -> str | None:
    """Why an exchange whose attention is the kernel's plain causal one (all-gather's,
    Ulysses') cannot run a model whose attention masks a sliding window or soft-caps its
    scores (transformers' Mistral, Gemma 2 and 3: planner.models.hf), or None. Ring
    attention computes its scores itself and applies both."""
    window = model_config.get("attention_window") or 0
    if 0 < window < (model_config.get("seq_len") or window + 1):
        what = f"attends within a sliding window of {window} tokens (sliding_window)"
    elif model_config.get("attention_softcap"):
        what = f"soft-caps its attention scores at {model_config['attention_softcap']:g}"
        what += " (attn_logit_softcapping)"
    else:
        return None
    return (
        f"the model {what}, which the {exchange} exchange's attention does not apply; "
        "ring attention (cp_comm ring) does"
    )


def cp_options(
    family: str, seq_len: int, dp: int, pinned: int | None, model_config: dict | None = None
) -> tuple[int, ...]:
    """cp degrees the search tries on a mesh with this dp: the pin, or 1 and (for sequences
    of MIN_SEQ tokens and more) every power of two that applies."""
    if pinned is not None:
        why = refusal(family, seq_len, pinned, dp, model_config=model_config)
        return (pinned,) if why is None else ()
    out = [1]
    if seq_len >= MIN_SEQ:
        cp = 2
        while cp <= min(dp, MAX_CP):
            if refusal(family, seq_len, cp, dp, model_config=model_config) is None:
                out.append(cp)
            cp *= 2
    return tuple(out)


@dataclass(frozen=True)
class AttentionBytes:
    """Per layer position and per sample, the bytes of attention's tensors: K and V
    `gathered` at their kv heads (before grouped-query attention repeats them), as the
    all-gather exchange gathers and keeps them, `kept` as the traced attention saves them
    (after the repeat); the queries and attention's output (`query`, `output`); the
    query and kv head counts (whole model); attention's FLOPs (forward, backward)."""

    gathered: list[float]
    kept: list[float]
    query: list[float]
    output: list[float]
    heads: list[int]
    kv_heads: list[int]
    fwd_flops: list[float]
    bwd_flops: list[float]

    @classmethod
    def of(cls, graph: OpGraph) -> AttentionBytes:
        n = max(graph.num_layers, 1)
        gathered, kept = [0.0] * n, [0.0] * n
        query, output, heads, kv_heads = [0.0] * n, [0.0] * n, [0] * n, [0] * n
        fwd_flops, bwd_flops = [0.0] * n, [0.0] * n
        pos = graph.positions
        producer = {(e.dst, e.dst_input): e.src for e in graph.edges}
        by_name = {node.name: node for node in graph.nodes}
        batch = max(graph.data.batch, 1)
        for node in graph.nodes:
            if node.kind != "attention" or len(node.inputs) < 3:
                continue
            layer = pos[node.name]
            query[layer] += node.inputs[0].nbytes / batch
            output[layer] += sum(t.nbytes for t in node.outputs[:1]) / batch
            heads[layer] = node.inputs[0].shape[1]  # [batch, heads, seq, head_dim]
            fwd_flops[layer] += node.fwd_flops / batch
            bwd_flops[layer] += node.bwd_flops / batch
            for i in (1, 2):
                kept[pos[node.name]] += node.inputs[i].nbytes / batch
                src = by_name.get(producer.get((node.name, i), ""))
                before = src.inputs[0] if src is not None and src.inputs else None
                if before is not None and "repeat_interleave" in src.op:
                    gathered[layer] += before.nbytes / batch
                    kv_heads[layer] = before.shape[1]
                elif before is not None and "reshape" in src.op and len(before.shape) == 5:
                    # transformers' repeat_kv: [b, kv, groups, s, d] expanded, then merged
                    gathered[layer] += node.inputs[i].nbytes / before.shape[2] / batch
                    kv_heads[layer] = before.shape[1]
                else:
                    gathered[layer] += node.inputs[i].nbytes / batch
                    kv_heads[layer] = node.inputs[i].shape[1]
        return cls(gathered, kept, query, output, heads, kv_heads, fwd_flops, bwd_flops)

    def at(self, layer: int, mbs: int) -> LayerAttention:
        return LayerAttention(
            self.gathered[layer] * mbs,
            self.kept[layer] * mbs,
            self.query[layer] * mbs,
            self.output[layer] * mbs,
            self.heads[layer],
            self.kv_heads[layer],
            self.fwd_flops[layer] * mbs,
            self.bwd_flops[layer] * mbs,
        )


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention tensors in a micro-batch, bytes over all heads and the whole
    sequence (AttentionBytes' fields; a tp rank holds 1/tp of the heads)."""

    gathered: float
    kept: float
    query: float
    output: float
    heads: int
    kv_heads: int
    fwd_flops: float
    bwd_flops: float


def all_gather_terms(layer: LayerAttention, cp: int, tp: int, kernels: str) -> ExchangeTerms:
    """Keys, then values, all-gathered at their kv heads; their gradients summed back in
    backward (a reduce-scatter; on gloo an all-reduce of the gathered size:
    executor.context_parallel); the gathered K and V kept for backward whole in place of
    the traced attention's repeated share."""
    each = int(layer.gathered / tp / 2)
    kept = int((layer.gathered - layer.kept / cp) / tp)
    if not each:
        return ExchangeTerms((), (), kept)
    back = "all_reduce" if kernels == "cpu" else "reduce_scatter"
    return ExchangeTerms((Collective("all_gather", each, 2),), (Collective(back, each, 2),), kept)


ALL_GATHER = SequenceExchange(
    DEFAULT_EXCHANGE,
    "all-gathered K/V",
    refusal=lambda config, _cp, _tp: masked_attention_refusal(config, DEFAULT_EXCHANGE),
    terms=all_gather_terms,
    shard="executor.context_parallel:ContextShard",
    megatron="allgather",
    torchtitan="allgather",
)


def comm_options(model_config: dict, cp: int, tp: int, pinned: str | None) -> tuple[str, ...]:
    """The sequence exchanges searched for cp ranks at this tp: the pinned one, or every
    declared one the model's heads allow (all-gather alone at cp = 1)."""
    if cp == 1:
        return (DEFAULT_EXCHANGE,)
    names = (pinned,) if pinned else tuple(exchanges())
    return tuple(n for n in names if exchange_of(n).refusal(model_config, cp, tp) is None)


def table_batch(mbs: int, cp: int) -> int:
    """The micro-batch whose table a cp rank's is made from (scaled_table): mbs / cp samples
    of the whole sequence run the same GEMMs as the rank's share of mbs samples (mbs x seq /
    cp tokens), so the GEMMs are timed at the rank's own shapes; mbs itself (its work
    divided by cp) where cp does not divide it."""
    return mbs // cp if cp > 1 and mbs % cp == 0 else mbs


def scaled_table(
    table: LayerTable,
    cp: int,
    attention: AttentionBytes,
    mbs: int,
    tp: int,
    cm: CostModel,
    comm: str = DEFAULT_EXCHANGE,
) -> LayerTable:
    """`table` (one micro-batch of table_batch(mbs, cp) samples, Megatron's layout at tp)
    as one cp rank of a micro-batch of `mbs` runs it: per-token work / cp where the table
    is of mbs samples, and each layer's sequence exchange (`comm`, its SequenceExchange's
    terms) on the cp group (stride tp, from rank 0): its collectives' time and what it keeps
    for backward beyond 1/cp of the traced attention's. Cached on the table per (cp, mbs,
    comm)."""
    key = f"cp:{cp}:{mbs}:{comm}"
    if cp == 1:
        return table
    if key in table.derived:
        return table.derived[key]  # type: ignore[return-value]
    split = cp if table_batch(mbs, cp) == mbs else 1
    axis = contiguous_axes(cm.cluster, 0, (cp, tp), ("cp", "tp"))[0]
    inside = _scaled_fields(table.inside, split)
    outside = _scaled_fields(table.outside, split)
    exchange = exchange_of(comm)
    for layer in range(table.num_positions):
        terms = exchange.terms(attention.at(layer, mbs), cp, tp, "cuda")
        forward, backward = exchange.times(terms, cm, axis)
        inside["comm_fwd"][layer] += forward
        inside["comm_bwd"][layer] += backward
        # recomputation exchanges again; the selective policies keep matmul/attention outputs
        inside["selective_recompute"][layer] += forward
        inside["selective_alternate_recompute"][layer] += forward
        inside["saved"][layer] = max(0, inside["saved"][layer] + terms.kept_bytes)
    out = LayerTable(
        table.num_positions,
        inside,
        outside,
        [x // split for x in table.layer_inputs],
        [x // split for x in table.cut_bytes],
        {k: _scaled(k, [v], split)[0] for k, v in table.before_layers.items()},
        table.uses,
        [x // split for x in table.largest_outputs],
    )
    table.derived[key] = out
    return out


def _scaled_fields(fields: dict[str, list], cp: int) -> dict[str, list]:
    """A table's per-position fields as one cp rank runs them: fwd and bwd less their
    token-independent parts (fp8's weight casts) divided by cp, those parts kept whole."""
    out = {k: _scaled(k, v, cp) for k, v in fields.items()}
    for key, fixed in FIXED_PARTS.items():
        if fixed in fields:
            pairs = zip(fields[key], fields[fixed], strict=True)
            out[key] = [t / cp + f * (1 - 1 / cp) for t, f in pairs]
    return out


def _scaled(key: str, values: list, cp: int) -> list:
    """One per-position field of a LayerTable divided by cp where it grows with the tokens."""
    if key in TOKEN_INDEPENDENT:
        return list(values)
    if isinstance(values[0], int) if values else False:
        return [v // cp for v in values]
    return [v / cp for v in values]


def dominated(combo: Combination, listed: set) -> bool:
    """Whether a search candidate is dominated by its half,
    (cp / 2, micro-batch / 2), when that is listed: the same tokens per rank and micro-batch
    count (so the same compute, parameters and pipeline), half the K/V bytes gathered in a
    group half the size, half the gathered K/V kept. Exact but for the GEMM rates, read at the
    unsplit micro-batch's shapes (flat at these sizes)."""
    return combo.cp > 1 and combo.mbs % 2 == 0 and combo.halved() in listed


def check_pin(
    pinned: int | None,
    family: str,
    seq_len: int,
    combos: list[Combination],
    pinned_comm: str | None = None,
    model_config: dict | None = None,
    tps: tuple[int, ...] = (1,),
) -> None:
    """A cp or sequence exchange pinned where no searched mesh can use it is the user's to
    change: say why rather than that nothing fits."""
    if pinned_comm is not None and not any(c.cp > 1 for c in combos):
        refusals = (
            exchange_of(pinned_comm).refusal(model_config or {}, pinned or 2, tp) for tp in tps
        )
        why = next((r for r in refusals if r), None) or (
            "no searched mesh splits the sequence (cp > 1): pin cp, or plan a longer sequence"
        )
        raise InputError("search.cp_comm", why, "an exchange the model's heads and cp allow")
    if pinned is None or pinned == 1 or any(c.cp == pinned for c in combos):
        return
    why = refusal(family, seq_len, pinned, pinned, model_config=model_config) or (
        f"no searched mesh has a dp that cp {pinned} divides with the global batch split "
        "over dp / cp replicas"
    )
    raise InputError("search.cp", why, "a cp the model, sequence and meshes allow")


PINS: tuple[Pin, ...] = (
    Pin(
        "cp",
        "count",
        "context parallelism: groups of N ranks split each sample's sequence, a degree of "
        "its own beside dp (1: none; default: searched for sequences of 8,192 tokens and "
        "more, 1 where the mesh is pinned)",
        low=1,
        high=MAX_DEVICES,
        metavar="N",
    ),
    Pin(
        "cp_comm",
        "choice",
        "how the ranks of a cp group exchange what attention needs of the others' tokens: "
        "all_gather (each layer's keys and values; Llama 3's), or another declared exchange "
        "(default: searched where cp > 1)",
        choices=(DEFAULT_EXCHANGE,),
    ),
)


TECHNIQUE = Technique(
    "context",
    order=40,
    pins=PINS,
    choices=CHOICES,
    terms=(
        "planner.parallel.context:scaled_table",
        "planner.parallel.context:table_batch",
        "planner.parallel.context:all_gather_terms",
    ),
    exchange=ALL_GATHER,
)
