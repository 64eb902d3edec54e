"""`autopar export --to megatron` checked by Megatron-Core's own TransformerConfig: the model
and parallel part of each exported argument list, translated to the config's fields as
Megatron-LM does (its CLI flags for TransformerConfig are the fields' names with dashes,
megatron/training/argument_utils.py; the few older flags it translates itself, its
core_transformer_config_from_args: --swiglu, --num-experts, the dtype flags, the group-query
and bias switches), is constructed, which runs Megatron-Core's __post_init__ checks (heads
and query groups against tp, sequence parallelism against tp, pipeline layout, MoE with
expert and tensor parallelism, recomputation, fp8). The whole argument list through
Megatron-LM's parse_args and validate_args, which no package carries, is bench/megatron_args.py
(results/megatron_args.md)."""

import dataclasses
import json
import re
import shlex

import pytest

from api.cli import main as cli_main
from tests.hf_configs import MIXTRAL_8X7B

pytest.importorskip("megatron.core")

PLANS = {  # name: autopar estimate flags (llama3-8b at 8K on 2 DGX H100 unless named)
    "dp16 zero1": ("--dp", "16", "--zero", "1"),
    "tp2 pp2 interleaved v2 SP": (
        *("--dp", "4", "--tp", "2", "--pp", "2", "--microbatches", "8", "--zero", "1"),
        *("--schedule", "interleaved_1f1b", "--virtual-stages", "2", "--sequence-parallel"),
    ),
    "tp4 pp4 full recompute": (
        *("--dp", "1", "--tp", "4", "--pp", "4", "--microbatches", "16", "--checkpointing"),
    ),
    "tp8 SP fp8": ("--dp", "2", "--tp", "8", "--sequence-parallel", "--fp8", "tensorwise"),
    "tp2 cp2 SP": ("--dp", "4", "--tp", "2", "--cp", "2", "--sequence-parallel", "--zero", "1"),
    "cp4 ring": ("--dp", "4", "--cp", "4", "--cp-comm", "ring", "--zero", "1"),
    "cp2 ulysses": ("--dp", "8", "--cp", "2", "--cp-comm", "ulysses", "--zero", "1"),
    "fsdp2": ("--dp", "16", "--zero", "3"),
    "pp2 fp16": ("--dp", "8", "--pp", "2", "--microbatches", "4", "--zero", "1", "--dtype", "fp16"),
    "gpt-1.3b tp2 pp2": (
        *("--model", "gpt-1.3b", "--dp", "4", "--tp", "2", "--pp", "2", "--microbatches", "4"),
        *("--seq", "2048"),
    ),
    "moe-1.3b ep4": ("--model", "moe-1.3b", "--dp", "16", "--ep", "4", "--seq", "1024"),
    "mixtral ep8": (
        *("--hf-config", "MIXTRAL_8X7B", "--config", "layers=2", "--dp", "16"),
        *("--ep", "8", "--zero", "1", "--runtime", "megatron", "--seq", "4096"),
    ),
    # each expert's features over tp beside ep (expert tensor parallelism)
    "mixtral tp2 ep4 SP": (
        *("--hf-config", "MIXTRAL_8X7B", "--config", "layers=2", "--dp", "8", "--tp", "2"),
        *("--ep", "4", "--zero", "1", "--runtime", "megatron", "--sequence-parallel"),
        *("--seq", "4096"),
    ),
    # ep drawn from the dp x cp ranks: Megatron-Core's expert groups (order tp-ep-dp-pp) are
    # the plan's, cp innermost in its dense order (test_expert_groups_are_the_plans)
    "mixtral cp2 ep8": (
        *("--hf-config", "MIXTRAL_8X7B", "--config", "layers=2", "--dp", "8", "--cp", "2"),
        *("--ep", "8", "--zero", "1", "--runtime", "megatron", "--seq", "8192"),
    ),
    # expert tp 1: every expert whole, ep over the dp x tp ranks (MoE parallel folding)
    "mixtral tp2 ep8 etp1 SP": (
        *("--hf-config", "MIXTRAL_8X7B", "--config", "layers=2", "--dp", "8", "--tp", "2"),
        *("--ep", "8", "--etp", "1", "--zero", "1", "--runtime", "megatron"),
        *("--sequence-parallel", "--seq", "4096"),
    ),
}
# Flags of Megatron-LM's training loop, data, tokenizer and optimizer: not the model's config
TRAINING_FLAGS = {
    "micro_batch_size",
    "global_batch_size",
    "seq_length",
    "max_position_embeddings",
    "tokenizer_type",
    "vocab_size",
    "optimizer",
    "clip_grad",
    "use_distributed_optimizer",
    "use_torch_fsdp2",
    "untie_embeddings_and_output_weights",
    "position_embedding_type",
    "rotary_base",
    "cp_comm_type",
}


