import json
import sys
from pathlib import Path

import pytest

from planner.cluster.profile import load_cluster
from planner.models import ModelSpec, resolve
from planner.plan import TrainingSettings
from planner.request import PlanningInputs, model_ref, search_options
from planner.search.baselines import baseline
from planner.search.search import NoFeasiblePlan, search
from planner.search.space import SearchOptions
from tests.conftest import traced

SMALL = {"layers": 8, "hidden": 512, "heads": 8}


def _plan(cluster="dgx-a100-80g", nodes=1, batch=32, seq=256, dtype="bf16", **options):
    graph = traced("gpt-350m", batch=1, seq=seq, dtype=dtype, **SMALL)
    resolved = resolve(ModelSpec(name="gpt-350m", config=SMALL))
    training = TrainingSettings(global_batch_size=batch, seq_len=seq, dtype=dtype)
    profile = load_cluster(cluster, nodes)
    inputs = PlanningInputs(graph, None, profile, training, model_ref(resolved, seq), seq)
    return search(inputs, SearchOptions(**options)), inputs


@pytest.mark.parametrize(("cluster", "nodes"), [("dgx-a100-80g", 1), ("aws-p3.16xlarge", 2)])
def test_every_plan_is_valid(cluster, nodes):
    dtype = "fp16" if cluster.startswith("aws") else "bf16"
    result, inputs = _plan(cluster, nodes, dtype=dtype)
    graph, profile = inputs.graph, inputs.cluster
    plans = [result.plan] + [result.plan_for(c) for c in result.candidates[:50]]
    for c, plan in zip(result.candidates[:50], plans[1:], strict=True):
        # The numbers the search ranked by are the ones its plans report.
        assert plan.predicted.step_time_s == c.step_time_s
        assert plan.predicted.peak_memory_bytes == c.peak_memory
    for plan in plans:
        layers = [layer for st in plan.stages for layer in range(*st.layers)]
        assert sorted(layers) == list(range(graph.num_layers))
        assert len(layers) == len(set(layers))
        groups = {tuple(st.ranks) for st in plan.stages}  # virtual stages share a device group
        ranks = [r for grp in groups for r in grp]
        assert len(ranks) == len(set(ranks)) == profile.num_devices
        assert all(0 <= r < profile.num_devices for r in ranks)
        assert len(plan.stages) == plan.mesh.shape[0] * plan.schedule.virtual_stages
        assert all(st.predicted.memory.total <= profile.device.memory_bytes for st in plan.stages)
        assert plan.predicted.fits_in_memory
    assert result.plan.stages[0].shardings, "the chosen plan carries per-node shardings"
    assert result.plan.explanation and result.plan.search.candidates_evaluated > 0


def test_same_request_same_plan():
    a = json.loads(_plan()[0].plan.to_json())
    b = json.loads(_plan(workers=2)[0].plan.to_json())
    for d in (a, b):
        d["search"].pop("time_s")
    assert a == b


def test_planner_is_never_worse_than_the_megatron_grid():
    result, inputs = _plan("aws-p3.16xlarge", 2, dtype="fp16")
    best = baseline("megatron", inputs).plan
    assert best is not None
    assert result.plan.predicted.step_time_s <= best.predicted.step_time_s * (1 + 1e-9)


def test_pipeline_appears_when_memory_forces_it():
    # 1.8B parameters with fp16 + Adam state (16 B each, ~29 GB) on 16 GB V100s, with tensor
    # parallelism and ZeRO ruled out: only pipeline stages can split the state.
    big = {"layers": 8, "hidden": 4096, "heads": 32}
    graph = traced("gpt-350m", batch=1, seq=256, dtype="fp16", **big)
    resolved = resolve(ModelSpec(name="gpt-350m", config=big))
    training = TrainingSettings(global_batch_size=64, seq_len=256, dtype="fp16")
    cluster = load_cluster("aws-p3.16xlarge", 1)
    inputs = PlanningInputs(graph, None, cluster, training, model_ref(resolved, 256), 256)
    result = search(inputs, SearchOptions(max_tp=1, zero_stages=(0,), layouts=("megatron",)))
    plan = result.plan
    pp, dp, tp = plan.mesh.shape
    assert plan.predicted.fits_in_memory and pp * dp * tp == 8
    assert pp > 1 and tp == 1
    assert all(c.config.pp > 1 for c in result.candidates)  # no fitting plan without stages


