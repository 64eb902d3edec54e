"""`autopar export`: a plan as a torchtitan job config (parsed by torchtitan's own
ConfigManager), Megatron-LM arguments and a DeepSpeed JSON (checked against the keys their
documentation lists); what a framework cannot express is refused naming the plan field."""

import json
from pathlib import Path

import pytest

from api.cli import main as cli_main
from planner.plan import Plan

MODEL = ["--model", "llama3-8b"]  # the shape of torchtitan's llama3 8B flavor


def _estimate(tmp_path, name: str, *flags: str) -> tuple[Plan, str]:
    path = tmp_path / f"{name}.json"
    args = ["estimate", *MODEL, "--cluster", "dgx-a100-80g", "--nodes", "2"]
    args += ["--global-batch", "64", "--seq", "512", *flags, "-o", str(path)]
    assert cli_main(args) == 0
    return Plan.from_json(path.read_text()), str(path)


def _export(path: str, target: str, out) -> int:
    return cli_main(["export", path, "--to", target, "-o", str(out)])


PIPELINED = ("--dp", "2", "--tp", "4", "--pp", "2", "--microbatches", "8")
PIPELINED += ("--schedule", "interleaved_1f1b", "--virtual-stages", "2", "--checkpointing")
PIPELINED += ("--sequence-parallel", "--zero", "1")
SHARDED = ("--dp", "4", "--tp", "4", "--pp", "1", "--microbatches", "2", "--zero", "3")


def test_torchtitan_config_parses_with_torchtitans_parser(tmp_path):
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    # torchtitan's tensor parallelism is always sequence-parallel (SequenceParallel norms)
    for name, flags in (("pipelined", PIPELINED), ("sharded", (*SHARDED, "--sequence-parallel"))):
        plan, path = _estimate(tmp_path, name, *flags)
        out = tmp_path / f"{name}.toml"
        assert _export(path, "torchtitan", out) == 0
        config = ConfigManager().parse_args(["--job.config_file", str(out)])
        par, training = config.parallelism, config.training
        pp, dp, tp = plan.mesh.shape
        assert (par.pipeline_parallel_degree, par.tensor_parallel_degree) == (pp, tp)
        assert training.global_batch_size == 64 and training.seq_len == 512
        assert training.mixed_precision_param == "bfloat16"
        mbs = 64 // (dp * plan.schedule.microbatches)
        if name == "pipelined":
            assert par.data_parallel_replicate_degree * par.data_parallel_shard_degree == dp
            assert par.pipeline_parallel_schedule == "Interleaved1F1B"
            assert par.pipeline_parallel_microbatch_size == mbs
            # torchtitan's micro-batches: its local batch over the pipeline micro-batch size
            assert training.local_batch_size // mbs == plan.schedule.microbatches
            assert par.pipeline_parallel_layers_per_stage == 32 // (pp * 2)
            assert config.activation_checkpoint.mode == "full"
        else:
            assert par.data_parallel_shard_degree == dp and par.data_parallel_replicate_degree == 1
            assert par.fsdp_reshard_after_forward == "always"
            # gradient accumulation: global / (local x dp) steps = the plan's micro-batches
            assert 64 // (training.local_batch_size * dp) == plan.schedule.microbatches
            assert config.activation_checkpoint.mode == "none"