def _flags(tmp_path, name: str, flags: tuple[str, ...]) -> tuple[list[str], object]:
    from planner.plan import Plan

    if "MIXTRAL_8X7B" in flags:
        config = tmp_path / "mixtral.json"
        config.write_text(json.dumps(MIXTRAL_8X7B))
        flags = tuple(str(config) if f == "MIXTRAL_8X7B" else f for f in flags)
    given = "--model" in flags or "--hf-config" in flags
    model = () if given else ("--model", "llama3-8b", "--config", "layers=8")
    seq = () if "--seq" in flags else ("--seq", "8192")
    path, out = tmp_path / f"{len(name)}.json", tmp_path / f"{len(name)}.args"
    args = ["estimate", *model, "--cluster", "dgx-h100", "--nodes", "2", "--global-batch", "64"]
    args += [*seq, "--pp", "1", "--tp", "1", "--microbatches", "1", *flags, "-o", str(path)]
    assert cli_main(args) == 0, name
    assert cli_main(["export", str(path), "--to", "megatron", "-o", str(out)]) == 0, name
    return shlex.split(out.read_text()), Plan.from_json(path.read_text())


def _config_fields(flags: list[str]) -> dict:
    """The exported flags as TransformerConfig's fields, Megatron-LM's way."""
    import torch
    import torch.nn.functional as F

    values: dict = {}
    i = 0
    while i < len(flags):
        key = flags[i].removeprefix("--").replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            values[key], i = flags[i + 1], i + 2
        else:
            values[key], i = True, i + 1
    out: dict = {}
    if values.pop("swiglu", False):
        out.update(gated_linear_unit=True, activation_func=F.silu)
    if values.pop("disable_bias_linear", False):
        out["add_bias_linear"] = False
    if not values.pop("group_query_attention", False):
        values.pop("num_query_groups", None)
    if "num_experts" in values:
        out["num_moe_experts"] = int(values.pop("num_experts"))
    if "norm_epsilon" in values:
        out["layernorm_epsilon"] = float(values.pop("norm_epsilon"))
    dtype = torch.bfloat16 if values.pop("bf16", False) else None
    if values.pop("fp16", False):
        dtype = torch.float16
    out.update(bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16)
    out["pipeline_dtype"] = dtype or torch.float32
    if "num_layers_per_virtual_pipeline_stage" in values:
        per = int(values.pop("num_layers_per_virtual_pipeline_stage"))
        stages = int(values["num_layers"]) // int(values["pipeline_model_parallel_size"])
        out["virtual_pipeline_model_parallel_size"] = stages // per
    if "fp8_format" in values:
        out["fp8"] = values.pop("fp8_format")
    if "moe_layer_freq" in values:  # Megatron's pattern syntax, as exported: "([1]*1+[0]*1)*8"
        found = re.fullmatch(r"\(\[1\]\*(\d+)\+\[0\]\*(\d+)\)\*(\d+)", values.pop("moe_layer_freq"))
        assert found, "an MoE layer pattern this check reads"
        ones, zeros, times = (int(g) for g in found.groups())
        out["moe_layer_freq"] = ([1] * ones + [0] * zeros) * times
    if values.pop("no_gradient_accumulation_fusion", False):
        out["gradient_accumulation_fusion"] = False
    return values, out