def test_a_model_that_cannot_fit_says_what_it_needs():
    big = {"layers": 8, "hidden": 8192, "heads": 64}  # 6.9B parameters: 102 GiB of fp32 state
    graph = traced("gpt-350m", batch=1, seq=128, **big)
    resolved = resolve(ModelSpec(name="gpt-350m", config=big))
    training = TrainingSettings(global_batch_size=8, seq_len=128, dtype="fp32")
    with pytest.raises(NoFeasiblePlan) as info:
        cluster = load_cluster("cpu-local")
        inputs = PlanningInputs(graph, None, cluster, training, model_ref(resolved, 128), 128)
        search(inputs, SearchOptions(layouts=("megatron",)))
    text = " ".join(info.value.explanation)
    assert "No configuration fits" in text and "GiB per device" in text
    assert "The smallest cluster that fits has" in text


def test_baselines_are_what_they_say():
    _, inputs = _plan()
    dp = baseline("dp", inputs).plan
    fsdp = baseline("fsdp", inputs).plan
    assert dp.mesh.shape == [1, 8, 1] and dp.stages[0].zero == 0
    assert fsdp.mesh.shape == [1, 8, 1] and fsdp.stages[0].zero == 3


def test_plans_say_whether_the_executor_can_run_them():
    from planner.executable import executable, plan_executor_mode

    assert executable("linear", "dp:replicate|tp:col") and executable("norm", "dim1")
    assert not executable("linear", "dp:replicate|tp:seq")
    assert not executable("einsum", "dp:replicate|tp:split_e")
    moe = {"layers": 2, "hidden": 256, "heads": 4, "experts": 8}
    graph = traced("moe-380m", batch=1, seq=256, **moe)
    resolved = resolve(ModelSpec(name="moe-380m", config=moe))
    training = TrainingSettings(global_batch_size=8, seq_len=256)
    cluster = load_cluster("dgx-a100-80g")
    inputs = PlanningInputs(graph, None, cluster, training, model_ref(resolved, 256), 256)
    free = search(inputs, SearchOptions(executable_only=False))
    only = search(inputs, SearchOptions(executable_only=True))
    assert only.plan.executable
    for c in only.candidates:
        assert only.plan_for(c).executable, c.key
    styles = all(executable(s.kind, s.strategy) for st in free.plan.stages for s in st.shardings)
    megatron = free.plan.tp_layout == "megatron"
    # MoE has graph mode, but not graph mode's ZeRO-3, which the cost model picks here:
    # --executable-only finds the best plan that runs instead, no faster.
    assert not megatron or not styles
    assert "does not run ZeRO-3" in free.plan.not_executable_reason
    assert plan_executor_mode(only.plan) in ("modules", "graph")
    assert only.plan.predicted.step_time_s >= free.plan.predicted.step_time_s


