"""How long, how much, how many GPUs (planner/search/sizing.py, `autopar size`): the run's
time, GPU-hours and cost follow from each size's plan by the arithmetic a person does by
hand, and the deadline and budget pick the sizes this test picks from the rows itself."""

import json
import math

import pytest

from api.cli.main import main
from planner.cluster.profile import load_cluster
from planner.errors import InputError
from planner.request import resolve_request
from planner.search.search import search
from planner.search.sizing import node_counts, parse_duration, parse_tokens, size
from planner.search.space import SearchOptions

MODEL = {"name": "gpt-350m", "config": {"layers": 4}}
TRAINING = {"global_batch_size": 64, "seq_len": 1024, "dtype": "bf16"}
TOKENS = 3e11


@pytest.fixture(scope="module")
def inputs():
    cluster = load_cluster("dgx-a100-80g")
    return resolve_request(MODEL, cluster, TRAINING).trace()


def _sweep(inputs, **kw):
    options = SearchOptions(layouts=("megatron",), top_k=1)
    return size(inputs, [1, 2, 4], TOKENS, lambda i: search(i, options).plan, **kw)


# Meta's "higher than 90% effective training time" for Llama 3 (Dubey et al. 2024, 3.3.4)
META_GOODPUT = 0.90


def test_time_gpu_hours_and_cost_are_the_hand_arithmetic(inputs):
    sizing = _sweep(inputs, price=2.5)
    assert [r.nodes for r in sizing.rows] == [1, 2, 4]
    for row in sizing.rows:
        assert row.fits and row.gpus == 8 * row.nodes
        run = row.run
        assert run.steps_time_s == pytest.approx(TOKENS / row.tokens_per_s, rel=1e-12)
        assert run.goodput == META_GOODPUT
        assert run.time_s == pytest.approx(TOKENS / row.tokens_per_s / 0.9, rel=1e-12)
        assert run.gpu_hours == pytest.approx(row.gpus * run.time_s / 3600, rel=1e-12)
        assert run.cost == pytest.approx(run.gpu_hours * 2.5, rel=1e-12)
        assert run.steps == math.ceil(TOKENS / (64 * 1024))
        # tokens/s is the plan's own global batch over its step time
        assert row.tokens_per_s == pytest.approx(64 * 1024 / row.step_time_s, rel=1e-9)


def test_deadline_and_budget_pick_the_cheapest_and_the_fastest(inputs):
    rows = _sweep(inputs, price=2.0).rows
    times = sorted(r.run.time_s for r in rows)
    deadline = (times[0] + times[1]) / 2  # only the fastest size meets it
    costs = sorted(r.run.cost for r in rows)
    budget = (costs[0] + costs[1]) / 2  # only the cheapest size stays within it
    sizing = _sweep(inputs, price=2.0, deadline_s=deadline, budget=budget)
    fastest = min(rows, key=lambda r: r.run.time_s)
    cheapest = min(rows, key=lambda r: r.run.cost)
    assert sizing.cheapest_within_deadline == fastest.nodes
    assert sizing.fastest_within_budget == cheapest.nodes
    loose = _sweep(inputs, price=2.0, deadline_s=times[-1] * 2, budget=costs[-1] * 2)
    assert loose.cheapest_within_deadline == cheapest.nodes  # all meet it: the cheapest
    assert loose.fastest_within_budget == fastest.nodes  # all afford it: the fastest
    none = _sweep(inputs, price=2.0, deadline_s=times[0] / 2, budget=costs[0] / 2)
    assert none.cheapest_within_deadline is None and none.fastest_within_budget is None
    assert any("No size meets the deadline" in line for line in none.explanation)


def test_counts_durations_and_sizes_are_read_and_checked():
    assert parse_tokens("15T", "f") == 15e12
    assert parse_tokens("300B", "f") == 3e11
    assert parse_tokens("2e12", "f") == 2e12
    assert parse_duration("30d", "f") == 30 * 86400
    assert parse_duration("12h", "f") == 12 * 3600
    assert node_counts(8, 128) == [8, 16, 32, 64, 128]
    assert node_counts(3, 10) == [3, 6, 10]
    for bad in ("15X", "-1", "1e20", ""):
        with pytest.raises(InputError) as err:
            parse_tokens(bad, "--train-tokens")
        assert err.value.field == "--train-tokens"
    with pytest.raises(InputError):
        parse_duration("soon", "--deadline")
    with pytest.raises(InputError):
        node_counts(16, 8)


