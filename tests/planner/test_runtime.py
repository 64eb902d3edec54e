"""The runtime a plan is predicted for (planner/runtime/): each declaration's bytes per
parameter are what its source says, written out here from the cited figures, not read from
the code; a plan carries its runtime, is refused by autopar's executor when made for
another, and its export states for which runtime its figures are."""

import json

import pytest

from planner.cluster.profile import load_cluster
from planner.cost.memory import state_bytes_per_param
from planner.errors import InputError
from planner.evaluate.config import ParallelConfig
from planner.evaluate.predict import predict
from planner.runtime import RUNTIMES


def _bytes(runtime: str, zero: int, d: int, dtype: str = "bf16") -> float:
    return state_bytes_per_param(dtype, "adamw", zero, d, runtime=runtime)


@pytest.mark.parametrize("d", [2, 8, 64])
def test_megatron_is_its_distributed_optimizer_guide(d):
    # Megatron Core developer guide, "Distributed Optimizer": bytes per parameter with
    # float16 params and fp32 grads 18, and 6 + 12/d distributed; fp32 params and grads 16,
    # and 8 + 8/d distributed
    assert _bytes("megatron", 0, d) == 18
    assert _bytes("megatron", 1, d) == pytest.approx(6 + 12 / d)
    assert _bytes("megatron", 0, d, "fp32") == 16
    assert _bytes("megatron", 1, d, "fp32") == pytest.approx(8 + 8 / d)
    assert RUNTIMES["megatron"].refusal(2) is not None  # its gradient buffer is never split


@pytest.mark.parametrize("d", [2, 8])
def test_deepspeed_keeps_a_whole_fp32_gradient_buffer_beside_its_bf16_optimizer(d):
    # BF16_Optimizer: bf16 weights (2) and their bf16 gradients (2), a flat fp32 gradient
    # buffer the size of the model (4), the fp32 master partition (4/d) and Adam's two
    # states on it (8/d)
    assert _bytes("deepspeed", 0, d) == pytest.approx(2 + 2 + 4 + (4 + 8) / d)
    # ZeRO stage 1: the bf16 gradients whole, an fp32 gradient partition (4/d) beside the
    # master and states' (12/d)
    assert _bytes("deepspeed", 1, d) == pytest.approx(2 + 2 + 4 / d + 12 / d)
    # stages 2 and 3: the ZeRO paper's 2 + 2 + 12 split as the stage says
    assert _bytes("deepspeed", 2, d) == pytest.approx(2 + (2 + 12) / d)
    assert _bytes("deepspeed", 3, d) == pytest.approx(16 / d)


@pytest.mark.parametrize("d", [2, 8])
def test_torchtitan_and_autopar_run_fsdp2_in_mixed_precision(d):
    # FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the sharded
    # parameter is the fp32 master (4/d), the sharded gradient fp32 (4/d), Adam's states
    # 8/d; ZeRO-3 gathers one layer at a time (counted apart)
    assert _bytes("torchtitan", 3, d) == pytest.approx((4 + 4 + 8) / d)
    # ZeRO-1/2 exported as fsdp_reshard_after_forward "never": the gathered bf16 weights
    # kept whole (2) beside the sharded master, gradients and states
    assert _bytes("torchtitan", 1, d) == pytest.approx(2 + (4 + 4 + 8) / d)
    # no sharding: DDP under autocast, fp32 weights and gradients (4 + 4), Adam (8) and the
    # bf16 copy autocast saves for backward (2); autopar's executor the same
    assert _bytes("torchtitan", 0, 1) == _bytes("autopar", 0, 1) == 4 + 4 + 8 + 2
    # autopar at ZeRO-1 (executor.zero1): whole fp32 weights and gradients (4 + 4), the fp32
    # master shard and Adam's states split (12/d), autocast's bf16 copy (2); at ZeRO-2 the
    # ZeRO paper's bf16 weights and gradients
    assert _bytes("autopar", 1, d) == pytest.approx(4 + 4 + 12 / d + 2)
    assert _bytes("autopar", 2, d) == pytest.approx(2 + (2 + 12) / d)


def _estimate(tmp_path, runtime: str, zero: int = 1) -> dict:
    from api.cli import main as cli_main

    out = tmp_path / f"{runtime}-{zero}.json"
    args = ["estimate", "--model", "gpt-350m", "--cluster", "dgx-a100-80g", "--global-batch"]
    args += ["64", "--seq", "1024", "--dp", "8", "--microbatches", "2", "--zero", str(zero)]
    assert cli_main([*args, "--runtime", runtime, "-o", str(out)]) == 0
    return json.loads(out.read_text())


