"""Layer-wise ZeRO (Galvatron's per-layer choice under a memory budget): ZeRO-3 on the fewest
first layers of a stage that let the device fit, ZeRO-2 on the others. Planned on a device
whose memory is set between the two, then run on 4 gloo processes (dp 2 x tp 2, two
micro-batches) against the single-process reference and the plan's ledger, in which the
ZeRO-2 layers gather their weights once a step and reduce once, the ZeRO-3 ones each
micro-batch."""

import pytest

from api.cli import main
from planner.errors import InputError
from planner.plan import Plan
from planner.request import search_options
from planner.search.search import search
from tests.conftest import planning_inputs
from tests.executor.equivalence import runs_as_planned

HIDDEN, KV, FFN, LAYERS = 128, 64, 512, 4  # kv: 2 of 4 heads of 32
TINY = {"layers": LAYERS, "hidden": HIDDEN, "heads": 4, "kv_heads": 2, "ffn_hidden": FFN}
TINY["vocab"] = 128
TRAINING = {"global_batch_size": 8, "seq_len": 16, "dtype": "fp32", "optimizer": "sgd"}
PINS = {"mesh": [1, 2, 2], "microbatch_size": 2, "checkpointing": False}
GIB = 2**30


def _plan(memory_bytes: int | None = None, **pins):
    memory = None if memory_bytes is None else memory_bytes / GIB
    inputs = planning_inputs({"name": "llama3-8b", "config": TINY}, TRAINING, "cpu-local", memory)
    return search(inputs, search_options({**PINS, **pins})).plan


def _peak(plan) -> int:
    return plan.predicted.peak_memory_bytes


@pytest.fixture(scope="module")
def by_count() -> dict:
    """Layer-wise plans by their count of ZeRO-3 layers: ample memory (none), then each
    time one byte less than the last plan's peak."""
    plans = {0: _plan(layerwise_zero=True)}
    while (k := max(plans)) < LAYERS:
        plan = _plan(_peak(plans[k]) - 1, layerwise_zero=True)
        plans[plan.stages[0].resharded_layers or LAYERS] = plan
    return plans


