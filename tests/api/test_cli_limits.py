"""The CLI refuses absurd and nonsensical input at once, naming the flag or field (issue 12):
no hang, no "internal error", nothing launched for a hand-edited plan."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from api.cli import main
from planner.cluster.profile import load_cluster

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model", "gpt-350m", "--config", "layers=4", "hidden=128", "heads=4", "vocab=512"]


def plan_args(model=tuple(TINY), cluster="cpu-local", batch="8", seq="64", extra=()) -> list[str]:
    return ["plan", *model, "--cluster", cluster, "--global-batch", batch, "--seq", seq, *extra]


PLAN = plan_args()


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own usage errors
        code = stop.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (
            [
                "plan",
                *TINY,
                "--cluster",
                "cpu-local",
                "--nodes",
                "1000000000",
                "--global-batch",
                "8",
            ],
            "--nodes",
        ),
        ([*PLAN[:-4], "--global-batch", "9223372036854775808"], "--global-batch"),
        ([*PLAN[:-2], "--seq", "1000000000"], "--seq"),
        ([*PLAN[:-2], "--seq", "0"], "--seq"),
        ([*PLAN, "--top-k", "-1"], "--top-k"),
        ([*PLAN, "--workers", "0"], "--workers"),
        ([*PLAN, "--time-limit", "-5"], "--time-limit"),
        ([*PLAN, "--time-limit", "nan"], "--time-limit"),
        (
            plan_args(model=["--model", "gpt-350m", "--config", "layers=1000000000"]),
            "model.config.layers",
        ),
        (["shard", *TINY, "--cluster", "cpu-local", "--mesh", "1x4", "--batch", "0"], "--batch"),
        (
            ["shard", *TINY, "--cluster", "cpu-local", "--mesh", "1x4", "--microbatches", "0"],
            "--microbatches",
        ),
        (["execute", "plan.json", "--steps", "0"], "--steps"),
        (["execute", "plan.json", "--steps", "-3"], "--steps"),
        (["execute", "plan.json", "--nproc-per-node", "0"], "--nproc-per-node"),
        (["execute", "plan.json", "--timeout", "-5"], "--timeout"),
    ],
)
def test_absurd_flags_are_refused_naming_them(capsys, argv, named):
    code, err = _run(capsys, argv)
    assert code == 2, err
    assert named in err and "internal error" not in err


def test_absurd_profiles_and_graphs_are_refused(capsys, tmp_path):
    profile = load_cluster("cpu-local").model_dump(mode="json")
    for key, value in (("nodes", 10**12), ("memory_bandwidth", float("inf"))):
        bad = json.loads(json.dumps(profile))
        (bad["device"] if key == "memory_bandwidth" else bad)[key] = value
        path = tmp_path / f"{key}.yaml"
        path.write_text(yaml.safe_dump(bad))
        code, err = _run(capsys, plan_args(cluster=str(path)))
        assert code == 2 and key in err, err
    node = {"name": "n", "op": "aten.mm.default", "kind": "linear", "layer": 10**12}
    graph = {"schema_version": "1", "batch": 1, "seq": 8, "dtype": "fp32", "nodes": [node]}
    path = tmp_path / "graph.json"
    path.write_text(json.dumps({**graph, "edges": []}))
    code, err = _run(capsys, plan_args(model=["--graph", str(path)]))
    assert code == 2 and "layer" in err, err


@pytest.fixture(scope="module")
def plan_doc(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    flags = ["--dtype", "fp32", "--no-baselines", "--executable-only", "-o", str(out)]
    assert main([*PLAN, *flags]) == 0
    return json.loads(out.read_text())


def _set(doc: dict, path: str, value) -> None:
    keys = path.split(".")
    node = doc
    for key in keys[:-1]:
        node = node[int(key)] if key.isdigit() else node[key]
    node[keys[-1]] = value


def _first_rank_99(doc: dict) -> None:
    doc["mesh"]["ranks"][0][0][0] = 99


def _wider_mesh(doc: dict) -> None:
    doc["mesh"]["shape"][1] += 1


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (_wider_mesh, "mesh.shape: [1, 5, 1] disagrees with mesh.ranks"),
        (lambda d: _set(d, "stages.0.zero", 5), "stages.0.zero: Input should be 0, 1, 2 or 3"),
        (_first_rank_99, "mesh.ranks"),
        (lambda d: _set(d, "schedule.microbatches", 10**9), "schedule.microbatches"),
        (lambda d: _set(d, "stages.0.layers", [0, 3]), "stages"),
        (lambda d: _set(d, "stages.0.shardings.0.outputs", [["S(99)", "R"]]), "outputs[0]"),
        (lambda d: _set(d, "request.model.name", "gpt\necho pwned"), "request.model.name"),
    ],
)
def test_a_hand_edited_plan_fails_before_anything_starts(capsys, tmp_path, plan_doc, edit, named):
    doc = json.loads(json.dumps(plan_doc))
    edit(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    out = tmp_path / "run"
    code, err = _run(capsys, ["execute", str(bad), "--out", str(out)])
    assert code == 2 and named in err, err
    assert not out.exists() or not any(out.iterdir())  # nothing was launched
    left = subprocess.run(["pgrep", "-f", str(bad)], capture_output=True, text=True)
    assert left.stdout.strip() == ""