# Top-level keys of a DeepSpeed config, from https://www.deepspeed.ai/docs/config-json/ (and
# the AutoTP training tutorial for tensor_parallel).
DEEPSPEED_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "amp",
    "gradient_clipping",
    "prescale_gradients",
    "zero_optimization",
    "activation_checkpointing",
    "tensor_parallel",
    "steps_per_print",
    "wall_clock_breakdown",
}
ZERO_KEYS = {"stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "offload_param"}
CKPT_KEYS = {
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
}


def test_deepspeed_json_uses_documented_keys_and_consistent_batches(tmp_path):
    plan, path = _estimate(tmp_path, "sharded", *SHARDED, "--checkpointing")
    out = tmp_path / "ds.json"
    assert _export(path, "deepspeed", out) == 0
    config = json.loads(out.read_text())
    assert set(config) <= DEEPSPEED_KEYS
    assert set(config["zero_optimization"]) <= ZERO_KEYS
    assert set(config["activation_checkpointing"]) <= CKPT_KEYS
    dp = plan.mesh.shape[1]
    assert config["train_batch_size"] == (
        config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * dp
    )
    assert config["zero_optimization"]["stage"] == 3 and config["bf16"]["enabled"]
    assert config["tensor_parallel"]["autotp_size"] == 4


def test_megatron_arguments_carry_the_degrees(tmp_path):
    plan, path = _estimate(tmp_path, "pipelined", *PIPELINED)
    out = tmp_path / "megatron.args"
    assert _export(path, "megatron", out) == 0
    args = dict(
        line.split(" ", 1) if " " in line else (line, "")
        for line in out.read_text().split("\n")
        if line
    )
    assert args["--tensor-model-parallel-size"] == "4"
    assert args["--pipeline-model-parallel-size"] == "2"
    assert args["--num-layers-per-virtual-pipeline-stage"] == "8"  # 32 over pp 2 x v 2
    assert int(args["--global-batch-size"]) == 64 and "--bf16" in args
    assert args["--recompute-granularity"] == "full"
    assert "--sequence-parallel" in args
    # Megatron's micro-batches per step: global / (micro-batch x dp)
    mbs = int(args["--micro-batch-size"])
    assert 64 // (mbs * plan.mesh.shape[1]) == plan.schedule.microbatches


def test_what_a_framework_cannot_express_is_refused_by_field(tmp_path, capsys):
    _, path = _estimate(tmp_path, "pipelined", *PIPELINED)
    assert _export(path, "deepspeed", tmp_path / "x") == 2
    assert "error: plan.mesh.pp: deepspeed cannot" in capsys.readouterr().err
    _, gpipe = _estimate(
        tmp_path,
        "gpipe",
        "--dp",
        "2",
        "--tp",
        "4",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--schedule",
        "gpipe",
    )
    assert _export(gpipe, "megatron", tmp_path / "y") == 2
    assert "error: plan.schedule.name: megatron cannot express this plan" in capsys.readouterr().err
    _, plain_tp = _estimate(tmp_path, "plain", *SHARDED)
    assert _export(plain_tp, "torchtitan", tmp_path / "z") == 2
    assert "error: plan.sequence_parallel: torchtitan cannot" in capsys.readouterr().err
    _, sp = _estimate(tmp_path, "sp", *SHARDED, "--sequence-parallel")
    assert _export(sp, "deepspeed", tmp_path / "w") == 2
    assert "error: plan.sequence_parallel: deepspeed cannot" in capsys.readouterr().err
    _, selective = _estimate(tmp_path, "sel", *SHARDED, "--checkpointing", "selective")
    assert _export(selective, "megatron", tmp_path / "v") == 2
    assert "error: plan.stages[].checkpoint_policy: megatron cannot" in capsys.readouterr().err
    # Partial checkpointing: a number of layers per stage, which no framework takes.
    plan, _ = _estimate(tmp_path, "partial", *PIPELINED)
    stages = [st.model_copy(update={"checkpointed_layers": 1}) for st in plan.stages]
    partial = tmp_path / "partial-edited.json"
    partial.write_text(plan.model_copy(update={"stages": stages}).to_json())
    for target in ("megatron", "torchtitan", "deepspeed"):
        assert _export(str(partial), target, tmp_path / f"p-{target}") == 2
        err = capsys.readouterr().err
        assert f"error: plan.stages[].checkpointed_layers: {target} cannot" in err


def test_torchtitan_takes_alternating_checkpointing_as_its_op_policy(tmp_path, capsys):
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    flags = (*SHARDED, "--sequence-parallel", "--checkpointing", "selective_alternate")
    plan, path = _estimate(tmp_path, "alternate", *flags)
    assert {st.checkpoint_policy for st in plan.stages} == {"selective_alternate"}
    out = tmp_path / "alternate.toml"
    assert _export(path, "torchtitan", out) == 0
    config = ConfigManager().parse_args(["--job.config_file", str(out)])
    assert config.activation_checkpoint.mode == "selective"
    assert config.activation_checkpoint.selective_ac_option == "op"
    # Every matmul output kept: no torchtitan setting does that.
    flags = (*SHARDED, "--sequence-parallel", "--checkpointing", "selective")
    _, path = _estimate(tmp_path, "selective", *flags)
    assert _export(path, "torchtitan", tmp_path / "selective.toml") == 2
    assert "error: plan.stages[].checkpoint_policy: torchtitan cannot" in capsys.readouterr().err


def test_hsdp_exports_to_torchtitans_two_dp_degrees_only(tmp_path, capsys):
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    flags = ("--dp", "8", "--tp", "2", "--pp", "1", "--microbatches", "2", "--zero", "3")
    plan, path = _estimate(tmp_path, "hsdp", *flags, "--dp-shard", "4", "--sequence-parallel")
    assert plan.mesh.dp_shard == 4
    out = tmp_path / "hsdp.toml"
    assert _export(path, "torchtitan", out) == 0
    config = ConfigManager().parse_args(["--job.config_file", str(out)])
    assert config.parallelism.data_parallel_replicate_degree == 2
    assert config.parallelism.data_parallel_shard_degree == 4
    for target in ("megatron", "deepspeed"):
        assert _export(path, target, tmp_path / f"h-{target}") == 2
        assert f"error: plan.mesh.dp_shard: {target} cannot" in capsys.readouterr().err


def test_context_parallelism_exports_to_torchtitan_and_megatron(tmp_path, capsys):
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    # dp 2 x cp 4 x tp 2 on 16 GPUs, counted as torchtitan and Megatron count them
    flags = ("--dp", "2", "--tp", "2", "--pp", "1", "--microbatches", "4", "--zero", "3")
    plan, path = _estimate(tmp_path, "cp", *flags, "--cp", "4", "--sequence-parallel")
    assert plan.mesh.cp == 4
    out = tmp_path / "cp.toml"
    assert _export(path, "torchtitan", out) == 0
    config = ConfigManager().parse_args(["--job.config_file", str(out)])
    par = config.parallelism
    assert par.context_parallel_degree == 4
    assert par.data_parallel_shard_degree * par.data_parallel_replicate_degree == 2
    assert par.context_parallel_load_balancer == "headtail"
    assert par.context_parallel_rotate_method == "allgather"
    assert config.training.local_batch_size == 64 // 2 // 4  # one micro-batch of a replica
    assert _export(path, "megatron", tmp_path / "cp.args") == 0
    args = (tmp_path / "cp.args").read_text().split("\n")
    assert "--context-parallel-size 4" in args and "--cp-comm-type allgather" in args
    assert "--micro-batch-size 8" in args  # 64 samples over 2 replicas x 4 micro-batches
    assert _export(path, "deepspeed", tmp_path / "cp.json") == 2
    assert "error: plan.mesh.cp: deepspeed cannot" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("schedule", "torch_class"),
    [("zbv_zero_bubble", "ScheduleZBVZeroBubble"), ("dualpipe_v", "ScheduleDualPipeV")],
)
def test_torchtitan_takes_the_v_schedules(tmp_path, schedule, torch_class):
    pytest.importorskip("torchtitan")
    from torch.distributed.pipelining import schedules
    from torchtitan.config import ConfigManager

    flags = ("--dp", "2", "--tp", "4", "--pp", "2", "--microbatches", "8", "--sequence-parallel")
    plan, path = _estimate(tmp_path, schedule, *flags, "--schedule", schedule, "--zero", "1")
    assert [st.ranks for st in plan.stages] == [plan.stages[i].ranks for i in (0, 1, 1, 0)]
    out = tmp_path / f"{schedule}.toml"
    assert _export(path, "torchtitan", out) == 0
    par = ConfigManager().parse_args(["--job.config_file", str(out)]).parallelism
    found = schedules.get_schedule_class(par.pipeline_parallel_schedule)
    assert found is getattr(schedules, torch_class)
    assert par.pipeline_parallel_layers_per_stage == 32 // 4


