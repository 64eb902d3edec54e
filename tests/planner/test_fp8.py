"""fp8 matmuls (planner/parallel/fp8.py): the search takes torchao's tensorwise recipe where
the fp8 GEMMs save more than the casts cost (large GEMMs) and leaves it out where they do
not (small ones); rowwise only when pinned; devices without fp8 tensor cores never get it.
Its terms are checked against figures computed here from the recipe. The executor runs it
against the single-process reference: tests/executor/test_execute.py, cases
tp4-fp8-tensorwise and dp4-zero3-fp8-rowwise."""

import pytest

from planner.cluster.profile import load_cluster
from planner.cost import shape_rates
from planner.cost.model import CostModel
from planner.cost.schedules import WEIGHT_SPLIT
from planner.errors import InputError
from planner.evaluate.config import ParallelConfig
from planner.evaluate.predict import predict
from planner.parallel import fp8
from planner.request import resolve_request
from planner.search.search import search
from planner.search.space import SearchOptions, pinned_options

H100 = load_cluster("dgx-h100").with_nodes(1)


def _inputs(model: str, seq: int, cluster=H100, dtype: str = "bf16"):
    training = {"global_batch_size": 64, "seq_len": seq, "dtype": dtype}
    return resolve_request({"name": model}, cluster, training).trace()


def _plan(inputs, **pins):
    options = SearchOptions(
        mesh=(1, 8, 1), microbatch_sizes=(8,), layouts=("megatron",), zero_stages=(1,), **pins
    )
    return search(inputs, options).plan


def test_fp8_wins_on_large_gemms_and_loses_on_small_ones():
    # GPT-1.3B at 2,048 tokens: 16K x 2K x 8K GEMMs, where fp8 runs ~1.9x bf16's rate
    large = _inputs("gpt-1.3b", 2048)
    chosen, off = _plan(large), _plan(large, fp8=(None,))
    assert chosen.fp8 == "tensorwise" and off.fp8 is None
    assert chosen.predicted.step_time_s < 0.95 * off.predicted.step_time_s
    # GPT-350M at 1,024 tokens: 8K x 1K x 4K GEMMs, where the casts cost more than fp8 saves
    small = _inputs("gpt-350m", 1024)
    chosen, pinned = _plan(small), _plan(small, fp8=("tensorwise",))
    assert chosen.fp8 is None and pinned.fp8 == "tensorwise"
    assert pinned.predicted.step_time_s > chosen.predicted.step_time_s


def test_rowwise_is_taken_only_when_pinned_and_costs_its_measured_slowdown():
    inputs = _inputs("gpt-1.3b", 2048)
    tensorwise, rowwise = _plan(inputs), _plan(inputs, fp8=("rowwise",))
    assert (tensorwise.fp8, rowwise.fp8) == ("tensorwise", "rowwise")
    assert rowwise.predicted.step_time_s > tensorwise.predicted.step_time_s


def test_devices_and_dtypes_without_fp8_never_search_it_and_refuse_the_pin():
    v100 = load_cluster("aws-p3.16xlarge").with_nodes(1)
    inputs = _inputs("gpt-350m", 1024, cluster=v100, dtype="fp16")
    assert _plan(inputs).fp8 is None
    with pytest.raises(InputError) as err:
        _plan(inputs, fp8=("tensorwise",))
    assert err.value.field == "search.fp8" and "fp8 peak" in str(err.value)
    fp32 = _inputs("gpt-350m", 1024, dtype="fp32")
    assert _plan(fp32).fp8 is None
    with pytest.raises(InputError, match="bf16 run"):
        _plan(fp32, fp8=("tensorwise",))


