import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from api.cli import main
from planner.graph.opgraph import OpGraph
from planner.plan import Plan

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--config", "layers=4", "hidden=256", "heads=4"]


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as stop:  # argparse's usage errors (exit 2, naming the flag)
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def test_models_and_clusters_json(capsys):
    code, out, _ = run(capsys, "models", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0 and rows["gpt-1.3b"]["params"] == 1_315_557_376
    code, out, _ = run(capsys, "clusters", "--json")
    names = {c["name"] for c in json.loads(out)}
    assert {"aws-p3.16xlarge", "dgx-a100-80g", "dgx-h100", "h200", "cpu-local"} <= names
    code, out, _ = run(capsys, "clusters")
    assert "dgx-a100-80g" in out and "GB/s" in out


def test_estimate_prints_a_table_and_json(capsys, tmp_path):
    args = [
        "estimate",
        "--model",
        "gpt-350m",
        *SMALL,
        "--cluster",
        "dgx-a100-80g",
        "--dp",
        "2",
        "--tp",
        "2",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--global-batch",
        "32",
        "--seq",
        "128",
    ]
    code, out, _ = run(capsys, *args)
    assert code == 0
    assert "step time" in out and "pp=2 dp=2 tp=2" in out and "stage" in out
    code, out, _ = run(capsys, *args, "--json", "-o", str(tmp_path / "plan.json"))
    plan = Plan.model_validate_json(out)
    assert plan.mesh.shape == [2, 2, 2] and plan.schedule.microbatches == 4
    assert Plan.from_json((tmp_path / "plan.json").read_text()) == plan


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [
                "estimate",
                "--model",
                "gpt-9000",
                "--cluster",
                "dgx-a100-80g",
                "--dp",
                "8",
                "--global-batch",
                "8",
            ],
            "model.name (--model): unknown model 'gpt-9000'",
        ),
        (
            [
                "estimate",
                "--model",
                "gpt-350m",
                "--config",
                "layers=x",
                "--cluster",
                "dgx-a100-80g",
                "--dp",
                "8",
                "--global-batch",
                "8",
            ],
            "model.config.layers",
        ),
        (
            ["estimate", "--model", "gpt-350m", "--cluster", "nowhere", "--global-batch", "8"],
            "--cluster: unknown cluster 'nowhere'",
        ),
        (
            [
                "estimate",
                "--model",
                "gpt-350m",
                "--cluster",
                "dgx-a100-80g",
                "--dp",
                "3",
                "--global-batch",
                "8",
            ],
            "--dp/--tp/--pp",
        ),
        (
            [
                "estimate",
                "--model",
                "gpt-350m",
                "--cluster",
                "aws-p3.16xlarge",
                "--dp",
                "8",
                "--global-batch",
                "8",
                "--seq",
                "64",
                "--dtype",
                "bf16",
                *SMALL,
            ],
            "dtype: device V100-SXM2-16GB has no",
        ),
        (
            [
                "estimate",
                "--model",
                "gpt-350m",
                "--cluster",
                "dgx-a100-80g",
                "--dp",
                "8",
                "--global-batch",
                "0",
            ],
            "argument --global-batch: 0 is not in [1,",
        ),
        (
            [
                "estimate",
                "--graph",
                "/nonexistent.json",
                "--cluster",
                "dgx-a100-80g",
                "--dp",
                "8",
                "--global-batch",
                "8",
            ],
            "--graph: cannot read",
        ),
        (["trace", "no_such_module:factory"], "target: cannot import 'no_such_module'"),
        (["trace", "json"], "target: 'json' is not module:function"),
    ],
)
def test_errors_name_the_field_without_a_traceback(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and out == ""


def test_trace_a_private_model_then_estimate_from_the_graph(tmp_path, capsys, monkeypatch):
    (tmp_path / "mymodel.py").write_text(
        textwrap.dedent("""
        from torch import nn

        class Tiny(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(1000, 64)
                self.layers = nn.ModuleList(
                    nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                    for _ in range(4)
                )
                self.head = nn.Linear(64, 1000)

            def forward(self, tokens):
                x = self.emb(tokens)
                for layer in self.layers:
                    x = x + layer(x)
                return self.head(x)

        def factory():
            return Tiny()
    """)
    )
    monkeypatch.chdir(tmp_path)
    graph_path = tmp_path / "graph.json"
    code, _, err = run(
        capsys,
        *("trace", "mymodel:factory", "--batch", "2", "--seq", "16", "--dtype", "fp32"),
        *("-o", str(graph_path)),
    )
    assert code == 0, err
    graph = OpGraph.from_json(graph_path.read_text())
    assert graph.param_count == 1000 * 64 + 4 * (64 * 256 + 256 + 256 * 64 + 64) + 64 * 1000 + 1000
    assert graph.num_layers == 4
    code, out, err = run(
        capsys,
        "estimate",
        "--graph",
        str(graph_path),
        "--cluster",
        "cpu-local",
        "--dp",
        "2",
        "--pp",
        "2",
        "--microbatches",
        "2",
        "--global-batch",
        "8",
        "--dtype",
        "fp32",
        "--json",
    )
    assert code == 0, err
    plan = Plan.model_validate_json(out)
    assert plan.request.model.name == "mymodel:factory"
    assert plan.request.model.params == graph.param_count
    assert [st.layers for st in plan.stages] == [[0, 2], [2, 4]]
    code, out, err = run(
        capsys,
        "plan",
        "--graph",
        str(graph_path),
        "--cluster",
        "cpu-local",
        "--global-batch",
        "8",
        "--dtype",
        "fp32",
        "--json",
        "--no-baselines",
    )
    assert code == 0, err
    planned = Plan.model_validate_json(out)
    assert planned.request.model.params == graph.param_count
    # the graph's tensor sizes are its fp32 trace's: bf16 would price half the bytes
    code, _, err = run(
        capsys,
        *("plan", "--graph", str(graph_path), "--cluster", "cpu-local", "--global-batch", "8"),
        *("--dtype", "bf16", "--no-baselines"),
    )
    assert code == 2 and "training.dtype" in err and "traced in fp32" in err, err
    assert sorted(x for st in planned.stages for x in range(*st.layers)) == [0, 1, 2, 3]


def test_hf_config_from_a_file(tmp_path, capsys):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 128,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out, err = run(
        capsys,
        "estimate",
        "--hf-config",
        str(path),
        "--cluster",
        "cpu-local",
        "--dp",
        "4",
        "--global-batch",
        "4",
        "--seq",
        "32",
        "--dtype",
        "fp32",
        "--json",
    )
    assert code == 0, err
    assert Plan.model_validate_json(out).request.model.family == "hf"  # transformers builds it


def test_console_script_runs_in_a_fresh_process():
    """The installed `autopar` entry point works (not just the function): it exits without
    the interpreter's teardown, so its output must be flushed and its exit code kept."""
    exe = Path(sys.executable).parent / "autopar"

    def autopar(*args):
        return subprocess.run(
            [str(exe), *args], capture_output=True, text=True, cwd=REPO, check=False, timeout=120
        )

    proc = autopar("models")
    assert proc.returncode == 0 and "llama3-70b" in proc.stdout
    proc = autopar("models", "--json")  # a pipe's whole output, not a buffer's worth
    assert proc.returncode == 0 and len(json.loads(proc.stdout)) > 10
    proc = autopar("estimate", "--model", "no-such", "--cluster", "dgx-h100", "--global-batch", "8")
    assert proc.returncode == 2 and proc.stderr.startswith("error: model.name (--model)")


def test_shard_prints_strategies_and_json(capsys):
    # Micro-batch 1 of a 2048-wide GPT: the regime where Megatron's layout wins.
    args = "shard --model gpt-1.3b --config layers=2 --cluster dgx-a100-80g --mesh 1x8"
    args = [*args.split(), "--layers", "0:2", "--batch", "1", "--seq", "512"]
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert "tp:col" in out and "tp:row" in out and "solver highs: optimal" in out
    code, out, err = run(capsys, *args, "--json", "--solver", "cbc")
    data = json.loads(out)
    assert data["solver"]["name"] == "cbc" and data["solver"]["status"] == "optimal"
    assert data["mesh"]["shape"] == [1, 8]
    fc1 = next(n for n in data["nodes"] if n["module"] == "blocks.1.mlp.fc1")
    assert fc1["params"]["blocks.1.mlp.fc1.weight"] == ["R", "S(0)"]
    assert data["memory"]["total"] <= data["memory_budget"]


def test_shard_infeasible_explains_itself(capsys):
    code, _, err = run(
        capsys,
        "shard",
        "--model",
        "gpt-1.3b",
        "--config",
        "layers=2",
        "--cluster",
        "dgx-a100-80g",
        "--mesh",
        "1x2",
        "--memory-budget",
        "0.1",
    )
    assert code == 3
    assert "infeasible:" in err and "Does not fit" in err and "It fits on a" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mesh", "8"], "--mesh: '8' is not DPxTP"),
        (["--mesh", "4x4"], "--mesh: 4x4 needs 16 devices, the cluster has 8"),
        (["--mesh", "1x8", "--layers", "3:9"], "--layers: '3:9' is not a range inside [0, 4)"),
    ],
)
def test_shard_errors_name_the_field(capsys, argv, message):
    code, _, err = run(
        capsys,
        "shard",
        "--model",
        "gpt-1.3b",
        "--config",
        "layers=4",
        "hidden=256",
        "heads=4",
        "--cluster",
        "dgx-a100-80g",
        *argv,
    )
    assert code == 2 and message in err