def test_a_plan_for_megatron_holds_its_fp32_gradients(tmp_path):
    autopar, megatron = _estimate(tmp_path, "autopar"), _estimate(tmp_path, "megatron")
    mine, theirs = (
        autopar["stages"][0]["predicted"]["memory"],
        megatron["stages"][0]["predicted"]["memory"],
    )
    params = autopar["request"]["model"]["params"]
    # the same configuration at ZeRO-1: Megatron's distributed optimizer and autopar's ZeRO-1
    # (executor.zero1) both keep whole fp32 gradients (4 bytes) and split the master and
    # Adam's states (12/d); Megatron computes with bf16 weights (2), autopar's executor keeps
    # fp32 weights (4) and autocast's bf16 copy (2)
    assert theirs["grads"] == mine["grads"] == 4 * params
    assert theirs["optimizer"] == mine["optimizer"] == 12 * params // 8
    assert (theirs["params"], mine["params"]) == (2 * params, 6 * params)
    assert mine["total"] - theirs["total"] == 4 * params
    assert megatron["request"]["training"]["runtime"] == "megatron"
    assert "runtime" not in autopar["request"]["training"]  # autopar: the default, unwritten


def test_a_zero_level_the_runtime_does_not_run_is_refused_naming_the_flag(tmp_path, capsys):
    from api.cli import main as cli_main

    args = ["estimate", "--model", "gpt-350m", "--cluster", "dgx-a100-80g", "--global-batch"]
    args += ["64", "--dp", "8", "--microbatches", "2", "--zero", "2", "--runtime", "megatron"]
    assert cli_main(args) == 2
    assert "zero (--zero): megatron runs" in capsys.readouterr().err
    with pytest.raises(InputError, match="megatron runs"):
        ParallelConfig(8, 1, 1, 2, zero=2).validate(
            load_cluster("dgx-a100-80g"), 64, 24, runtime="megatron"
        )
    args = ["plan", "--model", "gpt-350m", "--cluster", "dgx-a100-80g", "--global-batch", "64"]
    assert cli_main([*args, "--runtime", "megatron", "--zero", "2", "--no-baselines"]) != 0
    assert "search.zero (--zero): megatron runs" in capsys.readouterr().err
    assert cli_main([*args, "--runtime", "megatron", "--tp-layout", "per_node"]) != 0
    assert "search.tp_layout (--tp-layout): megatron runs Megatron's" in capsys.readouterr().err


def test_the_search_plans_within_what_the_runtime_runs(tmp_path):
    from api.cli import main as cli_main
    from planner.plan import Plan

    out = tmp_path / "plan.json"
    args = ["plan", "--model", "gpt-350m", "--config", "layers=4", "--cluster", "dgx-a100-80g"]
    args += ["--global-batch", "64", "--seq", "512", "--no-baselines", "--allow-non-executable"]
    assert cli_main([*args, "--runtime", "megatron", "-o", str(out)]) == 0
    plan = Plan.from_json(out.read_text())
    assert plan.request.training.runtime == "megatron" and plan.tp_layout == "megatron"
    assert {st.zero for st in plan.stages} <= set(RUNTIMES["megatron"].zero_levels)


def test_the_executor_refuses_and_the_export_names_the_runtime(tmp_path, capsys):
    from api.cli import main as cli_main
    from planner.executable import execution_refusal
    from planner.plan import Plan

    megatron = _estimate(tmp_path, "megatron")
    path = tmp_path / "megatron-1.json"
    field, why = execution_refusal(Plan.model_validate(megatron))
    assert field == "request.training.runtime" and "autopar export --to megatron" in why
    assert execution_refusal(Plan.model_validate(_estimate(tmp_path, "autopar"))) is None
    capsys.readouterr()
    # a cluster job runs autopar's executor too: no launch script for it
    args = ["launch-script", str(path), "--target", "slurm", "-o", str(tmp_path / "job")]
    assert cli_main(args) == 2
    assert "plan.request.training.runtime: this plan is planned for megatron" in (
        capsys.readouterr().err
    )
    assert cli_main(["export", str(path), "--to", "megatron", "-o", str(tmp_path / "m.sh")]) == 0
    peak = megatron["predicted"]["peak_memory_bytes"] / 2**30
    assert "autopar predicts for megatron: " in (err := capsys.readouterr().err)
    assert f"peak {peak:.1f} GiB" in err
    assert cli_main(["export", str(path), "--to", "deepspeed", "-o", str(tmp_path / "d")]) == 0
    assert "for megatron, not deepspeed" in capsys.readouterr().err


