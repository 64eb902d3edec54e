"""Modelled, executed and tested go together: every value a parallelism dimension can take
(planner/parallel/*.py `CHOICES`) names the executor function that applies it and the
equivalence test that checks it against the single-process reference, or says why it is not
executable. This fails when a dimension gains a value with neither, when a named function or
test does not exist, or when a parallel module has no CHOICES. (Sharding strategies: every
one the rules offer has its own case in tests/executor/test_strategies.py, which fails when a
strategy has none.)"""

import importlib
import pkgutil
from pathlib import Path
from typing import get_args

import pytest

import planner.parallel
from planner.parallel.choice import Choice
from planner.search.space import SearchOptions
from planner.vocab import SCHEDULES, ZERO_LEVELS, CheckpointPolicyName, TpLayoutName

ROOT = Path(__file__).resolve().parent.parent


def _modules():
    for info in pkgutil.iter_modules(planner.parallel.__path__):
        if info.name != "choice":
            yield importlib.import_module(f"planner.parallel.{info.name}")


def _choices() -> list[Choice]:
    return [c for m in _modules() for c in m.CHOICES]


def _test_ids(node_id: str) -> set[str]:
    """The ids pytest gives the parametrized test `node_id` names (file::function[...]), read
    from the test function's own parametrize marks (ids: the values, tuples joined by '-')."""
    path, _, rest = node_id.partition("::")
    name = rest.partition("[")[0]
    module = importlib.import_module(".".join(Path(path).with_suffix("").parts))
    function = getattr(module, name, None)
    if function is None or not (ROOT / path).exists():
        return set()
    ids = set()
    for mark in getattr(function, "pytestmark", []):
        if mark.name == "parametrize":
            for value in mark.args[1]:
                parts = value if isinstance(value, tuple) else (value,)
                ids.add(f"{path}::{name}[{'-'.join(str(p) for p in parts)}]")
    return ids


def test_every_parallel_module_declares_its_choices():
    names = {m.__name__ for m in _modules()}
    assert {"planner.parallel.data", "planner.parallel.pipeline"} <= names
    for module in _modules():
        assert isinstance(getattr(module, "CHOICES", None), tuple), module.__name__
        assert module.CHOICES and all(isinstance(c, Choice) for c in module.CHOICES)


def test_the_choices_cover_every_value_the_search_and_the_plan_can_hold():
    by_dim: dict[str, set] = {}
    for c in _choices():
        by_dim.setdefault(c.dimension, set()).add(c.value)
    options = SearchOptions()
    assert by_dim["stages[].zero"] == set(ZERO_LEVELS) >= set(options.zero_stages)
    assert by_dim["schedule.name"] == set(SCHEDULES) >= set(options.schedules)
    assert by_dim["stages[].activation_checkpointing"] == {False, True}
    assert by_dim["stages[].checkpoint_policy"] == set(get_args(CheckpointPolicyName))
    # the search's values: off, or on with one of the policies, or on some layers, or the
    # activations offloaded instead
    assert by_dim["stages[].activation_offload"] == {False, True}
    assert set(options.checkpointing) == {False, True} | by_dim["stages[].checkpoint_policy"] - {
        "full"
    } | by_dim["stages[].checkpointed_layers"] | {"offload"}
    assert by_dim["sequence_parallel"] == {False, True}
    assert by_dim["mesh.cp"] == {1, "2 or more"}
    assert by_dim["stages[].cpu_offload"] == {False, True}
    assert by_dim["tp_layout"] == set(get_args(TpLayoutName))
    assert by_dim["schedule.virtual_stages"] == {1, 2, "3 or more"}


@pytest.mark.parametrize("choice", _choices(), ids=lambda c: f"{c.dimension}={c.value}")
def test_each_choice_has_an_executor_path_and_an_equivalence_test(choice):
    if choice.not_executable:
        assert choice.executor is None and len(choice.not_executable) > 20
        return
    module, _, name = choice.executor.partition(":")
    assert callable(getattr(importlib.import_module(module), name, None)), choice.executor
    assert choice.test in _test_ids(choice.test), f"{choice.test} is not a test case"


def test_a_choice_without_executor_or_reason_is_refused():
    with pytest.raises(ValueError, match="needs executor and test"):
        Choice("schedule.name", "zero_bubble", executor="executor.pipeline:build_schedule")
