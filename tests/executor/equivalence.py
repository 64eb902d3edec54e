"""The executor tests' common check: a plan run on gloo ranks against the single-process
reference (losses and every parameter) and against its own ledger and activation peak."""

from __future__ import annotations

import pytest

from executor.local_ranks import run_local
from executor.reference import distributed_losses, distributed_params, reference_run
from tests.executor.ledger_check import check_activations, check_gradients, check_ledger


def runs_as_planned(plan, steps: int = 3) -> list[dict]:
    """Runs `plan` for `steps` on local gloo ranks; asserts fp32 equality with the reference
    (losses rel 1e-5, parameters abs 1e-5), the ledger, the activation and gradient peaks;
    returns the ranks' results."""
    ranks = run_local(plan, steps=steps, timeout_s=240)
    reference = reference_run(plan, steps=steps)
    assert distributed_losses(ranks, plan) == pytest.approx(reference["losses"], rel=1e-5)
    params = distributed_params(ranks)
    assert set(params) == set(reference["params"])
    for name, values in params.items():
        assert values == pytest.approx(reference["params"][name], abs=1e-5), name
    check_ledger(plan, ranks)
    check_activations(plan, ranks)
    check_gradients(plan, ranks)
    return ranks