def test_megatron_core_with_transformer_engine_keeps_less_of_a_llama_layer():
    """Per layer under Megatron's layout with sequence parallelism at tp 4, on an H100 (the
    fused RMSNorm rule applies to both): Megatron-Core keeps a column-parallel linear's
    sequence-sharded input (it all-gathers it again in backward), TE's attention keeps the
    key/value heads unrepeated, the fused SwiGLU keeps no silu output, and q/k/v and
    gate/up are one fused GEMM each (one fp8 cast). Figures written out from the shapes."""
    from planner.cluster.mesh import LogicalMesh
    from planner.cost.model import CostModel
    from planner.evaluate.node_costs import node_costs
    from planner.intra_op.megatron import tensor_parallel_layout
    from tests.conftest import traced

    tp, seq, hidden, heads, kv, ffn = 4, 256, 256, 8, 4, 512
    config = {"layers": 2, "hidden": hidden, "heads": heads, "kv_heads": kv, "ffn_hidden": ffn}
    graph = traced("llama3-8b", batch=1, seq=seq, **config)
    cluster = load_cluster("dgx-h100")
    mesh = LogicalMesh.contiguous(cluster, 0, (1, tp))
    layouts = tensor_parallel_layout(graph, tp, sequence_parallel=True)
    layer = [n for n in graph.nodes if n.layer == 1]

    def saved(runtime: str, fp8=None) -> dict[str, int]:
        cm = CostModel(cluster, "bf16", fp8=fp8, runtime=runtime)
        costs = node_costs(graph, layouts, cm, mesh, layer)
        return {n.name: costs[n.name].saved for n in layer if costs[n.name].saved}

    ours, theirs = saved("autopar"), saved("megatron")
    token = seq * 2  # bf16 bytes per token of one element
    by_kind = {n.name: n for n in layer}

    def of(prefix: str) -> list[str]:
        return [k for k in ours if k.startswith(prefix)]

    attention = of("scaled_dot_product_attention")[0]
    head_dim = hidden // heads
    lse = heads // tp * seq * 4
    # torch keeps q, k and v repeated to every head, and the output; TE k and v unrepeated
    assert ours[attention] == 4 * heads // tp * head_dim * token + lse
    assert theirs[attention] == (2 + 2 * kv / heads) * heads // tp * head_dim * token + lse
    # the two linears reading the gathered (norm) outputs: whole under torch's styles, a
    # tp-th under Megatron-Core's
    gathered = next(k for k in of("linear") if by_kind[k].inputs[0].shape[-1] == hidden)
    assert ours[gathered] == hidden * token and theirs[gathered] == hidden * token // tp
    # SwiGLU: torch keeps silu's input, and silu's output and up at the product; fused:
    # gate and up
    mul = next(k for k in of("mul") if by_kind[k].outputs[0].shape[-1] == ffn)
    assert ours[mul] == 2 * ffn // tp * token and theirs[mul] == ffn // tp * token
    assert sum(theirs.values()) < sum(ours.values())
    # fp8: one cast of the shared input for q/k/v and for gate/up (TE's fused GEMMs),
    # where torchao casts it at every linear
    fp8_ours, fp8_theirs = saved("autopar", "tensorwise"), saved("megatron", "tensorwise")
    assert len([k for k in fp8_ours if k.startswith("linear")]) == 7
    assert len([k for k in fp8_theirs if k.startswith("linear")]) == 4


def _comm(runtime: str, layers: int) -> tuple[float, float]:
    """(exposed communication, compute) per micro-batch of one stage: a Llama 3 70B-wide
    model at tp 4 with sequence parallelism, 8K tokens."""
    from planner.evaluate.estimate import evaluate
    from planner.graph.tracing import trace_model
    from planner.intra_op.megatron import tensor_parallel_layout
    from planner.models import ModelSpec, resolve
    from planner.plan import TrainingSettings
    from planner.request import model_ref

    resolved = resolve(ModelSpec(name="llama3-70b", config={"layers": layers}))
    training = TrainingSettings(global_batch_size=2, seq_len=8192, runtime=runtime)
    graph = trace_model(resolved, 1, 8192, "bf16")
    layouts = tensor_parallel_layout(graph, 4, sequence_parallel=True)
    config = ParallelConfig(2, 4, 1, 1, zero=1)
    plan = evaluate(
        graph,
        load_cluster("dgx-h100"),
        training,
        config,
        model_ref(resolved, 8192),
        layouts=layouts,
    )
    stage = plan.stages[0].predicted
    return stage.comm_s, stage.compute_s