def test_fp8_exports_as_torchtitans_float8_converter_and_megatrons_fp8(tmp_path, capsys):
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    path = tmp_path / "fp8.json"
    args = ["estimate", *MODEL, "--cluster", "dgx-h100", "--nodes", "1", "--global-batch", "64"]
    args += ["--seq", "512", "--dp", "8", "--tp", "1", "--pp", "1", "--microbatches", "1"]
    assert cli_main([*args, "--zero", "3", "--fp8", "tensorwise", "-o", str(path)]) == 0
    assert Plan.from_json(path.read_text()).fp8 == "tensorwise"
    assert _export(str(path), "torchtitan", tmp_path / "fp8.toml") == 0
    config = ConfigManager().parse_args(["--job.config_file", str(tmp_path / "fp8.toml")])
    assert config.model.converters == ["quantize.linear.float8"]
    assert config.quantize.linear.float8.recipe_name == "tensorwise"
    assert config.quantize.linear.float8.filter_fqns == ["output"]  # the head stays bf16
    assert config.compile.enable and "model" in config.compile.components
    assert _export(str(path), "megatron", tmp_path / "fp8.args") == 0
    lines = (tmp_path / "fp8.args").read_text().split("\n")
    assert "--fp8-format hybrid" in lines and "--fp8-recipe tensorwise" in lines
    assert _export(str(path), "deepspeed", tmp_path / "fp8.ds") == 2
    assert "error: plan.fp8: deepspeed cannot" in capsys.readouterr().err
    # an A100 has no fp8 tensor cores: the flag is refused, named
    a100 = [a if a != "dgx-h100" else "dgx-a100-80g" for a in args]
    assert cli_main([*a100, "--fp8", "tensorwise", "-o", str(path)]) == 2
    assert "--fp8" in capsys.readouterr().err


