"""The plan viewer's sections (api/viewer_*.py), checked against the plan itself: collapsed
layer rows hold layers whose operators are sharded alike, the communication lanes carry the
pipeline sends, every part names a device's chunks alike, tiny plans get readable memory
bars, and a plan slower than a baseline says so with the margin."""

from __future__ import annotations

import re

import pytest

from api.viewer import render_page
from api.viewer_layers import layer_groups
from api.viewer_parts import baselines, grid, memory
from api.viewer_timeline import gantt
from tests.api.viewer_plans import llama, recorded


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("viewer"))
    return {"llama": llama(False, out), "interleaved": llama(True, out)}


def _layer_signature(stage, index: int) -> list:
    """The operators of one layer with the layer's index taken out of their paths (written
    here, not with the viewer's own parser)."""
    marker = f".{index}."
    return [
        (
            f"{s.module}.".replace(marker, ".N.", 1),
            s.kind,
            s.strategy,
            s.outputs,
            list(s.params.values()),
        )
        for s in stage.shardings
        if marker in f"{s.module}."
    ]


def test_identical_layers_collapse_into_one_row_that_covers_every_layer(plans):
    plan = plans["llama"]
    total = 0
    for st in plan.stages:
        groups = layer_groups(st)
        covered = []
        for g in groups:
            if g["layers"]:
                assert re.match(r"layers? [0-9]", g["title"]), g["title"]
                covered += [g["layers"]]
            else:
                assert g["title"].startswith("outside the layers")
        total += sum(covered)
        assert sum(covered) == st.layers[1] - st.layers[0]
        # Llama's decoder layers are sharded alike: one row per stage besides the outside
        assert len([g for g in groups if g["layers"]]) == 1, [g["title"] for g in groups]
        first, last = st.layers[0], st.layers[1] - 1
        assert f"layers {first}–{last}: same sharding" in groups[0]["title"]
        assert _layer_signature(st, first) == _layer_signature(st, last)
    assert total == 80


def test_alternating_moe_layers_collapse_every_second():
    plan = recorded("moe-1.3b-4gpu")  # one stage of 16 layers, dense and MoE alternating
    titles = [g["title"] for st in plan.stages for g in layer_groups(st)]
    assert any("(every 2nd)" in t for t in titles), titles


def test_communication_lanes_carry_every_pipeline_send(plans):
    plan = plans["llama"]
    chart = gantt(plan)
    pp = plan.mesh.shape[0]
    passes = chart["blocks"]
    sends = [c for c in chart["comm"] if c["kind"] == "send"]
    # every forward but the last stage's and every backward but the first's sends
    expected = [
        b
        for b in passes
        if (b["title"].startswith("F") and "stage 3" not in b["title"])
        or (b["title"].startswith("B") and "stage 0" not in b["title"])
    ]
    assert len(sends) == len(expected) > 0
    assert {c["lane"] for c in chart["comm"]} == {2 * d + 1 for d in range(pp)}
    assert {b["lane"] for b in passes} == {2 * d for d in range(pp)}
    # a send is the tail of its pass, as the cost model runs it
    for send, block in zip(sends, expected, strict=True):
        assert block["start"] <= send["start"] <= send["end"] == pytest.approx(block["end"])
    assert [lane["label"] for lane in chart["lanes"]][:2] == ["stage 0", "  comm"]


def test_interleaved_chunks_are_named_alike_in_grid_gantt_memory_and_shardings(plans):
    plan = plans["interleaved"]
    pp, chunks = plan.mesh.shape[0], len(plan.stages)
    assert chunks == 2 * pp
    # Megatron's interleaving: chunk k runs on pipeline stage k % pp
    held = {s: [k for k in range(chunks) if k % pp == s] for s in range(pp)}
    page = render_page(plan, [])
    for s, ks in held.items():
        names = ", ".join(f"c{k}" for k in ks)
        lane = next(
            lane["label"]
            for lane in gantt(plan)["lanes"]
            if lane["label"].startswith(f"stage {s} ")
        )
        assert lane == f"stage {s} ({names})"
        assert memory(plan)["rows"][s]["label"] == f"stage {s} ({names})"
        ranks = plan.mesh.ranks[s][0][0]
        device = next(d for n in grid(plan) for d in n["devices"] if d["rank"] == ranks)
        assert f"stage {s} · chunks {', '.join(map(str, ks))}" in device["label"]
        for k in ks:
            assert f"Stage {s} · chunk {k}: layers" in page
    for block in gantt(plan)["blocks"]:
        k = int(re.search(r"chunk (\d+)", block["title"]).group(1))
        assert f"stage {k % pp} · chunk {k}" in block["title"] and block["lane"] == 2 * (k % pp)