def test_megatron_overlaps_a_layers_tensor_parallel_collectives_with_its_gemms():
    # each layer adds its all-gathers and reduce-scatters to what autopar's executor waits
    # for; under Megatron's --tp-comm-overlap the layer's compute covers them (a 70B layer
    # at tp 4 computes for ~30 ms, its collectives take ~5 ms): two more layers, no more
    # exposed communication
    (mine2, compute2), (mine4, compute4) = _comm("autopar", 2), _comm("autopar", 4)
    (theirs2, _), (theirs4, _) = _comm("megatron", 2), _comm("megatron", 4)
    per_layer = (mine4 - mine2) / 2
    assert 0 < per_layer < (compute4 - compute2) / 2
    assert theirs4 == pytest.approx(theirs2)
    assert mine2 - theirs2 == pytest.approx(2 * per_layer)


@pytest.mark.parametrize("zero", [0, 1])
def test_whole_state_is_what_the_ledger_says_each_rank_holds(tmp_path, zero):
    """Without FSDP2 (DDP, ZeRO-1's executor.zero1) every rank keeps whole fp32 parameters
    and gradients, and under ZeRO-1 fp32 master shards beside the optimizer's states: the
    memory prediction holds what the ledger (measured by the executor tests) lists."""
    from api.cli import main as cli_main

    out = tmp_path / "plan.json"
    args = ["estimate", "--model", "gpt-350m", "--config", "layers=2", "hidden=64", "heads=4"]
    args += ["vocab=256", "--cluster", "cpu-local", "--global-batch", "8", "--seq", "32"]
    args += ["--dtype", "fp32", "--dp", "4", "--zero", str(zero), "-o", str(out)]
    assert cli_main(args) == 0
    stage = json.loads(out.read_text())["stages"][0]["predicted"]
    memory, held = stage["memory"], stage["ledger"]["held"][0]
    assert (memory["params"], memory["grads"]) == (held["params"], held["grads"])
    assert memory["optimizer"] == held["optimizer"]


def _small_gpt(hidden: int, global_batch: int, tp: int):
    """A 4-layer GPT on dgx-a100-80g in bf16, traced at micro-batch 1, and its layer table
    under Megatron's layout at `tp`."""
    from planner.cluster.mesh import LogicalMesh
    from planner.cost.model import CostModel
    from planner.evaluate.layer_table import build_table
    from planner.intra_op.megatron import tensor_parallel_layout
    from planner.request import resolve_request

    cluster = load_cluster("dgx-a100-80g")
    inputs = resolve_request(
        {"name": "gpt-350m", "config": {"layers": 4, "hidden": hidden, "heads": 8}},
        cluster,
        {"global_batch_size": global_batch, "seq_len": 128, "dtype": "bf16"},
    ).trace(batches=(1,))
    cm = CostModel(cluster, "bf16", attention=inputs.training.attention)
    mesh = LogicalMesh.contiguous(cluster, 0, (1, tp))
    table, _ = build_table(inputs.base, tensor_parallel_layout(inputs.base, tp), cm, mesh)
    return inputs, table


def test_under_a_pipeline_zero2_takes_zero3s_place_where_fsdp2_holds_gradients_whole():
    """torch's pipeline stages hold FSDP2's gradients whole at ZeRO 2-3: predicted ZeRO-3
    then holds more than ZeRO-2 and is never faster, so the search tries ZeRO-2 in ZeRO-3's
    own group (not only where ZeRO-1 does not fit) and not ZeRO-3 on the device."""
    import itertools

    from planner.parallel.data import on_device_groups, zero_groups

    levels = (0, 1, 2, 3)
    assert on_device_groups(4, levels, "autopar", 2, 8) == [[1, 0], [2]]
    assert on_device_groups(4, levels, "torchtitan", 2, 1) == [[1, 0], [2]]
    for runtime, pp, m, ep in [("autopar", 1, 8, 1), ("megatron", 2, 8, 1), ("autopar", 2, 8, 2)]:
        assert on_device_groups(4, levels, runtime, pp, m, ep) == zero_groups(4, levels)
    assert on_device_groups(4, (3,), "autopar", 2, 8) == [[3]]  # pinned: kept

    inputs, table = _small_gpt(hidden=256, global_batch=16, tp=2)
    cluster, training, graph = inputs.cluster, inputs.training, inputs.base
    for schedule, ckpt in itertools.product(("gpipe", "1f1b"), (False, True)):
        two, three = (
            predict(
                graph,
                cluster,
                training,
                ParallelConfig(2, 2, 2, 8, schedule, 1, zero, ckpt),
                table=table,
            )
            for zero in (2, 3)
        )
        assert three.peak_memory_bytes > two.peak_memory_bytes, (schedule, ckpt)
        assert three.step_time_s >= two.step_time_s, (schedule, ckpt)