def test_torchtitan_builds_the_plans_model_and_pipeline_split(tmp_path, capsys):
    """The export as torchtitan itself reads it: its ParallelDims at the plan's world size,
    the llama3 flavor built on the meta device with the plan's shape, and its pipeline split
    of the layers into the plan's chunks."""
    pytest.importorskip("torchtitan")
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part
    from torchtitan.models.llama3 import Transformer, llama3_args

    plan, path = _estimate(tmp_path, "pipelined", *PIPELINED)
    out = tmp_path / "pipelined.toml"
    assert _export(path, "torchtitan", out) == 0
    config = ConfigManager().parse_args(["--job.config_file", str(out)])
    par = config.parallelism
    world = len({r for st in plan.stages for r in st.ranks})
    ParallelDims(  # raises unless the degrees multiply to the world
        par.data_parallel_replicate_degree,
        par.data_parallel_shard_degree,
        par.context_parallel_degree,
        par.tensor_parallel_degree,
        par.pipeline_parallel_degree,
        1,
        1,
        world,
    )
    assert (config.model.name, config.model.flavor) == ("llama3", "8B")
    with torch.device("meta"):
        model = Transformer(llama3_args[config.model.flavor])
    mc = plan.request.model.config
    block = model.layers["0"]
    assert len(model.layers) == mc["layers"] == 32
    assert tuple(block.feed_forward.w1.weight.shape) == (mc["ffn_hidden"], mc["hidden"])
    head_dim = mc["hidden"] // mc["heads"]
    assert block.attention.wk.weight.shape[0] == mc["kv_heads"] * head_dim
    chunks = plan.schedule.virtual_stages * par.pipeline_parallel_degree
    stages = chunks * par.pipeline_parallel_layers_per_stage
    parts = generate_llm_fqn_per_model_part(
        stages // par.pipeline_parallel_layers_per_stage,
        len(model.layers),
        par.pipeline_parallel_first_stage_less_layers,
        par.pipeline_parallel_last_stage_less_layers,
    )
    layers = [[int(m.split(".")[1]) for m in part if m.startswith("layers.")] for part in parts]
    assert [(p[0], p[-1] + 1) for p in layers] == [tuple(st.layers) for st in plan.stages]
    # a shape torchtitan has no flavor for is refused, naming the model and its shape
    args = ["estimate", "--model", "llama3-8b", "--config", "layers=8", "--cluster", "dgx-h100"]
    args += ["--global-batch", "8", "--seq", "512", "--dp", "8", "--zero", "3", "-o"]
    assert cli_main([*args, str(tmp_path / "small.json")]) == 0
    assert _export(str(tmp_path / "small.json"), "torchtitan", tmp_path / "s.toml") == 2
    err = capsys.readouterr().err
    assert "error: plan.request.model: torchtitan cannot express this plan" in err
    assert "layers 8" in err


def _plan_for(tmp_path, target: str, *flags: str) -> tuple[int, str]:
    path = tmp_path / f"{target}-plan.json"
    args = ["plan", *MODEL, "--cluster", "dgx-a100-80g", "--nodes", "2", "--global-batch", "64"]
    args += ["--seq", "512", "--no-baselines", "--export-to", target, "-o", str(path), *flags]
    return cli_main(args), str(path)