def test_megatron_cores_transformer_config_accepts_every_exported_plan(tmp_path):
    from megatron.core.transformer import TransformerConfig

    fields = {f.name: f.type for f in dataclasses.fields(TransformerConfig)}
    for name, flags in PLANS.items():
        exported, plan = _flags(tmp_path, name, flags)
        values, config = _config_fields(exported)
        unknown = set(values) - set(fields) - TRAINING_FLAGS
        assert not unknown, (name, unknown)
        for key, value in values.items():
            if key in fields and key not in config:
                config[key] = _typed(value)
        TransformerConfig(**config)  # raises where Megatron-Core refuses the combination
        d = plan.mesh.dims
        assert (config["tensor_model_parallel_size"], config["pipeline_model_parallel_size"]) == (
            d.tp,
            d.pp,
        ), name
        assert config.get("context_parallel_size", 1) == d.cp, name
        assert config.get("expert_model_parallel_size", 1) == d.ep, name
        if "experts" in plan.request.model.config and d.tp > 1:  # as the plan splits them
            assert config["expert_tensor_parallel_size"] == (1 if d.folded else d.tp), name
        if plan.request.model.config.get("model_type") == "mixtral":  # every layer's MLP
            assert (config["num_moe_experts"], config["moe_router_topk"]) == (8, 2)
            assert config["moe_ffn_hidden_size"] == MIXTRAL_8X7B["intermediate_size"]
            assert "moe_expert_capacity_factor" not in config  # dropless, as the plan priced


def _typed(value):
    if value is True:
        return True
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def test_megatron_cores_check_is_real():
    """The same construction refuses what Megatron-Core refuses: heads tp does not divide."""
    from megatron.core.transformer import TransformerConfig

    with pytest.raises(ValueError, match="num_attention_heads"):
        TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=6, tensor_model_parallel_size=4
        )


def test_expert_groups_are_the_plans(tmp_path):
    """Megatron-Core's own rank generators (parallel_state.RankGenerator, the default order
    tp-cp-ep-dp-pp, its expert generator with cp 1) give the exported plan's groups: cp and
    ep neighbouring ranks of the plan's grid ranks[pp][dp x cp][tp] (planner.parallel_dims),
    cp innermost, ep over whole cp groups."""
    from megatron.core.parallel_state import RankGenerator

    _, plan = _flags(tmp_path, "mixtral cp2 ep8", PLANS["mixtral cp2 ep8"])
    d = plan.mesh.dims
    world, order = d.world, "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=d.tp, ep=1, dp=d.dp, pp=d.pp, cp=d.cp, order=order)
    experts = RankGenerator(tp=d.tp, ep=d.ep, dp=world // (d.ep * d.pp), pp=d.pp, cp=1, order=order)
    middle = d.dp * d.cp  # the grid's middle extent; tp is 1 here
    grid = [[p * middle + m for m in range(middle)] for p in range(d.pp)]
    cp_groups = [row[i : i + d.cp] for row in grid for i in range(0, middle, d.cp)]
    ep_groups = [row[i : i + d.ep] for row in grid for i in range(0, middle, d.ep)]
    assert (d.tp, d.cp, d.ep) == (1, 2, 8)
    assert sorted(dense.get_ranks("cp")) == sorted(cp_groups)
    assert sorted(experts.get_ranks("ep")) == sorted(ep_groups)


def test_folded_expert_groups_are_the_plans(tmp_path):
    """With expert tp 1 Megatron-Core's expert rank generator (expert tp 1, ep, expert dp,
    pp; order tp-ep-dp-pp) puts the tp ranks in the ep groups first: its groups are ep
    neighbouring ranks of the plan's grid ranks[pp][dp][tp], tp innermost, as the plan's
    executor draws them (executor.mesh)."""
    from megatron.core.parallel_state import RankGenerator

    _, plan = _flags(tmp_path, "mixtral tp2 ep8 etp1 SP", PLANS["mixtral tp2 ep8 etp1 SP"])
    d = plan.mesh.dims
    assert (d.tp, d.ep, d.folded) == (2, 8, True)
    experts = RankGenerator(
        tp=1, ep=d.ep, dp=d.world // (d.ep * d.pp), pp=d.pp, cp=1, order="tp-ep-dp-pp"
    )
    flat = [rank for grid in plan.mesh.ranks for row in grid for rank in row]
    ep_groups = [flat[i : i + d.ep] for i in range(0, len(flat), d.ep)]
    assert sorted(experts.get_ranks("ep")) == sorted(ep_groups)
    # and not the split layout's: ep neighbouring dp ranks of one tp index
    split = RankGenerator(
        tp=d.tp, ep=d.ep // d.tp, dp=d.world // d.ep, pp=d.pp, cp=1, order="tp-ep-dp-pp"
    )
    assert sorted(split.get_ranks("ep")) != sorted(ep_groups)
