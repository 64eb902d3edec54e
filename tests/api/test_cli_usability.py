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
