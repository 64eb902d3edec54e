"""Ulysses context parallelism (planner/parallel/ulysses.py): its terms against figures
computed here from the model's config and the profile's YAML, where the search takes it
and where it does not, its refusals and its exports. The executor runs it against the
single-process reference: tests/executor/test_ulysses.py."""

from pathlib import Path

import pytest
import yaml

from api.export import megatron, torchtitan
from api.export.common import ExportError
from planner.cluster.profile import load_cluster
from planner.errors import InputError
from planner.evaluate.config import ParallelConfig
from planner.evaluate.estimate import evaluate
from planner.graph.tracing import trace_model
from planner.models import ModelSpec, resolve
from planner.plan import Plan, TrainingSettings
from planner.request import model_ref, resolve_request
from planner.search.search import search
from planner.search.space import SearchOptions

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 2
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama 3 8B
HIDDEN = HEADS * HEAD_DIM


def _estimate(
    seq: int, cp: int, comm: str, tp: int = 1, kv_heads: int = KV_HEADS, layers: int = LAYERS
) -> Plan:
    spec = ModelSpec(name="llama3-8b", config={"layers": layers, "kv_heads": kv_heads})
    resolved = resolve(spec)
    cluster = load_cluster("dgx-h100")
    dp = 8 // tp
    training = TrainingSettings(global_batch_size=dp // cp, seq_len=seq, dtype="bf16")
    config = ParallelConfig(dp=dp, tp=tp, pp=1, microbatches=1, zero=1, cp=cp, cp_comm=comm)
    graph = trace_model(resolved, 1, seq, "bf16")
    return evaluate(graph, cluster, training, config, model_ref(resolved, seq))


def _all_to_all(nbytes: float, n: int) -> float:
    """All-to-all of an n-rank group on dgx-h100's NVLink, `nbytes` on each rank, from the
    profile's own YAML: n - 1 messages, (n - 1)/n of the buffer leaves the rank."""
    profile = yaml.safe_load((ROOT / "cluster_profiles" / "dgx-h100.yaml").read_text())
    link = profile["links"]["intra_node"]
    beta = float(link["bandwidth"]) * float(profile["efficiency"]["comm"])
    return (n - 1) * float(link["latency"]) + (n - 1) / n * nbytes / beta


@pytest.mark.parametrize("cp", [2, 8])
def test_a_ulysses_rank_exchanges_four_tensors_each_way_and_keeps_a_share(cp):
    seq = 16384
    whole, split = _estimate(seq, 1, "all_gather"), _estimate(seq, cp, "ulysses")
    assert split.mesh.cp_comm == "ulysses" and split.mesh.dims.summary().endswith(
        f"cp{cp} (ulysses) tp1"
    )
    # a rank's seq / cp tokens of queries and output at 32 heads, keys and values at 8
    # (cp divides them: no repeat), bf16; four all-to-alls forward, four backward
    q = seq / cp * HIDDEN * 2
    k = seq / cp * KV_HEADS * HEAD_DIM * 2
    expected = LAYERS * 2 * (2 * _all_to_all(q, cp) + 2 * _all_to_all(k, cp))
    assert split.stages[0].predicted.comm_s == pytest.approx(expected, rel=1e-6)
    # activations: 1/cp of everything, attention keeping K and V at their 8 heads where the
    # traced model keeps them repeated to the 32 query heads
    repeated, own = 2 * seq * HIDDEN * 2, 2 * seq * KV_HEADS * HEAD_DIM * 2
    acts_whole = whole.stages[0].predicted.memory.activations
    acts_split = split.stages[0].predicted.memory.activations
    assert acts_split == pytest.approx(acts_whole / cp + LAYERS * (own - repeated) / cp, rel=1e-6)
    # the all-gather exchange keeps the whole sequence's K and V
    gathered = _estimate(seq, cp, "all_gather").stages[0].predicted.memory.activations
    assert gathered - acts_split == pytest.approx(LAYERS * (own - own / cp), rel=1e-6)


def test_kv_heads_cp_does_not_divide_are_repeated_before_the_exchange():
    # 2 kv heads, tp 2: one per rank; cp 4: repeated 4 times (4 / gcd(1, 4))
    seq, cp = 16384, 4
    split = _estimate(seq, cp, "ulysses", tp=2, kv_heads=2)
    q = seq / cp * HIDDEN / 2 * 2
    k = seq / cp * 4 * HEAD_DIM * 2
    exchange = LAYERS * 2 * (2 * _all_to_all(q, cp) + 2 * _all_to_all(k, cp))
    # the rest of the stage's communication is tensor parallelism's, as without cp
    no_cp = _estimate(seq, 1, "all_gather", tp=2, kv_heads=2).stages[0].predicted.comm_s
    # (tensor parallelism's collectives carry a cp rank's 1/cp of the tokens)
    assert split.stages[0].predicted.comm_s == pytest.approx(no_cp / cp + exchange, rel=1e-6)


def test_ulysses_is_refused_where_cp_does_not_divide_the_heads():
    cluster = load_cluster("dgx-h100")
    config = ParallelConfig(64, 2, 1, 1, cp=32, cp_comm="ulysses")
    with pytest.raises(InputError, match=r"mesh\.cp_comm.*16 query heads.*cp 32"):
        config.validate(cluster.with_nodes(16), 2, 2, {"heads": 32, "kv_heads": 8})
    with pytest.raises(InputError, match=r"mesh\.cp_comm"):
        _estimate(65536, 2, "ring-of-fire")
    # 16 heads of 256, tp 8: 2 query heads per rank, which cp 4 cannot split
    training = {"global_batch_size": 1, "seq_len": 65536, "dtype": "bf16"}
    model = {"name": "llama3-8b", "config": {"layers": 2, "heads": 16, "kv_heads": 8}}
    inputs = resolve_request(model, cluster.with_nodes(4), training).trace()
    with pytest.raises(InputError, match=r"search\.cp_comm.*2 query heads.*cp 4"):
        search(inputs, SearchOptions(cp=4, cp_comm="ulysses", mesh=(1, 4, 8)))


def _searched(kv_heads: int, cp: int, comm: str | None = None, seq: int = 8192) -> Plan:
    model = {"name": "llama3-8b", "config": {"layers": 4, "kv_heads": kv_heads, "vocab": 32000}}
    training = {"global_batch_size": 8 // cp, "seq_len": seq, "dtype": "bf16"}
    inputs = resolve_request(model, load_cluster("dgx-h100"), training).trace()
    # full recomputation: its backward hides the gradient sync under every exchange, so
    # the exchanges' own times decide
    options = SearchOptions(
        cp=cp,
        cp_comm=comm,
        mesh=(1, 8, 1),
        layouts=("megatron",),
        fp8=(None,),
        checkpointing=(True,),
    )
    return search(inputs, options).plan


def test_the_search_takes_ulysses_where_it_moves_fewer_bytes_and_not_elsewhere():
    # full multi-head attention at cp 8, 8K tokens: the all-gather (and the ring, whose
    # transfers 1K-token blocks of attention cannot hide) move each rank 7/8 of the whole
    # sequence's K and V, Ulysses 7/8 of its own eighth of four tensors: 4x fewer bytes
    mha = _searched(kv_heads=32, cp=8)
    assert mha.mesh.cp == 8 and mha.mesh.cp_comm == "ulysses"
    for other in ("all_gather", "ring"):
        slower = _searched(kv_heads=32, cp=8, comm=other)
        assert (slower.mesh.cp_comm or "all_gather") == other
        assert mha.predicted.step_time_s < slower.predicted.step_time_s
    # grouped-query attention (8 of 32 heads) at cp 2: the queries and output Ulysses
    # exchanges are four times the keys and values the others pass: not Ulysses
    gqa = _searched(kv_heads=8, cp=2)
    assert gqa.mesh.cp == 2 and gqa.mesh.cp_comm != "ulysses"
    exchanged = _searched(kv_heads=8, cp=2, comm="ulysses")
    assert exchanged.mesh.cp_comm == "ulysses"
    assert gqa.predicted.step_time_s < exchanged.predicted.step_time_s


def test_exports_name_the_exchange_or_refuse_it():
    plan = _estimate(16384, 2, "ulysses")
    assert "--cp-comm-type a2a" in megatron.export(plan)
    with pytest.raises(ExportError, match=r"mesh\.cp_comm.*all_gather, ring, not ulysses"):
        torchtitan.export(plan)
    assert "--cp-comm-type allgather" in megatron.export(_estimate(16384, 2, "all_gather"))