def test_each_layer_moved_to_zero3_frees_its_gathered_weights(by_count):
    """A Llama block's parameters from its shape, tp 2 splitting all but its two norms: the
    ZeRO-2 layer holds them whole in fp32, and over its two micro-batches its gradients
    whole in fp32 (FSDP2 accumulates them unsharded until the last backward reduces them),
    the ZeRO-3 one half of each (dp 2). The first layer at ZeRO-3 also brings ZeRO-3's
    buffer for one gathered block (its weights whole), less than the two halves it frees:
    the plans go from none to one. From there each layer moved saves exactly those halves;
    with all of them it is plain ZeRO-3."""
    assert sorted(by_count) == [0, 1, 2, 3, 4]
    matrices = HIDDEN * HIDDEN * 2 + 2 * HIDDEN * KV + 3 * HIDDEN * FFN
    per_device = matrices // 2 + 2 * HIDDEN
    saved = 2 * (per_device * 4 - per_device * 4 // 2)  # weights and gradients
    for k in range(1, LAYERS):
        assert _peak(by_count[k]) - _peak(by_count[k + 1]) == saved
    assert _peak(by_count[0]) > _peak(by_count[1])
    zero3 = _plan(zero=3)
    assert by_count[LAYERS].stages[0].resharded_layers is None
    assert _peak(by_count[LAYERS]) == _peak(zero3)
    assert by_count[2].stages[0].zero_label == "ZeRO-3 on 2 of 4 layers, 2 on the rest"
    # the search's own pick at that memory: never slower than plain ZeRO-3
    searched = _plan(_peak(by_count[2]), zero=3)
    assert searched.predicted.step_time_s <= zero3.predicted.step_time_s


def test_it_is_refused_where_it_does_not_apply():
    with pytest.raises(InputError, match=r"search\.layerwise_zero.*pp 2"):
        search_options({"mesh": [2, 2, 1], "layerwise_zero": True})
    with pytest.raises(InputError, match=r"search\.layerwise_zero.*ZeRO 2"):
        search_options({"zero": 2, "layerwise_zero": True})


@pytest.mark.distributed
@pytest.mark.parametrize("resharded", [2])
def test_layerwise_zero_matches_the_reference_and_its_ledger(by_count, resharded):
    """Two ZeRO-3 layers and two ZeRO-2 ones on dp 2 x tp 2: the same losses and parameters
    as one process, and the collectives the plan predicts (run as plain ZeRO-3, the ZeRO-2
    layers' three extra gathers and one extra reduce-scatter each fail the ledger)."""
    plan = by_count[resharded]
    assert [st.resharded_layers for st in plan.stages] == [resharded]
    assert plan.executable, plan.not_executable_reason
    runs_as_planned(plan)


def test_estimate_states_it_and_refuses_it_under_a_pipeline(capsys):
    """`autopar estimate --layerwise-zero`: the fewest ZeRO-3 layers that fit the device, in
    the plan and its table; with a pipeline, refused naming the flag."""
    args = ["estimate", "--model", "gpt-350m", "--config", "layers=4", "hidden=256", "heads=4"]
    args += ["--cluster", "dgx-a100-80g", "--global-batch", "8", "--seq", "128", "--zero", "3"]
    code = main([*args, "--dp", "8", "--layerwise-zero", "--json"])
    plan = Plan.model_validate_json(capsys.readouterr().out)
    assert code == 0 and plan.stages[0].resharded_layers == 0
    assert plan.stages[0].predicted.ledger is not None
    main([*args, "--dp", "8", "--layerwise-zero"])
    assert "2, 3 off layers" in capsys.readouterr().out
    assert main([*args, "--dp", "4", "--pp", "2", "--layerwise-zero"]) != 0
    assert "stages[].resharded_layers (--layerwise-zero)" in capsys.readouterr().err


def test_zero3_prices_the_tp_reduction_of_replicated_weights_each_micro_batch():
    """What the ledger counts (and the run measured: 24 tp all-reduces at ZeRO-3 against 15 at
    ZeRO-2, two micro-batches), the step time prices (with sequence parallelism, whose norms
    have tp-partial weight gradients): FSDP2 reduces a replicated weight's
    tp-partial gradient with each dp reduction of its unit, each micro-batch under ZeRO-3
    and once a step under ZeRO-2. With nothing hidden under backward (overlap 0), ZeRO-3's
    exposed sync grows with the micro-batches and ZeRO-2's does not."""
    from planner.evaluate.config import ParallelConfig
    from planner.evaluate.predict import predict
    from planner.graph.batch import rescale_batch
    from planner.intra_op.megatron import tensor_parallel_layout

    inputs = planning_inputs({"name": "llama3-8b", "config": TINY}, TRAINING, "dgx-a100-80g")
    cluster = inputs.cluster
    efficiency = cluster.efficiency.model_copy(update={"overlap": 0.0})
    cluster = cluster.model_copy(update={"efficiency": efficiency, "nodes": 1})
    cluster = cluster.model_copy(update={"devices_per_node": 4})
    training = inputs.training

    def sync(zero: int, m: int) -> float:
        cfg = ParallelConfig(dp=2, tp=2, pp=1, microbatches=m, zero=zero)
        graph = rescale_batch(inputs.graph, cfg.microbatch_size(training.global_batch_size))
        layouts = tensor_parallel_layout(graph, 2, sequence_parallel=True)
        return predict(graph, cluster, training, cfg, layouts=layouts).dp_sync_s

    assert sync(3, 1) > 0
    assert sync(3, 4) == pytest.approx(4 * sync(3, 1))
    assert sync(2, 4) == pytest.approx(sync(2, 1))
