"""Modelled, executed and tested go together: every technique (planner/parallel/*.py) is one
declaration, `TECHNIQUE`, found by planner.parallel.registry, holding its pins, its time,
memory and ledger terms, its rows of the executor's capability table and its choices: every
value its dimension can take names the executor function that applies it and the equivalence
test that checks it against the single-process reference, or says why it is not executable.
This fails when a dimension gains a value with neither, when a named function or test does not
exist, or when a technique module declares nothing or is missing from the registry. (Sharding
strategies: every one the rules offer has its own case in tests/executor/test_strategies.py,
which fails when a strategy has none.)"""

import importlib
import pkgutil
from pathlib import Path
from typing import get_args

import pytest

import planner.parallel
from planner.executable import GRAPH_MODE_REFUSALS, RUNS
from planner.parallel.choice import Choice
from planner.parallel.registry import stage_fields, stores, techniques
from planner.parallel.technique import Technique
from planner.pins import PIN_NAMES, TECHNIQUE_PINS
from planner.search.space import SearchOptions
from planner.vocab import SCHEDULES, ZERO_LEVELS, CheckpointPolicyName, TpLayoutName

ROOT = Path(__file__).resolve().parent.parent


# planner/parallel's modules that are not techniques: the declaration types and the registry
NOT_TECHNIQUES = {"choice", "technique", "registry"}


def _modules():
    for info in pkgutil.iter_modules(planner.parallel.__path__):
        if info.name not in NOT_TECHNIQUES:
            yield importlib.import_module(f"planner.parallel.{info.name}")


def _choices() -> list[Choice]:
    return [c for t in techniques() for c in t.choices]


def _callable(path: str) -> bool:
    module, _, name = path.partition(":")
    return callable(getattr(importlib.import_module(module), name, None))


def _incomplete(technique: Technique) -> list[str]:
    """What a declaration lacks: choices, terms that exist, executor functions and tests."""
    missing = []
    if not technique.choices:
        missing.append("choices")
    if not technique.terms or not all(_callable(t) for t in technique.terms):
        missing.append("terms")
    for c in technique.choices:
        if c.not_executable is None and not _callable(c.executor):
            missing.append(f"executor {c.executor}")
        if c.not_executable is None and c.test not in _test_ids(c.test):
            missing.append(f"test {c.test}")
    for row in technique.capabilities:
        if "graph" not in row.paths and not row.graph_refusal:
            missing.append(f"why graph mode refuses {row.key}")
    if (store := technique.store) is not None:  # what the search, plan and executor call
        if store.stage_field not in technique.stage_fields:
            missing.append(f"stage field {store.stage_field}")
        if store.capability not in {row.key for row in technique.capabilities}:
            missing.append(f"capability {store.capability}")
        if not any(v.pin == "checkpointing" and store.mode in v.choices for v in technique.extends):
            missing.append(f"checkpointing value {store.mode}")
        if not _callable(store.apply):
            missing.append(f"executor {store.apply}")
    return missing


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


def test_every_technique_module_is_one_complete_declaration_in_the_registry():
    modules = list(_modules())
    assert {"planner.parallel.data", "planner.parallel.pipeline"} <= {m.__name__ for m in modules}
    assert [m.TECHNIQUE for m in modules if hasattr(m, "TECHNIQUE")] == [
        m.TECHNIQUE for m in modules
    ]
    assert [m.TECHNIQUE for m in modules] == sorted(techniques(), key=lambda t: t.name)
    assert len(techniques()) == len({t.name for t in techniques()})
    assert len({t.order for t in techniques()}) == len(techniques())  # one apply order
    for technique in techniques():
        assert _incomplete(technique) == [], technique.name


def test_a_declaration_missing_a_part_is_found():
    from dataclasses import replace

    offload = next(t for t in techniques() if t.name == "offload")
    assert _incomplete(replace(offload, terms=())) == ["terms"]
    assert _incomplete(replace(offload, choices=())) == ["choices"]
    moved = (
        Choice(
            "stages[].cpu_offload",
            True,
            "executor.data:nowhere",
            "tests/test_invariants.py::nothing[y]",
        ),
    )
    assert len(_incomplete(replace(offload, choices=moved))) == 2
    row = replace(offload.capabilities[0], graph_refusal=None)
    assert _incomplete(replace(offload, capabilities=(row,))) == [
        "why graph mode refuses cpu_offload"
    ]


def test_the_capability_table_and_the_pins_are_the_declarations():
    rows = [row for t in techniques() for row in t.capabilities]
    assert len(rows) == len({row.key for row in rows})
    assert {row.key: row.paths for row in rows} == RUNS
    assert set(GRAPH_MODE_REFUSALS) == {k for k, paths in RUNS.items() if "graph" not in paths}
    declared = [pin.name for t in techniques() for pin in t.pins]
    assert len(set(declared)) == len(declared)
    assert list(TECHNIQUE_PINS) == [t.name for t in techniques()]
    for t in techniques():  # a pin takes its own values and those other techniques add
        assert [p.name for p in TECHNIQUE_PINS[t.name]] == [p.name for p in t.pins]
        for pin, own in zip(TECHNIQUE_PINS[t.name], t.pins, strict=True):
            added = [
                c for u in techniques() for v in u.extends if v.pin == pin.name for c in v.choices
            ]
            assert pin.choices == own.choices + tuple(added)
    assert set(PIN_NAMES) == {"mesh", "microbatch_size", *declared}


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
    # activations stored off the device instead (each store's own stage field)
    for store in stores().values():
        assert by_dim[f"stages[].{store.stage_field}"] == {False, True}
        assert store.stage_field in stage_fields()
    assert set(options.checkpointing) == {False, True} | by_dim["stages[].checkpoint_policy"] - {
        "full"
    } | by_dim["stages[].checkpointed_layers"] | set(stores())
    assert by_dim["sequence_parallel"] == {False, True}
    assert by_dim["mesh.cp"] == {1, "2 or more"}
    assert by_dim["stages[].cpu_offload"] == {False, True}
    assert by_dim["stages[].resharded_layers"] == {"layer-wise"}
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