PLAN = [
    "--model",
    "gpt-350m",
    "--config",
    "layers=4",
    "hidden=256",
    "heads=4",
    "--cluster",
    "dgx-a100-80g",
    "--global-batch",
    "16",
    "--seq",
    "128",
]


def test_plan_prints_summary_alternatives_and_baselines(capsys, tmp_path):
    code, out, err = run(capsys, "plan", *PLAN, "-o", str(tmp_path / "plan.json"))
    assert code == 0, err
    assert "step time" in out and "alternative" in out
    assert "megatron (best)" in out and "fsdp (best)" in out
    assert "configurations evaluated" in out
    plan = Plan.from_json((tmp_path / "plan.json").read_text())
    assert plan.search.candidates_evaluated > 0 and plan.alternatives
    code, out, _ = run(capsys, "plan", *PLAN, "--json", "--no-baselines")
    assert Plan.model_validate_json(out).mesh.shape == plan.mesh.shape


def test_baseline_kinds(capsys):
    code, out, err = run(capsys, "baseline", "--kind", "fsdp", *PLAN, "--json")
    assert code == 0, err
    plan = Plan.model_validate_json(out)
    assert plan.stages[0].zero == 3 and plan.search.solver == "baseline: fsdp grid"


def test_plan_that_cannot_fit_exits_3_with_the_reason(capsys):
    code, _, err = run(
        capsys,
        "plan",
        "--model",
        "gpt-39b",
        "--config",
        "layers=4",  # 54 GiB of fp32 Adam state against 4 x 6 GiB
        "--cluster",
        "cpu-local",
        "--global-batch",
        "8",
        "--seq",
        "64",
        "--dtype",
        "fp32",
    )
    assert code == 3
    assert "does not fit" in err and "smallest cluster that fits" in err
    assert "Traceback" not in err


