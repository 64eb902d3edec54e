"""examples/train_hf_llama.py: autopar.plan + autopar.parallelize in a user's own loop, on 4
gloo processes under torchrun, from weights saved by transformers, gives the losses of the
same loop on one process without autopar."""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_hf_llama.py"


def _run(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _example():
    """The script as a module (its plan and single-process steps run in this process)."""
    spec = importlib.util.spec_from_file_location("train_hf_llama", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.distributed
@pytest.mark.slow
def test_example_fine_tunes_saved_weights_with_its_own_loss_like_the_single_process_loop(
    tmp_path,
):
    """The plan (pp 2 x dp 2, FSDP2 shards) applied to a model built on the meta device
    (each rank allocating only its own stages), then the saved weights loaded (each rank
    reading its stages' tensors and keeping its shards),
    trained with the script's own loss (label smoothing, `parallelize(loss_fn=)`) on padded
    batches (rows of 1-32 real tokens, right-padded, with their attention mask): the losses
    are those of transformers' from_pretrained in a plain loop with that loss and the mask,
    not the seed's, nor the default loss's, nor those of unpadded rows. (Each micro-batch's
    mean is weighted by its real labels: unweighted, the losses were 5.5557, 5.6308, 5.5442
    against 5.5463, 5.5762, 5.5661.)"""
    example = _example()
    example.make_plan(argparse.Namespace(out=str(tmp_path / "plan.json"), mesh="2x2x1"))
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh"]["shape"] == [2, 2, 1] and plan["request"]["model"]["family"] == "hf"
    example.save_weights(str(tmp_path / "weights"))
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    train = [str(SCRIPT), "train", "plan.json", "--steps", "3", "--weights", "weights"]
    flags = ["--label-smoothing", "0.1", "--pad", "--meta", "--losses", "a.json"]
    out = _run([*torchrun, *train, *flags], tmp_path)
    held, total = (
        int(n.replace(",", "")) for n in re.findall(r"([\d,]+) of the model's ([\d,]+)", out)[0]
    )
    assert held < 0.7 * total  # its stages' (a V schedule's two chunks), not the whole model
    parallel = json.loads((tmp_path / "a.json").read_text())
    weights = str(tmp_path / "weights")
    assert parallel == pytest.approx(example.train_single(3, weights, 0.1, True), rel=1e-5)
    assert parallel[0] != pytest.approx(example.train_single(1, None, 0.1, True)[0], rel=1e-5)
    # (near the uniform start smoothing barely moves the first loss; later steps' it does)
    assert parallel != pytest.approx(example.train_single(3, weights, 0.0, True), rel=1e-5)
    assert parallel != pytest.approx(example.train_single(3, weights, 0.1, False), rel=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mesh, sequence_parallel", [("2x1x2", True), ("1x2x2", False)])
def test_example_trains_packed_documents_like_the_single_process_loop(
    tmp_path, mesh, sequence_parallel
):
    """Several documents per row, their position_ids counting from 0 in each; each stage
    passes the positions to transformers, whose masks keep attention within each document:
    under pp 2 x tp 2 with sequence parallelism (a V schedule: two stages per rank) masks
    built for the whole sequence though each rank's norms hold half of it; under dp 2 x tp 2
    the model's own, made without a key/value cache (with one, transformers does not mask
    by documents). The losses are the plain loop's on the same packed rows, not those of
    attention across documents."""
    import torch

    example = _example()
    args = argparse.Namespace(
        out=str(tmp_path / "plan.json"), mesh=mesh, sequence_parallel=sequence_parallel
    )
    example.make_plan(args)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert "x".join(map(str, plan["mesh"]["shape"])) == mesh
    assert plan["sequence_parallel"] == sequence_parallel
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    train = [str(SCRIPT), "train", "plan.json", "--steps", "3", "--packed", "--losses", "a.json"]
    _run([*torchrun, *train], tmp_path)
    parallel = json.loads((tmp_path / "a.json").read_text())
    assert parallel == pytest.approx(example.train_single(3, packed=True), rel=1e-5)
    model = example.build_model()
    tokens, labels, positions = example.packed_batch(0)
    with torch.no_grad():  # positions reset per document, attention across them (a cache)
        across = example.loss_of(model(tokens, position_ids=positions).logits, labels)
    assert parallel[0] != pytest.approx(float(across), rel=1e-5)


def test_packed_documents_positions_are_checked_and_need_a_transformers_model():
    """position_ids must count from 0 in each document, have the tokens' shape, and go to
    a Hugging Face model on its modules without context parallelism; each refusal names
    the field."""
    from types import SimpleNamespace

    import torch

    from autopar.api import Parallelized, _check_positions

    tokens = torch.zeros(2, 5, dtype=torch.long)
    _check_positions(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]), tokens.shape, "p")
    for bad, why in (
        (torch.tensor([[1, 2, 3, 0, 1], [0, 1, 2, 3, 4]]), "start each document at 0"),
        (torch.tensor([[0, 1, 3, 0, 1], [0, 1, 2, 3, 4]]), "count 0, 1, 2"),
        (torch.zeros(2, 4, dtype=torch.long), r"shape \(2, 4\)"),
        (torch.zeros(2, 5), "integer tensor"),
    ):
        with pytest.raises(ValueError, match=why):
            _check_positions(bad, tokens.shape, "position_ids")

    def parallel(family: str, cp: int, graph: bool = False) -> Parallelized:
        model = SimpleNamespace(family=family)
        plan = SimpleNamespace(request=SimpleNamespace(model=model), mesh=SimpleNamespace(cp=cp))
        return Parallelized(plan, SimpleNamespace(global_inputs=graph), mesh=None)

    parallel("hf", 1)._check_packing()
    with pytest.raises(ValueError, match=r"position_ids: .* this plan runs a llama model"):
        parallel("llama", 1)._check_packing()
    with pytest.raises(ValueError, match=r"position_ids: .* this plan runs graph mode"):
        parallel("hf", 1, graph=True)._check_packing()
    with pytest.raises(ValueError, match=r"position_ids: .* context parallelism"):
        parallel("hf", 2)._check_packing()


def test_padding_must_be_on_the_right_and_is_left_out_of_the_labels():
    """A padded token's label is ignored; a mask with a real token after padding (left
    padding, packed documents) or of another shape is refused by name."""
    import torch

    from autopar.api import padded_labels

    labels = torch.tensor([[5, 6, 7], [8, 9, 10]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert padded_labels(labels, mask).tolist() == [[5, 6, -100], [8, -100, -100]]
    with pytest.raises(ValueError, match="attention_mask: row 1 has a real token after padding"):
        padded_labels(labels, torch.tensor([[1, 1, 1], [0, 1, 1]]))
    with pytest.raises(ValueError, match=r"attention_mask: shape \(2, 2\)"):
        padded_labels(labels, torch.ones(2, 2))
    with pytest.raises(ValueError, match="1 for a real token and 0 for padding"):
        padded_labels(labels, torch.full((2, 3), 2))


def test_weights_without_the_models_names_are_refused_naming_them(tmp_path):
    """A checkpoint that lacks a tensor of the rank's stages (another model's, or names
    with another prefix) is refused before anything is loaded, naming the missing one."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file

    from autopar.api import Parallelized

    stage = torch.nn.Sequential(torch.nn.Linear(2, 2))
    plan = SimpleNamespace(request=SimpleNamespace(model=SimpleNamespace(config={})))
    parallel = Parallelized(plan, SimpleNamespace(stages=[(0, stage)]), mesh=None)
    save_file({"encoder.0.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no tensor for 0\.bias, 0\.weight"):
        parallel.load_state_dict(tmp_path)
    with pytest.raises(ValueError, match="no safetensors checkpoint"):
        parallel.load_state_dict(tmp_path / "missing")


def test_a_loss_of_ones_own_is_refused_where_the_plan_shards_the_vocabulary(tmp_path):
    """Under a vocab-parallel head the logits are vocabulary shards and the plan's cross
    entropy runs under torch's loss_parallel: another loss is refused by name, before any
    process group is needed."""
    import autopar

    example = _example()
    example.make_plan(argparse.Namespace(out=str(tmp_path / "plan.json"), mesh="2x1x2"))
    with pytest.raises(ValueError, match="loss_fn: this plan computes the loss on vocab"):
        autopar.parallelize(example.build_model(), tmp_path / "plan.json", loss_fn=example.loss_of)


def test_a_model_on_the_meta_device_needs_its_weights_and_transformers_buffers():
    """A model built on the meta device has no values: its first step before load_state_dict
    is refused by name; a zoo model (no initializer for its buffers) is refused on meta."""
    from types import SimpleNamespace

    import torch

    from autopar.api import Parallelized
    from executor.errors import ExecutionError
    from executor.parallelize import built_on_meta
    from planner.models import ModelSpec, resolve

    parallel = Parallelized(SimpleNamespace(), SimpleNamespace(), None, awaiting_weights=True)
    with pytest.raises(ValueError, match=r"model: built on the meta device.*load_state_dict"):
        parallel.step(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))
    spec = ModelSpec(name="gpt-350m", config={"layers": 1, "hidden": 8, "heads": 2, "vocab": 16})
    zoo = resolve(spec).build(device="meta")
    with pytest.raises(ExecutionError, match="model: a gpt model built on the meta device"):
        built_on_meta(zoo, "gpt")


def test_expert_weights_load_as_the_ep_rank_holds_them():
    """Under expert parallelism a full expert weight from a checkpoint becomes this ep rank's
    consecutive experts (executor.expert_parallel keeps those), other weights stay whole.
    (Run under torchrun by hand: a Mixtral with dp 4 and ep 2, loaded from a state dict,
    gives the single-process losses, 5.543059 5.565385 5.562225.)"""
    from types import SimpleNamespace

    import torch

    from autopar.api import Parallelized

    experts = torch.nn.Module()
    experts.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 3, 4))
    stage = torch.nn.ModuleDict({"experts": experts, "gate": torch.nn.Linear(4, 4)})
    plan = SimpleNamespace(mesh=SimpleNamespace(ep=2))
    mesh = {"ep": SimpleNamespace(get_local_rank=lambda: 1)}
    parallel = Parallelized(plan, SimpleNamespace(experts=[experts]), mesh)
    full = torch.arange(4 * 3 * 4.0).view(4, 3, 4)
    state = {"experts.gate_up_proj": full, "gate.weight": torch.ones(4, 4)}
    own = parallel._own_experts(stage, state)
    assert list(own) == ["experts.gate_up_proj"]
    assert torch.equal(own["experts.gate_up_proj"], full[2:4])


def test_expert_weights_load_as_the_tp_rank_holds_their_features():
    """Under expert tensor parallelism a full expert weight becomes this tp rank's features:
    of gate_up_proj [E, 2F, H] the rank's rows of the gate half and of the up half, of
    down_proj [E, H, F] its columns (F = 4 here: tp rank 1 of 2 keeps features 2 and 3)."""
    from types import SimpleNamespace

    import torch

    from autopar.api import Parallelized

    experts = torch.nn.Module()
    experts.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 4, 3))
    experts.down_proj = torch.nn.Parameter(torch.zeros(2, 3, 2))
    stage = torch.nn.ModuleDict({"experts": experts})
    plan = SimpleNamespace(mesh=SimpleNamespace(ep=None))
    mesh = {"tp": SimpleNamespace(size=lambda: 2, get_local_rank=lambda: 1)}
    parallel = Parallelized(plan, SimpleNamespace(experts=[], split_experts=[experts]), mesh)
    gate_up = torch.arange(2 * 8 * 3.0).view(2, 8, 3)  # rows 0-3 the gate, 4-7 the up half
    down = torch.arange(2 * 3 * 4.0).view(2, 3, 4)
    state = {"experts.gate_up_proj": gate_up, "experts.down_proj": down}
    own = parallel._own_experts(stage, state)
    assert torch.equal(own["experts.gate_up_proj"], gate_up[:, [2, 3, 6, 7]])
    assert torch.equal(own["experts.down_proj"], down[:, :, 2:4])


@pytest.mark.distributed
@pytest.mark.slow
def test_a_users_loop_trains_an_expert_tp_1_plan_like_one_process(tmp_path):
    """autopar.parallelize on a Mixtral plan with expert tp 1 (every expert whole, ep 4 over
    the dp 2 x tp 2 ranks, each MoE block on its tp rank's sequence shard, ZeRO-3), in a
    user's own loop under torchrun: the losses of the same loop on one process (measured
    4.866263, 4.873172, 4.866860 both ways)."""
    script = str(ROOT / "tests" / "executor" / "moe_loop.py")
    _run([script, "plan", "plan.json"], tmp_path)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert (plan["mesh"]["ep"], plan["mesh"]["etp"]) == (4, 1)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    _run([*torchrun, script, "train", "plan.json", "parallel.json"], tmp_path)
    _run([script, "single", "single.json"], tmp_path)
    parallel = json.loads((tmp_path / "parallel.json").read_text())
    single = json.loads((tmp_path / "single.json").read_text())
    assert parallel == pytest.approx(single, rel=1e-5)