def test_a_tiny_plan_is_drawn_against_its_largest_stage():
    plan = recorded("demo-plan-cpu")
    cap = plan.request.cluster.device_memory_bytes
    assert plan.predicted.peak_memory_bytes < 0.05 * cap
    bars = memory(plan)
    assert bars["tiny"] and bars["cap_left"] is None
    widest = max(sum(float(s["width"]) for s in row["segments"]) for row in bars["rows"])
    assert widest == pytest.approx(100, abs=0.1)
    assert "drawn against the largest stage" in render_page(plan, [])


def test_a_plan_slower_than_a_baseline_is_flagged_with_the_margin(plans):
    plan = plans["llama"]
    step = plan.predicted.step_time_s
    fast = {"kind": "megatron", "fits": True, "step_time_s": step * 0.8, "tflops_per_device": 1}
    slow = {"kind": "fsdp", "fits": True, "step_time_s": step * 1.3, "tflops_per_device": 1}
    _, warning = baselines(plan, [fast, slow])
    assert "megatron" in warning and "80% of this plan's time (25% faster)" in warning
    assert 'id="slower-than-baseline"' in render_page(plan, [fast, slow])
    assert baselines(plan, [slow])[1] == ""
    assert 'id="slower-than-baseline"' not in render_page(plan, [slow])


def test_cli_compare_prints_the_ratios_and_writes_the_page(plans, tmp_path, capsys):
    from api.cli.main import main

    paths = []
    for name in ("llama", "interleaved"):
        path = tmp_path / f"{name}.json"
        path.write_text(plans[name].to_json())
        paths.append(str(path))
    page = tmp_path / "compare.html"
    assert main(["compare", *paths, "--html", str(page)]) == 0
    out = capsys.readouterr().out
    a, b = plans["llama"].predicted.step_time_s, plans["interleaved"].predicted.step_time_s
    ratio = a / b if b < a else b / a
    step = next(line for line in out.splitlines() if line.startswith("step time"))
    assert step.endswith(f"B {ratio:.2f}× {'better' if b < a else 'worse'}")
    html = page.read_text()
    assert html.count('<svg class="gantt"') == 2 and "/v1/plans/" not in html  # a file: no links
    assert main(["compare", paths[0], str(tmp_path / "missing.json")]) == 2
    assert "B: cannot read" in capsys.readouterr().err


def test_the_ledger_is_shown_per_stage_on_the_page_and_in_the_cli_summary():
    """Each stage's predicted collectives (calls of each kind on each mesh axis) and the
    state one of its ranks holds, as the plan carries them, in the page's ledger table and
    in `autopar plan`'s summary."""
    from api.render import plan_summary

    plan = recorded("demo-plan-cpu")  # dp 4, ZeRO-3: gathers and reduce-scatters on dp
    page = render_page(plan, [])
    table = re.search(r'<table class="ledger">(.*?)</table>', page, re.S).group(1)
    headers = re.findall(r"<th>(.*?)</th>", table)
    rows = [re.findall(r"<td>(.*?)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", table)[1:]]
    summary = plan_summary(plan)
    assert len(rows) == len(plan.stages)
    for st, row in zip(plan.stages, rows, strict=True):
        ledger = st.predicted.ledger
        assert ledger.comm
        for e in ledger.comm:
            cell = row[headers.index(f"on {e.axis}")]
            assert f"{e.calls} {e.kind.replace('_', '-')} " in cell, (e, cell)
            assert f"{e.calls} {e.kind.replace('_', '-')} " in summary
        held = ledger.held[0]
        mib = (held.params + held.grads + held.optimizer) / 2**20
        assert row[-1] == f"{mib:.1f} MiB"
    kinds = {e.kind for e in plan.stages[0].predicted.ledger.comm if e.axis == "dp"}
    assert {"all_gather", "reduce_scatter"} <= kinds