def test_cli_size_prints_the_table_writes_json_and_chart(tmp_path, capsys):
    chart, out = tmp_path / "sizing.svg", tmp_path / "sizing.json"
    args = [
        "size", "--model", "gpt-350m", "--config", "layers=4", "--cluster", "dgx-a100-80g",
        "--min-nodes", "1", "--max-nodes", "2", "--global-batch", "64", "--seq", "1024",
        "--train-tokens", "300B", "--gpu-hour-price", "2", "--deadline", "400d",
        "--chart", str(chart), "-o", str(out), "--workers", "1",
    ]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "GPU-hours" in text and "cheapest in deadline" in text
    sizing = json.loads(out.read_text())
    assert [r["gpus"] for r in sizing["rows"]] == [8, 16]
    svg = chart.read_text()
    assert svg.startswith("<svg") and svg.count('class="series"') == 2
    assert "http" not in svg.replace("http://www.w3.org/2000/svg", "")  # nothing fetched
    # a budget means money: without a price it is an error naming the flag
    at = args.index("--gpu-hour-price")
    no_price = args[:at] + args[at + 2 :]
    assert main([*no_price, "--budget", "5"]) == 2
    assert "--budget" in capsys.readouterr().err


def test_cli_plan_adds_the_run_and_refuses_a_price_alone(capsys):
    base = [
        "plan", "--model", "gpt-350m", "--config", "layers=4", "--cluster", "dgx-a100-80g",
        "--global-batch", "64", "--seq", "1024", "--no-baselines", "--json", "--workers", "1",
    ]  # fmt: skip
    assert main([*base, "--train-tokens", "1T", "--gpu-hour-price", "3"]) == 0
    plan = json.loads(capsys.readouterr().out)
    run = plan["run"]
    steps_s = 1e12 / plan["predicted"]["tokens_per_s"]
    assert run["time_s"] == pytest.approx(steps_s / META_GOODPUT, rel=1e-12)
    assert run["cost"] == pytest.approx(run["gpu_hours"] * 3, rel=1e-12)
    # the user's own goodput: all of the wall-clock on steps, or three quarters of it
    for goodput in (1.0, 0.75):
        assert main([*base, "--train-tokens", "1T", "--goodput", str(goodput)]) == 0
        run = json.loads(capsys.readouterr().out)["run"]
        assert run["time_s"] == pytest.approx(steps_s / goodput, rel=1e-12)
    assert main([*base, "--gpu-hour-price", "3"]) == 2
    assert "--gpu-hour-price" in capsys.readouterr().err
    assert main([*base, "--train-tokens", "1T", "--goodput", "1.5"]) == 2
    assert "--goodput: 1.5 (expected a share above 0 and at most 1" in capsys.readouterr().err


def test_later_sizes_reuse_the_layouts_and_solve_only_new_tp_degrees(monkeypatch, tmp_path):
    from planner.search import layout_cache

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    solved = []
    store = layout_cache.LayoutCache._store_ilp

    def record(self, mbs, tp, layouts, nvars):
        solved.append((self.inputs.cluster.nodes, mbs, tp))
        return store(self, mbs, tp, layouts, nvars)

    monkeypatch.setattr(layout_cache.LayoutCache, "_store_ilp", record)
    cluster = load_cluster("dgx-a100-80g")
    inputs = resolve_request(MODEL, cluster, TRAINING).trace()
    options = SearchOptions(top_k=1, layouts=("ilp",))
    size(inputs, [1, 2], TOKENS, lambda i: search(i, options).plan)
    first = {(m, tp) for n, m, tp in solved if n == 1}
    again = {(m, tp) for n, m, tp in solved if n == 2}
    assert first and not again & first  # nothing solved on one node is solved again
    assert {tp for _, tp in again} <= {16}  # only tp groups spanning both nodes are new
