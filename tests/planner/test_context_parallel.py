"""Context parallelism (planner/parallel/context.py): cp dp ranks split each sample's sequence,
all-gathering keys and values per layer. The search takes it for long sequences, where one
sample's activations crowd the device, and leaves it for short ones, where its gathers are
pure cost. Its terms are checked against figures computed here from the model's config and
the profile's YAML. The executor runs it against the single-process reference:
tests/executor/test_execute.py, cases llama-*-cp2-*."""

from pathlib import Path

import pytest
import yaml

from planner.cluster.profile import load_cluster
from planner.errors import InputError
from planner.evaluate.config import ParallelConfig
from planner.evaluate.estimate import evaluate
from planner.graph.tracing import trace_model
from planner.models import ModelSpec, resolve
from planner.parallel import context
from planner.parallel_dims import Combination
from planner.plan import Plan, TrainingSettings
from planner.request import model_ref, resolve_request
from planner.search.search import search
from planner.search.space import SearchOptions, combinations

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 2
# Llama 3 8B's widths: 32 query heads, 8 kv heads of 128
MODEL = {"name": "llama3-8b", "config": {"layers": LAYERS}}
HIDDEN, KV_WIDTH = 4096, 8 * 128
# for the search: four layers (the embedding and head weigh less), all 32 heads with their
# own keys and values (4x the gathers of grouped-query attention)
SEARCHED = {"name": "llama3-8b", "config": {"layers": 4, "kv_heads": 32}}


def _plan(seq: int, cp: int | None = None) -> Plan:
    training = {"global_batch_size": 8, "seq_len": seq, "dtype": "bf16"}
    inputs = resolve_request(SEARCHED, load_cluster("dgx-h100"), training).trace()
    options = SearchOptions(executable_only=True, cp=cp, layouts=("megatron", "megatron_sp"))
    return search(inputs, options).plan


