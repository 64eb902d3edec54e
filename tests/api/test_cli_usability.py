"""What a new user meets first (issue 18): `autopar --version`, --help that states the
defaults, and a training dtype that defaults to the best the device supports."""

import pytest

from api.cli import main
from planner import __version__
from planner.plan import Plan


def _run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as stop:  # --version and --help exit through argparse
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    code, out, _ = _run(capsys, "--version")
    assert code == 0 and out.strip() == f"autopar {__version__}"


HELP = {
    "plan": ["--optimizer {adamw,adam,sgd,sgd_momentum} (default: adamw)", "keep (default: 5)"],
    "estimate": ["--zero {0,1,2,3} ZeRO stage over dp (default: 0)", "--microbatches"],
    "execute": ["--steps STEPS (default: 3)", "whole run, s (default: 300.0)"],
}


@pytest.mark.parametrize("command", sorted(HELP))
def test_help_states_the_defaults(capsys, command):
    code, out, _ = _run(capsys, command, "--help")
    text = " ".join(out.split())  # argparse wraps lines
    assert code == 0
    assert all(s in text for s in HELP[command])
    assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.parametrize(
    ("cluster", "dtype"), [("aws-p3.16xlarge", "fp16"), ("dgx-a100-80g", "bf16")]
)
def test_the_dtype_defaults_to_the_best_the_device_supports(capsys, tmp_path, cluster, dtype):
    """A V100 has no bf16: planning on it without --dtype used to fail ("no peak FLOP/s for
    'bf16'"); it now plans in fp16, and bf16 where the device has it."""
    out = tmp_path / "plan.json"
    args = ["estimate", "--model", "gpt-350m", "--config", "layers=2", "hidden=64", "heads=4"]
    args += ["--cluster", cluster, "--dp", "8", "--global-batch", "8", "--seq", "64"]
    args += ["-o", str(out)]
    code, _, err = _run(capsys, *args)
    assert code == 0, err
    assert Plan.from_json(out.read_text()).request.training.dtype == dtype
    code, _, err = _run(capsys, *args, "--dtype", "bf16")
    assert (code == 0) == (dtype == "bf16"), err


def test_execute_errors_are_shown_whole():
    """A rank's error used to be cut at 120 characters in `autopar execute`'s table."""
    from api.cli.execute import error_rows
    from api.render import table

    long = "RuntimeError: " + " ".join(["stage 1 expected a tensor of shape [4, 64]"] * 5)
    rows = error_rows({1: long + "\nsecond line", 0: "peer lost"}, failed_rank=1)
    assert rows == [["rank 0", "peer lost"], ["rank 1 (cause)", long]]
    assert long in table(["execution", ""], rows)


def test_numbers_read_by_magnitude():
    from planner.units import human_bytes, human_flops, plural

    assert human_flops(0.05e12) == "50.0 GFLOP/s" and human_flops(312e12) == "312.0 TFLOP/s"
    assert human_bytes(12.9 * 2**20) == "12.9 MiB" and human_bytes(3 * 2**30) == "3.0 GiB"
    assert plural(1, "node") == "1 node" and plural(8, "node") == "8 nodes"
    assert plural(1, "micro-batch") == "1 micro-batch"
    assert plural(4, "micro-batch") == "4 micro-batches"


def test_a_small_plan_reads_without_zeros_or_bad_plurals(capsys, tmp_path):
    args = ["estimate", "--model", "gpt-350m", "--config", "layers=2", "hidden=64", "heads=4"]
    args += ["--cluster", "cpu-local", "--dp", "4", "--global-batch", "8", "--seq", "64"]
    code, out, err = _run(capsys, *args)
    assert code == 0, err
    assert "1 micro-batch;" in out or "1 micro-batch\n" in out or "1 micro-batch," in out
    for bad in ("0.0 TFLOP/s", "0.0 GiB", "1 micro-batches", "1 stages"):
        assert bad not in out, bad


def test_shell_completion(capsys, tmp_path):
    """`autopar completion` prints argcomplete's script; the shell then runs autopar with
    argcomplete's environment, which answers with the matching commands and flags."""
    import os
    import subprocess
    import sys

    for shell in ("bash", "zsh"):
        code, out, _ = _run(capsys, "completion", "--shell", shell)
        assert code == 0 and "autopar" in out and "_ARGCOMPLETE" in out
    answers = tmp_path / "answers"
    line = "autopar plan --chec"
    env = dict(os.environ, _ARGCOMPLETE="1", _ARGCOMPLETE_IFS="\n", COMP_LINE=line)
    env.update(COMP_POINT=str(len(line)), _ARGCOMPLETE_STDOUT_FILENAME=str(answers))
    code = "from api.cli import main; main()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert answers.read_text().split() == ["--checkpointing"]


def test_plans_run_by_default_and_the_others_are_asked_for(capsys, tmp_path):
    """`autopar plan` returns only plans the executor runs (issue 36): an MLP, which has no
    graph mode, pinned to per-node tp layouts has none; --allow-non-executable gives the best
    plan anyway, saying why it cannot run."""
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "mlp", "--config", "layers=2", "hidden=64", "ffn_hidden=128"]
    args += ["--cluster", "cpu-local", "--global-batch", "8", "--seq", "16", "--dtype", "fp32"]
    args += ["--mesh", "1x1x4", "--tp-layout", "per_node", "--no-baselines", "-o", str(out)]
    code, _, err = _run(capsys, *args)
    assert code != 0 and "No executable plan" in err
    code, _, err = _run(capsys, *args, "--allow-non-executable")
    assert code == 0, err
    plan = Plan.from_json(out.read_text())
    assert not plan.executable and "graph mode does not run mlp" in plan.not_executable_reason


def test_a_prediction_is_compared_in_words_that_say_which_side_is_larger():
    from api.render import versus_prediction

    assert versus_prediction(0.17, 1.0) == "measured 5.9x the prediction"  # was "-83%"
    assert versus_prediction(0.88, 1.0) == "prediction 12% low"
    assert versus_prediction(1.03, 1.0) == "prediction 3% high"
    assert versus_prediction(2.5, 1.0) == "prediction 2.5x the measured"
    assert versus_prediction(1.001, 1.0) == "prediction within 0.5%"


def test_the_hf_config_help_says_what_it_takes(capsys):
    from api.cli.main import main

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "config.json of a causal LM transformers builds" in out
    assert "Llama-family model" not in out
