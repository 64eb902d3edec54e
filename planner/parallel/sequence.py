"""Sequence parallelism (Megatron-SP; Korthikanti et al. 2022, section 4.2.2) on the tp axis:
a variant of Megatron's tensor-parallel layout (planner.intra_op.megatron, layout kind
"megatron_sp") in which the tensors between tp regions are sharded on the sequence.

Time: the tp all-reduces become a reduce-scatter (after the row-parallel linears and the
vocab-parallel embedding) and an all-gather (before the first column-parallel consumer of a
tensor), the same bytes on the wire (planner.cost.model prices each; a profile with measured
collectives may price the pair above the all-reduce, and there sequence parallelism loses);
norms, dropout and residual adds compute on 1/tp of the tokens; the norms' weight gradients
are all-reduced once per micro-batch. Memory: those ops' saved tensors count 1/tp; pipeline
sends carry 1/tp of the boundary activations. Search: a second Megatron layout per
(micro-batch, tp > 1) where the family's executor applies it and tp divides the sequence.
Plan fields: sequence_parallel, stages[].shardings (norms "dim1", outputs "S(1)").
"""

from __future__ import annotations

from planner.errors import InputError
from planner.parallel.choice import Choice
from planner.parallel.technique import ModelSupport, Pin, Technique
from planner.parallel.tensor import MEGATRON_KINDS, is_sequence_parallel
from planner.parallel_dims import Combination

_TEST = "tests/executor/test_execute.py::test_plan_matches_single_process_reference"
CHOICES = (
    Choice(
        "sequence_parallel",
        False,
        "executor.tensor_parallel:apply_tensor_parallel",
        f"{_TEST}[pp2xtp2-1f1b]",
    ),
    Choice(
        "sequence_parallel",
        True,
        "executor.tensor_parallel:apply_tensor_parallel",
        f"{_TEST}[pp2xtp2-sequence-parallel]",
    ),
)
# Model families whose stage modules the executor's sequence-parallel styles know (the
# norms, attention and MLP blocks whose input feeds column-parallel linears only, so it is
# gathered once; GPT's position table).
FAMILIES = frozenset({"gpt", "llama"})
# Hugging Face model types whose layers the executor's styles run as the layout prices them
# under sequence parallelism (bench/results/hf_conformance.md: each on gloo against its
# single-process reference and its ledger): norms before an attention module of q/k/v/o
# linears and an MLP module of linears, residual adds between them (Cohere's attention and
# MLP side by side), rotary positions from position_ids, which the stage passes for the
# whole sequence since the embeddings' output is a sequence shard, and attention masks of the
# whole sequence (sliding windows, a mask per layer type: executor.hf_stage); OLMo 2's norms
# after each block and over the whole q/k projections; Gemma's scaled embeddings (scaled
# after the reduce-scatter: executor.tensor_parallel); LayerNorms (Phi, Starcoder2, StableLM).
# Mixture-of-experts blocks and DeepSeek's latent attention run whole on every tp rank (their
# input gathered once, their output cut back to the shard: planner.intra_op.megatron's whole
# blocks), a shared expert inside (Qwen2-MoE's, DeepSeek's) tp-split as an MLP on the whole
# tokens.
HF_TYPES = frozenset(
    {
        *("llama", "mistral", "qwen2", "qwen3", "granite", "apertus", "arcee", "cohere"),
        *("ernie4_5", "exaone4", "helium", "olmo", "olmo2", "seed_oss"),
        *("gemma", "gemma2", "gemma3_text", "phi", "starcoder2", "stablelm"),
        *("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"),
    }
)


SUPPORT = ModelSupport("sequence parallelism", FAMILIES, HF_TYPES)


def refusal(family: str, seq_len: int, tp: int, model_config: dict | None = None) -> str | None:
    """Why this model cannot use sequence parallelism at this tp, or None."""
    if tp < 2:
        return "sequence parallelism shards across the tp group; tp is 1"
    if why := SUPPORT.refusal(family, model_config):
        return why
    if seq_len % tp:
        return f"tp = {tp} does not divide the sequence length {seq_len}"
    return None


def check_pin(
    layouts: tuple[str, ...],
    family: str,
    seq_len: int,
    combos: list[Combination],
    model_config: dict | None = None,
) -> None:
    """Sequence parallelism pinned (the only layout left) where no searched tp can use it is
    the user's to change: say why rather than that nothing fits."""
    tps = sorted({combo.tp for combo in combos})
    if layouts != ("megatron_sp",) or any(
        refusal(family, seq_len, tp, model_config) is None for tp in tps
    ):
        return
    why = refusal(family, seq_len, max(tps, default=1), model_config)
    raise InputError("search.sequence_parallel", str(why), "a model and tp it applies to")


def megatron_kinds(
    layouts: tuple[str, ...], family: str, seq_len: int, tp: int, model_config: dict | None = None
) -> list[str]:
    """The Megatron layouts (planner.parallel.tensor.MEGATRON_KINDS) among `layouts` that
    the search evaluates at this tp: the sequence-parallel one only where it applies."""
    ok = refusal(family, seq_len, tp, model_config) is None
    return [k for k in MEGATRON_KINDS if k in layouts and (ok or not is_sequence_parallel(k))]


PINS: tuple[Pin, ...] = (
    Pin(
        "sequence_parallel",
        "switch",
        "Megatron's sequence parallelism (norms and residuals sharded on the sequence; with "
        "tp_layout megatron)",
    ),
)


TECHNIQUE = Technique(
    "sequence",
    order=30,
    pins=PINS,
    choices=CHOICES,
    terms=("planner.parallel.sequence:megatron_kinds",),
)