def test_execute_refuses_a_plan_the_executor_cannot_run(capsys, tmp_path):
    code, out, err = run(capsys, "estimate", *PLAN, "--dp", "8", "--json")
    assert code == 0, err
    plan = Plan.model_validate_json(out)
    assert plan.executable
    path = tmp_path / "plan.json"
    path.write_text(plan.model_copy(update={"executable": False}).to_json())
    code, _, err = run(capsys, "execute", str(path))
    assert code == 2 and "plan.executable" in err


def test_plan_pins_mesh_schedule_zero_and_checkpointing(capsys, tmp_path):
    path = tmp_path / "plan.json"
    pins = ["--mesh", "2x2x2", "--schedule", "gpipe", "--zero", "1", "--checkpointing", "on"]
    code, _, err = run(capsys, "plan", *PLAN, "--no-baselines", *pins, "-o", str(path))
    assert code == 0, err
    plan = Plan.from_json(path.read_text())
    assert plan.mesh.shape == [2, 2, 2] and plan.schedule.name == "gpipe"
    assert all(st.zero == 1 and st.activation_checkpointing for st in plan.stages)
    for alternative in plan.alternatives:
        assert alternative.mesh == [2, 2, 2] and alternative.schedule == "gpipe"


@pytest.mark.parametrize(
    ("pins", "message"),
    [
        (["--mesh", "3x1x1"], "search.mesh (--mesh): 3x1x1 is not a mesh this search can use"),
        (["--microbatch-size", "0"], "argument --microbatch-size: 0 is not in [1,"),
    ],
)
def test_bad_pins_name_the_flag(capsys, pins, message):
    code, out, err = run(capsys, "plan", *PLAN, "--no-baselines", *pins)
    assert code == 2 and message in err and "Traceback" not in err and out == ""


def test_a_malformed_mesh_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", *PLAN, "--mesh", "2x2"])
    assert exit_.value.code == 2
    assert (
        "--mesh: '2x2': expected PPxDPxTP with three positive integers" in capsys.readouterr().err
    )
