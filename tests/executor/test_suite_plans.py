"""Every best plan of Alpa's suite (GPT, MoE, Wide-ResNet; default search) runs: each plan's
structure scaled down to 4 gloo processes (bench/suite_scaled.py writes them to
tests/fixtures/suite_scaled/: the suite plan's schedule, ZeRO level, checkpointing, tp layout
and per-node strategies on a small model) matches the single-process reference.

Tolerances (fp32, SGD): losses rel 1e-5, parameters abs 1e-5. Wide-ResNet compares one step:
its batch norms over 2 x 2 feature maps amplify float32 rounding so much that after two
steps a float32 and a float64 reference differ by 2e-2 (after one: 3e-4, while the run
matches the float32 reference within 1e-7).
"""

from pathlib import Path

import pytest

from executor.local_ranks import run_local
from executor.reference import distributed_losses, distributed_params, reference_run
from planner.plan import Plan
from tests.executor.ledger_check import check_activations, check_ledger

FIXTURES = Path(__file__).parent.parent / "fixtures" / "suite_scaled"
# Alpa's suites (bench/suite.py) but moe-70b, which fits no configuration on 64 V100s.
SUITE = [
    *(f"gpt-{s}" for s in ("350m", "760m", "1.3b", "2.6b", "6.7b", "15b", "39b")),
    *(f"moe-{s}" for s in ("380m", "690m", "1.3b", "2.4b", "10b", "27b")),
    *(f"wresnet-{s}" for s in ("250m", "500m", "1b", "2b", "4b", "6.8b", "13b")),
]


# Where a scaled plan's run does not match its ledger yet: (why, mesh axes not compared, bytes
# held compared), as tests/executor/ledger_check.py's gaps. Every other scaled plan matches.
BATCH_NORM = (
    "graph mode runs a batch norm over a dp-split batch by gathering its input (DTensor has "
    "no split rule for it), which the plan prices as local to each batch shard",
    frozenset({"dp"}),
    True,
)
ALL_TO_ALL = (
    "gloo has no all-to-all: DTensor runs the plan's shard-to-shard reshards (the experts' "
    "token exchange) as an all-gather and a local chunk; and the tied embedding's sum is "
    "of the whole table, which the ledger prices as the head's vocab shard",
    frozenset({"tp", "pp", "tied"}),
    True,
)
CONVOLUTIONS = (
    "graph mode runs the convolutions and batch norms whose split has no local rule "
    "(executor.graph_local_ops) replicated, gathering their inputs, where the plan prices "
    "them split",
    frozenset({"tp", "pp"}),
    True,
)
GAPS = {
    "wresnet-500m": BATCH_NORM,
    "wresnet-1b": BATCH_NORM,
    "moe-27b": ALL_TO_ALL,
    **{f"wresnet-{size}": CONVOLUTIONS for size in ("2b", "4b", "6.8b", "13b")},
}


# Where a scaled plan's activation peak is outside ledger_check.ACTIVATION_TOLERANCE of the
# plan's (bench/results/suite_scaled_execute.md has each figure).
SEQUENCE_PARALLEL_PEAK = (
    "+25% on the first stage: under torch's sequence-parallel styles the all-gathers' staging "
    "buffers are live at the peak beside the gathered inputs (as the equivalence case "
    "llama-pp2xtp2-sequence-parallel); not priced"
)
REPLICATED_PEAK = (
    "graph mode runs these ops replicated, on gathered inputs (the ledger gap above), so it "
    "holds what the plan prices split"
)
ACTIVATION_GAPS = {
    "gpt-39b": SEQUENCE_PARALLEL_PEAK,
    "gpt-15b": "+19% on the first stage, -19% on the last: a rebuilt layer's backward holds "
    "more, then less, than its saved bytes and two gradients (checkpointing.rebuilt_of)",
    "moe-27b": "+42%: " + REPLICATED_PEAK + " (the experts' tokens all-gathered)",
    "wresnet-500m": "-42%: graph mode with the batch norms run on gathered inputs (the "
    "ledger gap above) holds less than the plan; not analysed",
    "wresnet-1b": "-30%: the same",
    **{
        f"wresnet-{size}": "+178% to +222%: " + REPLICATED_PEAK
        for size in ("2b", "4b", "6.8b", "13b")
    },
}


def _plan(name: str) -> Plan:
    return Plan.from_json((FIXTURES / f"{name}.json").read_text())


def test_every_suite_case_has_an_executable_scaled_plan():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(SUITE)
    for name in SUITE:
        plan = _plan(name)
        assert plan.executable, (name, plan.not_executable_reason)
        assert plan.request.training.dtype == "fp32"


def _structure(plan: Plan) -> tuple:
    """What a run exercises: plans of one small model with equal structure run the same."""
    return (
        plan.request.model.family,
        tuple(plan.mesh.shape),
        plan.schedule.model_dump_json(),
        plan.tp_layout,
        tuple(
            (
                st.zero,
                st.activation_checkpointing,
                tuple((s.node, s.strategy) for s in st.shardings),
            )
            for st in plan.stages
        ),
    )


def _distinct() -> list[str]:
    seen, out = set(), []
    for name in SUITE:
        key = _structure(_plan(name))
        if key not in seen:
            seen.add(key)
            out.append(name)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("name", _distinct())
def test_scaled_suite_plan_matches_single_process_reference(name):
    plan = _plan(name)
    steps = 1 if "image_size" in plan.request.model.config else 2
    ranks = run_local(plan, steps=steps, timeout_s=300)
    reference = reference_run(plan, steps=steps)

    expected_mode = "graph" if plan.tp_layout == "per_node" or "wresnet" in name else "modules"
    assert {r["mode"] for r in ranks} == {expected_mode}
    assert distributed_losses(ranks, plan) == pytest.approx(reference["losses"], rel=1e-5)
    params = distributed_params(ranks)
    assert set(params) <= set(reference["params"])
    assert {n for n in reference["params"] if not n.endswith("head.weight")} <= set(params)
    for param, values in params.items():
        assert values == pytest.approx(reference["params"][param], abs=1e-5), param
    check_ledger(plan, ranks, GAPS.get(name))
    check_activations(plan, ranks, ACTIVATION_GAPS.get(name))


@pytest.mark.distributed
def test_graph_mode_pipeline_resumes_from_a_sharded_checkpoint(tmp_path):
    """DCP checkpoints in graph mode: one step, save; resume for the second step; the
    parameters equal two uninterrupted reference steps."""
    plan = _plan("moe-27b")  # pp2 x tp2, per-node layout, embeddings tied across stages
    run_local(plan, steps=1, timeout_s=300, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    assert (tmp_path / "latest").read_text() == "1"
    ranks = run_local(plan, steps=2, timeout_s=300, checkpoint_dir=str(tmp_path), resume=True)
    assert all(r["mode"] == "graph" and [s["step"] for s in r["steps"]] == [1] for r in ranks)
    reference = reference_run(plan, steps=2)
    assert distributed_losses(ranks, plan) == pytest.approx(reference["losses"][1:], rel=1e-5)
    for param, values in distributed_params(ranks).items():
        assert values == pytest.approx(reference["params"][param], abs=1e-5), param


def test_autopar_parallelize_names_what_it_cannot_apply():
    """autopar.parallelize hands the model's own modules back to the user's loop: a per-node
    layout (graph mode) is refused, naming the field and what to do instead."""
    from torch import nn

    import autopar

    with pytest.raises(ValueError, match=r"plan\.tp_layout: .*tp_layout='megatron'"):
        autopar.parallelize(nn.Linear(2, 2), _plan("moe-27b"))