def test_plans_name_their_tp_layout_and_how_the_executor_runs_them():
    from planner.evaluate.config import ParallelConfig
    from planner.evaluate.estimate import evaluate
    from planner.evaluate.forced_strategy import forced_layouts
    from planner.executable import executor_mode_and_reason, plan_executor_mode
    from planner.intra_op.megatron import tensor_parallel_layout

    cfg = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128}
    resolved = resolve(ModelSpec(name="gpt-350m", config=cfg))
    graph = traced("gpt-350m", batch=2, seq=16, **cfg)
    cluster = load_cluster("cpu-local")
    training = TrainingSettings(global_batch_size=4, seq_len=16, dtype="fp32")
    model = model_ref(resolved, 16)

    def plan(pp, dp, tp, layouts=None, zero=0):
        config = ParallelConfig(pp=pp, dp=dp, tp=tp, microbatches=2 // dp, zero=zero)
        return evaluate(graph, cluster, training, config, model, layouts=layouts)

    megatron = plan(2, 1, 2)
    assert megatron.tp_layout == "megatron" and plan_executor_mode(megatron) == "modules"
    # The Megatron layout handed in explicitly is recognised as such.
    again = plan(2, 1, 2, tensor_parallel_layout(graph, 2))
    assert again.tp_layout == "megatron" and again.executable
    # Column-parallel everywhere needs a gather between linears: a per-node layout.
    cols = forced_layouts(graph, "linear", "col", 2, cluster)
    single = plan(1, 2, 2, cols)
    assert single.tp_layout == "per_node" and plan_executor_mode(single) == "graph"
    # graph mode replicates parameters over dp (ZeRO-0): ZeRO-1/2/3 there is not executable
    for zero in (1, 2, 3):
        sharded = plan(1, 2, 2, cols, zero=zero)
        assert (
            not sharded.executable and f"does not run ZeRO-{zero}" in sharded.not_executable_reason
        )
    assert plan(1, 2, 2, cols, zero=0).executable
    assert plan(1, 2, 2, zero=2).executable  # Megatron's layout: the module path's FSDP2
    staged = plan(2, 1, 2, cols)  # graph mode cut into pipeline stages
    assert staged.tp_layout == "per_node" and staged.executable
    assert plan_executor_mode(staged) == "graph"
    mode, why = executor_mode_and_reason("wresnet", True, [])  # no stage modules
    assert (mode, why) == ("graph", None)
    mode, why = executor_mode_and_reason("mlp", False, [])  # no graph mode
    assert mode is None and "graph mode does not run mlp models" in why
    conv1d = [("addmm", "linear", "tp:col", "transformers.pytorch_utils.Conv1D")]
    mode, why = executor_mode_and_reason("hf", True, conv1d)
    assert (mode, why) == ("graph", None)
    mode, why = executor_mode_and_reason("mlp", True, conv1d)
    assert mode is None and "addmm (linear on a transformers.pytorch_utils.Conv1D)" in why


def test_executable_only_says_when_nothing_executable_exists():
    """A model without graph mode (mlp) on a pinned tp mesh with per-node layouts only:
    --executable-only reports that nothing it can run is left, not a memory shortfall with a
    cluster size."""
    from planner.request import resolve_request
    from planner.search.search import NoFeasiblePlan

    request = resolve_request(
        {"name": "mlp", "config": {"layers": 2, "hidden": 64, "ffn_hidden": 128}},
        load_cluster("cpu-local"),
        {"global_batch_size": 8, "seq_len": 16, "dtype": "fp32"},
    )
    inputs = request.trace()
    free = SearchOptions(mesh=(1, 1, 4), layouts=("ilp",), executable_only=False)
    assert not search(inputs, free).plan.executable
    options = SearchOptions(mesh=(1, 1, 4), layouts=("ilp",), executable_only=True)
    with pytest.raises(NoFeasiblePlan) as err:
        search(inputs, options)
    assert err.value.reason == "executable"
    assert "No executable plan" in str(err.value)
    assert "smallest cluster" not in str(err.value)


def test_equally_fast_plans_go_to_the_one_with_more_memory_free():
    """GPT-350M at 2,048 tokens over dp 8: ZeRO-1 and ZeRO-3 hide all their communication and
    take the same step; the plan is the ZeRO-3 one, which holds less."""
    from planner.search.space import SearchOptions
    from tests.conftest import planning_inputs

    training = {"global_batch_size": 64, "seq_len": 2048, "dtype": "bf16"}
    inputs = planning_inputs({"name": "gpt-350m"}, training)

    def plan(zeros):
        options = SearchOptions(
            mesh=(1, 8, 1),
            zero_stages=zeros,
            checkpointing=(False,),
            layouts=("megatron",),
            microbatch_sizes=(8,),
        )
        return search(inputs, options).plan

    one, three, any_level = plan((1,)), plan((3,)), plan((0, 1, 2, 3))
    assert one.predicted.step_time_s == three.predicted.step_time_s  # the tie itself
    assert three.predicted.peak_memory_bytes < one.predicted.peak_memory_bytes
    assert {st.zero for st in any_level.stages} == {3}
    assert any_level.predicted.peak_memory_bytes == three.predicted.peak_memory_bytes


def test_the_default_search_returns_no_plan_its_executor_refuses(tmp_path, capsys):
    """MoE on H100s with Megatron's layout runs in graph mode (its experts' einsums have no
    module-level style), which shards no optimizer state and runs no fp8: the default search
    used to return such a plan as its best (fp8 and a technique graph mode refuses, refused
    at run time); it now says none runs, and asked for any plan, says why that one cannot."""
    from api.cli import main as cli_main
    from planner.plan import Plan

    args = ["plan", "--model", "moe-380m", "--cluster", "dgx-h100", "--global-batch", "64"]
    args += ["--tp-layout", "megatron", "--mesh", "1x2x4", "--zero", "1"]
    args += ["--no-baselines", "-o", str(tmp_path / "plan.json")]
    assert cli_main(args) != 0
    assert "No executable plan" in capsys.readouterr().err
    assert cli_main([*args, "--allow-non-executable"]) == 0
    plan = Plan.from_json((tmp_path / "plan.json").read_text())
    assert not plan.executable
    assert "graph mode" in plan.not_executable_reason


def graph_refusal(technique: str) -> str | None:
    """The graph-mode refusal of a plan using one technique (a key of planner.executable.RUNS)
    and nothing else graph mode refuses."""
    from planner.executable import graph_mode_refusal
    from planner.parallel.registry import stores

    zero = int(technique[-1]) if technique.startswith("zero") else 0
    stored = next((m for m, s in stores().items() if s.capability == technique), False)
    return graph_mode_refusal(
        2,
        zero,
        technique == "hsdp",
        cpu_offload=technique == "cpu_offload",
        checkpointing=stored,
        fp8="tensorwise" if technique == "fp8" else None,
        expert_parallel=technique == "expert_parallel",
    )


def test_one_capability_table_decides_what_graph_mode_runs(monkeypatch):
    """planner.executable.RUNS is read by the graph-mode refusal (to_plan's and the
    executor's) and by the search's options: a technique the table gives graph mode is
    searched there and not refused, one it takes away is refused and left out."""
    import planner.executable as executable
    from planner.search.space import executable_options

    for technique, paths in executable.RUNS.items():
        assert (graph_refusal(technique) is None) == ("graph" in paths), technique
    options = SearchOptions(executable_only=True)
    assert executable_options(options, "graph").zero_stages == (0,)
    monkeypatch.setitem(executable.RUNS, "zero2", executable.BOTH_PATHS)
    assert graph_refusal("zero2") is None
    assert executable_options(options, "graph").zero_stages == (0, 2)


def test_the_smallest_cluster_that_fits_counts_cpu_offload():
    """A 405B-shaped model on one DGX H100 node: the state takes 6.5 TB. On the devices alone
    it needs far more nodes than with ZeRO-3's shards in the hosts' 2 TiB each, which the
    search tries where nothing else fits: the message counts what the search would find."""
    import re

    from planner.search.infeasible import not_fit_lines

    config = {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "ffn_hidden": 53248}
    graph = traced("llama3-70b", batch=1, seq=512, **config)
    training = TrainingSettings(global_batch_size=64, seq_len=512, dtype="bf16")
    cluster = load_cluster("dgx-h100")

    def smallest(profile) -> int:
        text = " ".join(not_fit_lines(graph, profile, training))
        return int(re.search(r"smallest cluster that fits has (\d+) nodes", text).group(1))

    with_hosts = smallest(cluster)
    devices_only = smallest(cluster.model_copy(update={"host": None}))
    assert with_hosts < devices_only


def test_a_fit_only_under_the_stage_dps_memory_split_does_not_end_the_checkpointing_scan():
    """GPT-15B on 32 V100, pp 8 dp 2 tp 2, ZeRO-2: without checkpointing only a split the
    stage DP unbalances for memory fits (fewer layers on the first stages, which hold more
    micro-batches); selective checkpointing under the balanced split is faster, and is
    still tried (checkpointing adds time only where the split chosen for time fits)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from suite import suite_inputs

    inputs = suite_inputs("gpt-15b", 32, "fp16", 1024)
    pins = {"mesh": [8, 2, 2], "microbatch_size": 1, "schedule": "1f1b", "zero": 2}
    pins |= {"tp_layout": "megatron", "sequence_parallel": False, "executable_only": False}
    found = sorted(search(inputs, search_options(pins)).candidates, key=lambda c: c.step_time_s)
    unbalanced = [c for c in found if not c.config.checkpointing]
    assert unbalanced and all(c.ranges is not None for c in unbalanced)
    best = found[0]
    assert best.config.checkpointing == "selective" and best.ranges is None
    assert best.step_time_s < unbalanced[0].step_time_s * 0.95