@pytest.mark.parametrize("target", ["megatron", "deepspeed", "torchtitan"])
def test_a_plan_made_for_a_framework_exports_to_it(tmp_path, target):
    """`--export-to`: the best plan the framework can express, predicted for its runtime,
    which its exporter then takes; the explanation states the unrestricted best's gain."""
    code, path = _plan_for(tmp_path, target)
    assert code == 0
    plan = Plan.from_json(Path(path).read_text())
    assert plan.request.training.runtime == target
    assert _export(path, target, tmp_path / "out") == 0
    line = next(x for x in plan.explanation if x.startswith(f"Planned for {target}"))
    assert "the best plan without that restriction" in line
    if target == "deepspeed":  # its pipelines are code, not configuration
        assert plan.mesh.shape[0] == 1


def test_a_plan_for_a_framework_takes_only_its_runtime(tmp_path, capsys):
    code, _ = _plan_for(tmp_path, "megatron", "--runtime", "deepspeed")
    assert code == 2
    assert "--export-to" in capsys.readouterr().err


def test_the_clis_export_targets_are_the_exporters():
    from api.cli.plan import EXPORT_TARGETS
    from api.export.targets import TARGETS

    assert set(EXPORT_TARGETS) == set(TARGETS)


def test_torchtitan_takes_dropless_expert_parallelism_within_fsdp_only(tmp_path, capsys):
    """torchtitan's MoE exchanges tokens by count inside FSDP's shard group: the zoo MoE's
    capacity-padded expert parallelism is refused, and so is a transformers MoE's under
    ZeRO-0 (no shard group to draw the ep ranks from) or drawn from part of a cp group, each
    naming mesh.ep; a Qwen3 MoE not of a torchtitan flavor's shape is refused naming its
    sizes."""
    from tests.hf_configs import QWEN3_30B_A3B

    zoo = tmp_path / "zoo.json"
    flags = ["--cluster", "dgx-a100-80g", "--global-batch", "16", "--seq", "128", "--dp", "8"]
    args = ["estimate", "--model", "moe-380m", "--config", "layers=2", "experts=8", *flags]
    assert cli_main([*args, "--ep", "2", "--zero", "3", "-o", str(zoo)]) == 0
    assert _export(str(zoo), "torchtitan", tmp_path / "zoo.toml") == 2
    assert "mesh.ep: torchtitan cannot" in capsys.readouterr().err
    config = tmp_path / "qwen3.json"
    small = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16, "vocab_size": 128}
    small |= {"num_hidden_layers": 2, "num_experts": 8, "moe_intermediate_size": 32}
    config.write_text(json.dumps({**QWEN3_30B_A3B, **small}))
    hf = ["estimate", "--hf-config", str(config), *flags]
    for zero, what in (("0", "mesh.ep: torchtitan cannot"), ("3", "moe_intermediate_size 32")):
        path = tmp_path / f"qwen{zero}.json"
        assert cli_main([*hf, "--ep", "2", "--zero", zero, "-o", str(path)]) == 0
        assert _export(str(path), "torchtitan", tmp_path / "q.toml") == 2
        assert what in capsys.readouterr().err, zero
    # ep 2 inside a cp group of 4: torchtitan's ep mesh takes whole cp groups
    config.write_text(json.dumps({**QWEN3_30B_A3B, **small}))  # (qwen3.json: a plan above)
    inside = [*hf[:-1], "2", "--cp", "4", "--ep", "2", "--zero", "3"]
    assert cli_main([*inside, "-o", str(tmp_path / "cp.json")]) == 0
    assert _export(str(tmp_path / "cp.json"), "torchtitan", tmp_path / "q.toml") == 2
    assert "ep a multiple of cp 4, not 2" in capsys.readouterr().err


def test_megatron_takes_the_zoo_moe_at_tp_1_only(tmp_path, capsys):
    """Megatron-Core's MoE at tp > 1 splits each expert's features over tp or routes each tp
    rank's sequence shard; the zoo's GShard MoE at tp > 1 runs its experts whole on every tp
    rank, on every token: refused naming mesh.tp (at tp 1 it exports)."""
    flags = ["--cluster", "dgx-a100-80g", "--global-batch", "16", "--seq", "128"]
    args = ["estimate", "--model", "moe-380m", "--config", "layers=2", "experts=8", *flags]
    for dp, tp, code in (("4", "2", 2), ("8", "1", 0)):
        path = tmp_path / f"tp{tp}.json"
        assert cli_main([*args, "--dp", dp, "--tp", tp, "-o", str(path)]) == 0
        assert _export(str(path), "megatron", tmp_path / f"tp{tp}.args") == code, tp
    assert "error: plan.mesh.tp: megatron cannot" in capsys.readouterr().err
