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

SETTINGS = {"executable_only", "top_k", "baselines"}  # the service's non-pin search fields


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
        "config",
        "hf_config",
        "executable_only",
        "memory_headroom",
    }


def test_a_pin_means_the_same_from_every_surface():
    """CLI spellings (2x1x2, on/off) become the request's values, which the service validates
    and the search options read alike."""
    args = _subcommand("plan").parse_args(
        [
            "--model", "gpt-350m", "--cluster", "cpu-local", "--global-batch", "8",
            "--mesh", "1x2x2", "--checkpointing", "offload", "--sequence-parallel", "on",
            "--cpu-offload", "off", "--zero", "3", "--cp", "2", "--fp8", "off",
        ]
    )  # fmt: skip
    cli = {p.name: p.from_cli(getattr(args, p.name)) for p in PINS}
    assert cli["mesh"] == [1, 2, 2] and cli["sequence_parallel"] is True
    assert cli["checkpointing"] == "offload" and cli["cpu_offload"] is False
    body = SearchInput(**{k: v for k, v in cli.items() if v is not None})
    assert body.model_dump(exclude_none=True, exclude=SETTINGS) == {
        k: v for k, v in cli.items() if v is not None
    }
    assert search_options(cli) == search_options(body.model_dump(exclude_none=True))
    assert search_options(cli).checkpointing == ("offload",)