def test_torchtitan_reduces_every_micro_batchs_gradients_without_a_pipeline():
    """torchtitan's train_step runs loss.backward() for each gradient-accumulation
    micro-batch with FSDP2's sync on: each reduces its gradients; autopar's executor (ZeRO-2:
    once, in the last backward) and any pipeline (torch's stage) reduce once a step."""
    titan, autopar = RUNTIMES["torchtitan"], RUNTIMES["autopar"]
    assert [titan.reductions_per_step(z, 8, 1, 4) for z in (0, 1, 2, 3)] == [4, 4, 4, 4]
    assert titan.reductions_per_step(2, 8, 2, 4) == 1 and titan.reductions_per_step(2, 1, 1, 4) == 1
    assert [autopar.reductions_per_step(z, 8, 1, 4) for z in (0, 1, 2, 3)] == [1, 1, 1, 4]

    inputs, table = _small_gpt(hidden=512, global_batch=32, tp=1)
    cluster, graph = inputs.cluster, inputs.base

    def step(runtime: str, m: int) -> float:  # one sample per rank and micro-batch
        update = {"runtime": runtime, "global_batch_size": 8 * m}
        training = inputs.training.model_copy(update=update)
        cfg = ParallelConfig(8, 1, 1, m, "1f1b", 1, 2, False)
        return predict(graph, cluster, training, cfg, table=table).step_time_s

    assert step("torchtitan", 1) == pytest.approx(step("autopar", 1), rel=1e-12)
    assert step("torchtitan", 4) > step("autopar", 4) * 1.001


def test_a_torchtitan_plans_ledger_counts_a_reduction_each_micro_batch():
    """The ledger a plan carries follows the runtime that runs it: torchtitan reduces (and
    at ZeRO 1-2 gathers again) in each micro-batch's backward, autopar's executor once a
    step; the step's own terms (the gradient norm) once in both; ZeRO-3 and pipelined plans
    alike in both."""
    from planner.evaluate.estimate import evaluate
    from planner.evaluate.ledger import rank_ledger

    inputs, _ = _small_gpt(hidden=256, global_batch=32, tp=1)

    def dp_calls(runtime: str, zero: int, m: int, pp: int = 1) -> dict[str, int]:
        update = {"runtime": runtime, "global_batch_size": 8 // pp * m}
        training = inputs.training.model_copy(update=update)
        cfg = ParallelConfig(8 // pp, 1, pp, m, "1f1b", 1, zero, False)
        plan = evaluate(inputs.base, inputs.cluster, training, cfg, inputs.model)
        comm, _ = rank_ledger(plan, 0)
        return {kind: calls for (kind, axis), (calls, _) in comm.items() if axis == "dp"}

    synced = {0: ("all_reduce",), 2: ("reduce_scatter", "all_gather")}
    for zero, kinds in synced.items():
        a2, a4 = dp_calls("autopar", zero, 2), dp_calls("autopar", zero, 4)
        t2, t4 = dp_calls("torchtitan", zero, 2), dp_calls("torchtitan", zero, 4)
        assert a2 == a4 and t4.keys() == a4.keys(), (a4, t4)
        for kind in a4:  # calls = once a step + per reduction x reductions (1, or m)
            per_reduction = (t4[kind] - t2[kind]) // 2
            assert t4[kind] - a4[kind] == 3 * per_reduction, (zero, kind, t4, a4)
            assert (per_reduction > 0) == (kind in kinds), (zero, kind, t4, a4)
    assert dp_calls("torchtitan", 3, 4) == dp_calls("autopar", 3, 4)
    assert dp_calls("torchtitan", 2, 4, pp=2) == dp_calls("autopar", 2, 4, pp=2)
