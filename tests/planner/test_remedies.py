"""What to change when a configuration does not fit (planner/evaluate/remedies.py): every
change `autopar estimate` lists fits when run as it says, and the one that does not fit
lists nothing that does not."""

import json

from api.cli.main import main

# GPT-1.3B with Adam in fp16 on 8 V100 16 GB under plain data parallelism: 16 B of state
# per parameter (about 21 GiB per device) cannot fit without sharding it.
BASE = [
    "estimate", "--model", "gpt-1.3b", "--cluster", "aws-p3.16xlarge", "--nodes", "1",
    "--global-batch", "64", "--dtype", "fp16", "--json",
]  # fmt: skip


def _estimate(capsys, *flags: str) -> dict:
    assert main([*BASE, *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_each_listed_change_fits_when_applied(capsys):
    plan = _estimate(capsys, "--dp", "8", "--microbatches", "2")
    assert not plan["predicted"]["fits_in_memory"]
    listed = [line for line in plan["explanation"] if line.startswith("To fit: ")]
    assert any("ZeRO-3 (--zero 3)" in line for line in listed), plan["explanation"]
    fixed = _estimate(capsys, "--dp", "8", "--microbatches", "2", "--zero", "3")
    assert fixed["predicted"]["fits_in_memory"]
    said = next(line for line in listed if "ZeRO-3" in line)
    assert f"{fixed['predicted']['step_time_s']:.3f} s per step" in said
    # a configuration that fits gets no advice
    assert not any(line.startswith("To fit") for line in fixed["explanation"])


def test_activations_too_large_suggest_checkpointing_or_smaller_micro_batches(capsys):
    # ZeRO-3 leaves ~2.6 GiB of state per device; 64 samples of 2,048 tokens in one
    # micro-batch per device keep far more activations than the rest of 15 GiB
    plan = _estimate(capsys, "--dp", "8", "--zero", "3", "--seq", "2048")
    assert not plan["predicted"]["fits_in_memory"]
    listed = [line for line in plan["explanation"] if line.startswith("To fit: ")]
    assert listed, plan["explanation"]
    assert any("--checkpointing" in line or "--microbatches" in line for line in listed)
    same = ("--dp", "8", "--zero", "3", "--seq", "2048")
    for line in listed:
        if "full checkpointing" in line:
            assert _estimate(capsys, *same, "--checkpointing")["predicted"]["fits_in_memory"]
        if line.startswith("To fit: micro-batch "):
            count = line.split("--microbatches ")[1].split(")")[0]
            fixed = _estimate(capsys, *same, "--microbatches", count)
            assert fixed["predicted"]["fits_in_memory"]


def test_a_search_that_finds_nothing_names_the_pins_or_the_headroom_to_change():
    from planner.cluster.headroom import with_headroom
    from planner.cluster.profile import load_cluster
    from planner.request import resolve_request
    from planner.search.search import NoFeasiblePlan, search
    from planner.search.space import SearchOptions, pinned_options

    cluster = load_cluster("aws-p3.16xlarge").with_nodes(1)
    training = {"global_batch_size": 64, "seq_len": 1024, "dtype": "fp16"}
    inputs = resolve_request({"name": "gpt-1.3b"}, cluster, training).trace()
    pins = pinned_options(mesh=(1, 8, 1), zero=0, checkpointing=False)
    options = SearchOptions(layouts=("megatron",), **pins)
    try:
        search(inputs, options)
        raise AssertionError("plain data parallelism of GPT-1.3B fitted in 16 GiB")
    except NoFeasiblePlan as err:
        said = " ".join(err.explanation)
    assert "mesh 1x8x1, ZeRO 0, checkpointing off" in said and "unpin them" in said
    assert search(inputs, SearchOptions(layouts=("megatron",))).plan.predicted.fits_in_memory
    # kept free, most of the device leaves nothing that fits; the explanation says so
    roomy = with_headroom(cluster, "0.85")
    tight = resolve_request({"name": "gpt-1.3b"}, roomy, training).trace()
    try:
        search(tight, SearchOptions(layouts=("megatron",), offload=False))
        raise AssertionError("GPT-1.3B fitted in 2.4 GiB per device")
    except NoFeasiblePlan as err:
        said = " ".join(err.explanation)
    assert "kept free as headroom (--memory-headroom 0" in said, said
