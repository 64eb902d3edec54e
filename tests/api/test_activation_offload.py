"""Activation offload is not exported: none of Megatron-LM's, torchtitan's or DeepSpeed's
configurations has the setting, so a plan using it is refused naming its stage field."""

from planner.parallel.activation_offload import MODE, STAGE_FIELD
from tests.api.test_export import SHARDED, _estimate, _export


def test_no_framework_takes_it(tmp_path, capsys):
    _, offloaded = _estimate(tmp_path, "offload", *SHARDED, "--checkpointing", MODE)
    for target in ("megatron", "torchtitan", "deepspeed"):
        assert _export(offloaded, target, tmp_path / f"o-{target}") == 2
        err = capsys.readouterr().err
        assert f"error: plan.stages[].{STAGE_FIELD}: {target} cannot" in err