def test_the_search_takes_cp_for_long_sequences_and_leaves_it_for_short_ones():
    long, long_no_cp = _plan(131072), _plan(131072, cp=1)
    assert long.mesh.cp and long.mesh.cp > 1 and long.executable
    assert long.predicted.step_time_s < long_no_cp.predicted.step_time_s
    # the global batch of 8 over dp / cp replicas, micro-batches of whole samples
    dp = long.mesh.shape[1]
    replicas = dp // long.mesh.cp
    assert 8 % replicas == 0 and (8 // replicas) % long.schedule.microbatches == 0
    short, short_cp = _plan(8192), _plan(8192, cp=2)
    assert short.mesh.cp is None
    assert short_cp.mesh.cp == 2
    assert short.predicted.step_time_s < short_cp.predicted.step_time_s
    assert any("cp2" in a.summary for a in short.alternatives)  # searched, and lost


def _estimate(seq: int, cp: int, dp: int = 8, mbs: int = 1, zero: int = 1) -> Plan:
    resolved = resolve(ModelSpec(**MODEL))
    cluster = load_cluster("dgx-h100")
    training = TrainingSettings(global_batch_size=dp // cp * mbs, seq_len=seq, dtype="bf16")
    config = ParallelConfig(dp=dp, tp=1, pp=1, microbatches=1, zero=zero, cp=cp)
    graph = trace_model(resolved, mbs, seq, "bf16")
    return evaluate(graph, cluster, training, config, model_ref(resolved, seq))


def _ring(name: str, nbytes: float, n: int) -> float:
    """Ring all-gather / reduce-scatter on dgx-h100's NVLink, from the profile's own YAML."""
    profile = yaml.safe_load((ROOT / "cluster_profiles" / "dgx-h100.yaml").read_text())
    link = profile["links"]["intra_node"]  # YAML 1.1 reads 450.0e9 as a string
    beta = float(link["bandwidth"]) * float(profile["efficiency"]["comm"])
    assert name in ("all_gather", "reduce_scatter")
    return (n - 1) * float(link["latency"]) + (n - 1) / n * nbytes / beta


@pytest.mark.parametrize("cp", [2, 8])
def test_a_cp_rank_gathers_every_layers_keys_and_values_and_keeps_them_whole(cp):
    seq = 16384
    whole, split = _estimate(seq, 1), _estimate(seq, cp)
    # K and V of the 8 kv heads for the whole sequence, bf16, each gathered once a layer
    # forward and its gradient reduce-scattered once backward, K then V as the executor
    # issues them (tp 1: no other communication)
    kv = 2 * seq * KV_WIDTH * 2
    expected = LAYERS * 2 * (_ring("all_gather", kv / 2, cp) + _ring("reduce_scatter", kv / 2, cp))
    assert split.stages[0].predicted.comm_s == pytest.approx(expected, rel=1e-9)
    assert whole.stages[0].predicted.comm_s == 0
    # each rank computes 1/cp of every token's work (causal attention included)
    assert split.stages[0].predicted.compute_s == pytest.approx(
        whole.stages[0].predicted.compute_s / cp, rel=1e-9
    )
    # activations: 1/cp, but attention keeps the whole sequence's K and V at the 8 kv heads,
    # where the traced model keeps its own tokens' K and V repeated to the 32 query heads
    repeated, gathered = 2 * seq * HIDDEN * 2, kv
    acts_whole = whole.stages[0].predicted.memory.activations
    acts_split = split.stages[0].predicted.memory.activations
    expected = acts_whole / cp + LAYERS * (gathered - repeated / cp)
    assert acts_split == pytest.approx(expected, rel=1e-6)


def test_the_kv_bytes_read_off_the_trace_match_the_config():
    graph = trace_model(resolve(ModelSpec(**MODEL)), 2, 4096, "bf16")
    kv = context.AttentionBytes.of(graph)
    assert kv.gathered == [2 * 4096 * KV_WIDTH * 2] * LAYERS  # per sample, before the repeat
    assert kv.kept == [2 * 4096 * HIDDEN * 2] * LAYERS  # after it


def test_cp_is_refused_where_it_cannot_run():
    assert "does not divide the sequence" in context.refusal("llama", 1004, 4, 8)
    assert "this is a gpt model" in context.refusal("gpt", 8192, 2, 8)
    assert "does not divide dp" in context.refusal("llama", 8192, 3, 8)
    assert "Megatron's" in context.refusal("llama", 8192, 2, 8, tp_layout="per_node")
    assert context.cp_options("llama", 4096, 8, None) == (1,)  # short: not searched
    assert context.cp_options("llama", 8192, 8, None) == (1, 2, 4, 8)
    cluster = load_cluster("dgx-h100")
    with pytest.raises(InputError, match=r"mesh\.cp"):
        ParallelConfig(8, 1, 1, 1, zero=3, dp_shard=4, cp=2).validate(cluster, 8, 4)
    with pytest.raises(InputError, match=r"dp/cp\*microbatches = 4"):
        ParallelConfig(8, 1, 1, 1, cp=2).validate(cluster, 6, 4)
    training = {"global_batch_size": 8, "seq_len": 8192, "dtype": "bf16"}
    gpt = resolve_request({"name": "gpt-1.3b", "config": {"layers": 2}}, cluster, training)
    with pytest.raises(InputError, match=r"search\.cp.*gpt model"):
        search(gpt.trace(), SearchOptions(cp=2))


def test_a_cp_combination_is_left_out_where_its_half_runs_the_same_tokens_for_less():
    options = SearchOptions()
    combos = combinations([(1, 8, 1)], 8, options, lambda dp: (1, 2, 4))
    # (mbs 2, cp 2) runs what (mbs 1, cp 1) runs per rank, with gathers: left out
    assert Combination(1, 8, 1, 1, 1) in combos and Combination(1, 8, 1, 2, 2) not in combos
    assert Combination(1, 8, 1, 1, 2) in combos and Combination(1, 8, 1, 1, 4) in combos
    assert Combination(1, 8, 1, 2, 4) not in combos  # its half (mbs 1, cp 2) is listed
    # with the micro-batch pinned to 2, no half is listed: kept
    pinned = combinations([(1, 8, 1)], 8, SearchOptions(microbatch_sizes=(2,)), lambda dp: (1, 2))
    assert pinned == [Combination(1, 8, 1, 2, 2)]


def test_the_cli_names_the_cp_flag_in_its_errors(capsys):
    from api.cli import main as cli_main

    args = ["plan", "--model", "llama3-8b", "--config", "layers=2", "--cluster", "dgx-h100"]
    args += ["--global-batch", "8", "--seq", "8192"]
    # cp counts its own ranks (world = pp x dp x cp x tp): 1x8x1 with cp 2 is 16 ranks; the
    # error names the split this command meant before
    assert cli_main([*args, "--mesh", "1x8x1", "--cp", "2"]) == 2
    err = capsys.readouterr().err
    assert "search.mesh (--mesh): 1x8x1 with cp 2 is pp x dp x cp x tp = 16 ranks" in err
    assert "the same split is mesh 1x4x1 with cp 2" in err
    args = ["estimate", "--model", "gpt-1.3b", "--config", "layers=2", "--cluster", "dgx-h100"]
    args += ["--dp", "4", "--cp", "2", "--global-batch", "8", "--seq", "8192"]
    assert cli_main(args) == 2
    assert "mesh.cp (--cp): the executor applies context parallelism to llama" in (
        capsys.readouterr().err
    )
    args[args.index("--dp") + 1] = "8"
    assert cli_main(args) == 2
    assert "the same split is mesh 1x4x1 with cp 2" in capsys.readouterr().err


def test_the_planning_work_estimate_counts_cp_combinations_for_long_sequences():
    from planner.search.work import combinations as counted

    cluster = load_cluster("dgx-h100").with_nodes(8)
    short = counted(cluster, 32, 128, "llama", 4096)
    assert counted(cluster, 32, 128) == short  # no cp below 8K tokens, or without a family
    assert counted(cluster, 32, 128, "llama", 32768) > short
    assert counted(cluster, 32, 128, "gpt", 32768) == short  # cp not run on gpt


def test_hugging_face_llama_family_models_split_their_sequence():
    from tests.hf_configs import TINY_DECODER

    pytest.importorskip("transformers")
    # transformers repeats K/V to the query heads with expand + reshape (repeat_kv): the
    # exchanges' bytes are read before it, at the 2 kv heads
    tiny = resolve(ModelSpec(hf_config={"model_type": "llama", **TINY_DECODER}))
    attention = context.AttentionBytes.of(trace_model(tiny, 1, 16, "fp32"))
    assert attention.kv_heads == [2, 2] and attention.heads == [4, 4]
    assert attention.gathered == [2 * 16 * 2 * 16 * 4] * 2  # K and V, 16 tokens, fp32
    assert attention.kept == [2 * 16 * 4 * 16 * 4] * 2
    # Llama 3.1 8B's widths, four layers, at 128K tokens on 8 H100: the search splits the
    # sequence, as for the zoo's Llama
    config = {
        "model_type": "llama",
        **{"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 4},
        **{"num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
        "max_position_embeddings": 131072,
    }
    training = {"global_batch_size": 4, "seq_len": 131072, "dtype": "bf16"}
    request = resolve_request({"hf_config": config}, load_cluster("dgx-h100"), training)
    plan = search(request.trace(), SearchOptions()).plan
    assert plan.request.model.family == "hf" and plan.mesh.cp > 1 and plan.executable
    # other Hugging Face architectures are refused by name
    why = context.refusal("hf", 8192, 2, 8, model_config={"model_type": "gpt2"})
    assert "this is a Hugging Face gpt2 model" in why


def test_sliding_windows_and_soft_caps_leave_context_parallelism_to_ring_attention():
    """transformers' Mistral attends within a window of 4096 tokens unless its config says
    null (the class default, and Mistral 7B v0.1's config.json); Gemma 2 windows every other
    layer and soft-caps its scores; Gemma 3 windows. The all-gather and Ulysses exchanges
    attend with the kernel's plain causal mask, so they are refused for such models; ring
    attention computes its scores itself and applies both."""
    pytest.importorskip("transformers")
    from tests.hf_configs import TINY_DECODER

    def config(**settings) -> dict:
        cfg = resolve(ModelSpec(hf_config={**TINY_DECODER, **settings})).config
        return {"model_type": cfg.model_type, "heads": cfg.heads, "seq_len": cfg.seq_len} | {
            "attention_window": cfg.attention_window,
            "attention_softcap": cfg.attention_softcap,
        }

    mistral = config(model_type="mistral")
    assert mistral["attention_window"] == 4096  # transformers' default
    assert config(model_type="mistral", sliding_window=None)["attention_window"] == 0
    gemma2 = config(model_type="gemma2", head_dim=16, sliding_window=512)
    assert gemma2["attention_window"] == 512 and gemma2["attention_softcap"] == 50.0
    gemma3 = config(model_type="gemma3_text", head_dim=16)
    assert gemma3["attention_window"] == 4096 and gemma3["attention_softcap"] == 0.0
    assert config(model_type="qwen2")["attention_window"] == 0  # full attention layers
    assert config(model_type="llama")["attention_window"] == 0
    # as their real configs have them, positions far beyond the windows
    mistral, gemma2, gemma3 = (c | {"seq_len": 131072} for c in (mistral, gemma2, gemma3))
    for exchange in ("all_gather", "ulysses"):
        why = context.refusal("hf", 8192, 2, 8, comm=exchange, model_config=mistral)
        assert "sliding window of 4096 tokens (sliding_window)" in why
        assert f"the {exchange} exchange" in why and "ring attention" in why
    why = context.refusal("hf", 8192, 2, 8, comm="all_gather", model_config=gemma3 | {})
    assert "sliding window of 4096" in why
    why = context.refusal(
        "hf", 8192, 2, 8, comm="ulysses", model_config=gemma2 | {"attention_window": 0}
    )
    assert "soft-caps its attention scores at 50 (attn_logit_softcapping)" in why
    for model in (mistral, gemma2, gemma3):
        assert context.refusal("hf", 8192, 2, 8, comm="ring", model_config=model) is None
        assert context.refusal("hf", 8192, 2, 8, model_config=model) is None  # ring's
        assert context.comm_options(model, 2, 1, None) == ("ring",)
    # a window as long as every position the model has never applies
    long = mistral | {"seq_len": 4096}
    assert context.refusal("hf", 4096, 2, 8, comm="all_gather", model_config=long) is None


def test_the_plain_causal_exchanges_refuse_what_they_do_not_apply():
    """The executor's guard behind the planner's refusal: the all-gather and Ulysses shards
    given a window shorter than the sequence, or soft-capped scores, by a transformers
    attention layer fail by name instead of attending without them."""
    from types import SimpleNamespace

    from executor.context_parallel import plain_causal
    from executor.errors import ExecutionError

    shard = SimpleNamespace(seq=16)
    with pytest.raises(ExecutionError, match="sliding window of 4 tokens, which the ulysses"):
        plain_causal(shard, "ulysses", 4, None)
    with pytest.raises(ExecutionError, match=r"soft-capped attention scores.*ring attention"):
        plain_causal(shard, "all_gather", None, 50.0)
    plain_causal(shard, "all_gather", 16, None)  # a window as long as the sequence is none