def test_a_linear_layers_time_is_its_fp8_gemms_and_casts():
    inputs = _inputs("gpt-1.3b", 2048)
    graph = inputs.at(8)
    fc1 = next(n for n in graph.nodes if n.module.endswith("0.mlp.fc1"))
    m, k, n = 8 * 2048, 2048, 8192
    rate = shape_rates.rate_tables(H100.measured, "fp8").gemm.rate
    mem = H100.device.memory_bandwidth * H100.efficiency.memory
    # torchao's recipe: x and w read twice in bf16 (amax, cast) and written once in fp8; in
    # backward the output gradient likewise, and x, w, dy transposed in fp8 (read + write)
    fwd = 2 * m * k * n / rate((m, k, n)) + 5 * (m * k + k * n) / mem
    bwd = 2 * m * k * n * (1 / rate((m, n, k)) + 1 / rate((n, m, k)))
    bwd += (5 * m * n + 2 * (m * k + k * n + m * n)) / mem
    t = CostModel(H100, "bf16", fp8="tensorwise").node_time(fc1)
    assert (t.fwd, t.bwd) == pytest.approx((fwd, bwd), rel=1e-9)
    # the weight's casts do not grow with the tokens
    assert (t.fixed_fwd, t.fixed_bwd) == pytest.approx((5 * k * n / mem, 2 * k * n / mem))
    assert not fp8.eligible(next(n for n in graph.nodes if n.module == "lm_head"))


def test_each_fp8_layer_keeps_its_input_in_one_byte_per_element():
    inputs = _inputs("gpt-1.3b", 2048)
    cfg = ParallelConfig(dp=8, tp=1, pp=1, microbatches=1, zero=1)
    graph = inputs.at(8)
    bf16 = predict(graph, H100, inputs.training, cfg)
    fp8_cfg = ParallelConfig(**{**cfg.__dict__, "fp8": "tensorwise"})
    fp8_run = predict(graph, H100, inputs.training, fp8_cfg)
    t, h, layers = 8 * 2048, 2048, 24
    # per layer: q, k and v each keep an fp8 copy of the norm's output the trace counted once
    # in bf16 (+t h); out_proj (the heads merged into a new tensor), fc1 and fc2 keep fp8
    # inputs in place of bf16 ones (-t h, -t h, -4 t h)
    per_layer = t * h * (3 - 2) + t * h * (1 - 2) + t * h * (1 - 2) + 4 * t * h * (1 - 2)
    drop = bf16.stages[0].memory.activations - fp8_run.stages[0].memory.activations
    assert drop == -per_layer * layers


def test_a_cpu_profile_plans_pinned_fp8_in_any_dtype_and_never_searches_it():
    """cpu-local states its software float8 rate (bench/cpu_fp8_rate.py), so the gloo tests'
    fp8 plans carry their own terms; the search never offers it there."""
    cpu = load_cluster("cpu-local")
    training = {"global_batch_size": 8, "seq_len": 16, "dtype": "fp32"}
    config = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128}
    inputs = resolve_request({"name": "gpt-350m", "config": config}, cpu, training).trace()
    options = {"mesh": (1, 1, 4), "layouts": ("megatron",)}
    assert search(inputs, SearchOptions(**options)).plan.fp8 is None
    pinned = search(inputs, SearchOptions(**options, fp8=("tensorwise",))).plan
    assert pinned.fp8 == "tensorwise"
    # its ledger has the amax all-reduces of the tp-split weights (and inputs)
    amax = [e for st in pinned.stages for e in st.predicted.ledger.comm if e.kind == "all_reduce"]
    plain = search(inputs, SearchOptions(**options, fp8=(None,))).plan
    base = [e for st in plain.stages for e in st.predicted.ledger.comm if e.kind == "all_reduce"]
    assert sum(e.calls for e in amax) > sum(e.calls for e in base)


def test_fp8_never_runs_under_a_split_backward():
    """torchao's fp8 linear computes both of its gradients in one backward: the zero-bubble
    schedules' split backward would run it twice (bench/results/ledger_property.md)."""
    cpu = load_cluster("cpu-local")
    training = {"global_batch_size": 8, "seq_len": 16, "dtype": "fp32"}
    config = {"layers": 4, "hidden": 64, "heads": 4, "vocab": 128}
    inputs = resolve_request({"name": "gpt-350m", "config": config}, cpu, training).trace()
    with pytest.raises(InputError, match="splits backward") as err:
        pinned_options(mesh=(2, 1, 2), schedule="zbv_zero_bubble", fp8="rowwise")
    assert err.value.field == "search.fp8"
    result = search(inputs, SearchOptions(mesh=(2, 1, 2), layouts=("megatron",), fp8=("rowwise",)))
    schedules = {result.plan.schedule.name} | {a.schedule for a in result.plan.alternatives}
    assert schedules and not schedules & set(WEIGHT_SPLIT)
