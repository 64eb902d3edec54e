"""The search's pins are declared once (planner.pins): the CLI's `plan` and `size`, the
service's `search` body and autopar.plan take exactly those, and each surface passes a pin
through to the search the same way."""

import argparse
import inspect

import pytest

from api.cli.main import build_parser
from api.service.schemas import SearchInput
from autopar import api
from planner.pins import PIN_NAMES, PINS
from planner.request import search_options

SETTINGS = {"executable_only", "top_k", "baselines", "export_to"}  # non-pin search fields


def _subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _pin_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags = {opt for action in parser._actions for opt in action.option_strings}
    return {p.flag for p in PINS} & flags


@pytest.mark.parametrize("command", ["plan", "size"])
def test_the_cli_takes_every_pin(command):
    assert _pin_flags(_subcommand(command)) == {p.flag for p in PINS}


def test_the_service_and_the_python_api_take_exactly_the_pins():
    assert set(SearchInput.model_fields) - SETTINGS == set(PIN_NAMES)
    keywords = set(inspect.signature(api.plan).parameters)
    assert set(PIN_NAMES) <= keywords
    # what else autopar.plan takes is the model, cluster, training and search settings
    others = keywords - set(PIN_NAMES)
    assert others == {
        "model",
        "cluster",
        "nodes",
        "global_batch_size",
        "seq_len",
        "dtype",
        "optimizer",
        "runtime",
        "expert_imbalance",
        "config",
        "hf_config",
        "executable_only",
        "memory_headroom",
        "export_to",
    }


def test_a_pin_means_the_same_from_every_surface():
    """CLI spellings (2x1x2, on/off) become the request's values, which the service validates
    and the search options read alike."""
    args = _subcommand("plan").parse_args(
        [
            "--model", "gpt-350m", "--cluster", "cpu-local", "--global-batch", "8",
            "--mesh", "1x2x2", "--checkpointing", "partial", "--sequence-parallel", "on",
            "--cpu-offload", "off", "--zero", "3", "--cp", "2", "--fp8", "off",
        ]
    )  # fmt: skip
    cli = {p.name: p.from_cli(getattr(args, p.name)) for p in PINS}
    assert cli["mesh"] == [1, 2, 2] and cli["sequence_parallel"] is True
    assert cli["checkpointing"] == "partial" and cli["cpu_offload"] is False
    body = SearchInput(**{k: v for k, v in cli.items() if v is not None})
    assert body.model_dump(exclude_none=True, exclude=SETTINGS) == {
        k: v for k, v in cli.items() if v is not None
    }
    assert search_options(cli) == search_options(body.model_dump(exclude_none=True))
    assert search_options(cli).checkpointing == ("partial",)


def test_the_cli_the_service_and_the_python_api_plan_alike(tmp_path):
    """One request through `autopar plan`, the service's planning job and autopar.plan:
    the same plan (apart from the search's own counters: time, ILP solves the disk cache
    answered)."""
    import json

    from api.cli import main as cli_main
    from api.service.planning import plan_stored
    from planner.cluster.headroom import with_headroom
    from planner.cluster.profile import load_cluster

    config = {"layers": 4, "hidden": 64, "heads": 4, "vocab": 128}
    pins = {"zero": 3, "checkpointing": "selective"}
    path = tmp_path / "plan.json"
    args = ["plan", "--model", "gpt-350m", "--config", *(f"{k}={v}" for k, v in config.items())]
    args += ["--cluster", "cpu-local", "--global-batch", "8", "--seq", "16", "--dtype", "fp32"]
    args += ["--no-baselines", "--zero", "3", "--checkpointing", "selective", "-o", str(path)]
    assert cli_main(args) == 0
    profile = with_headroom(load_cluster("cpu-local"), None).model_dump(mode="json")
    request = {
        "model": {"name": "gpt-350m", "config": config},
        "training": {"global_batch_size": 8, "seq_len": 16, "dtype": "fp32"},
        "search": {"baselines": False, **pins},
    }
    service, _ = plan_stored(request, profile, lambda *_: None)
    python = api.plan(
        "gpt-350m",
        cluster="cpu-local",
        config=config,
        global_batch_size=8,
        seq_len=16,
        dtype="fp32",
        tp_layout=None,  # the API's default is Megatron's layout, for parallelize()
        **pins,
    )

    def same(text: str) -> dict:
        plan = json.loads(text)
        plan.pop("search")
        return plan

    cli = same(path.read_text())
    assert cli == same(service) == same(python.to_json())
    assert cli["stages"][0]["zero"] == 3


@pytest.mark.parametrize(
    ("pin", "value"),
    [
        ("mesh", "1x64"),
        ("mesh", [1, 2, "x"]),
        ("mesh", (1, 0, 2)),
        ("ep", "8"),
        ("ep", True),
        ("microbatch_size", 0),
        ("zero", True),
        ("zero", "3"),
        ("fp8", "e4m3"),
        ("sequence_parallel", "on"),
    ],
)
def test_autopar_plan_names_a_bad_pin_before_searching(pin, value):
    """autopar.plan's keywords are not checked by the service's schema: each pin's own
    declaration checks them (a string mesh reached the search and raised a TypeError there)."""
    from planner.errors import InputError

    with pytest.raises(InputError) as err:
        api.plan("gpt-350m", cluster="cpu-local", global_batch_size=8, **{pin: value})
    assert err.value.field == f"search.{pin}"


def test_a_mesh_pin_may_be_spelled_as_the_cli_spells_it():
    assert search_options({"mesh": "1x2X2"}) == search_options({"mesh": [1, 2, 2]})
    assert search_options({"mesh": (1, 2, 2)}) == search_options({"mesh": [1, 2, 2]})
