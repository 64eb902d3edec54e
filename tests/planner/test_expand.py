"""A shallow trace expanded to the model's depth equals the full trace, node for node and edge
for edge (names, layers, parameters, FLOPs, bytes, arguments), for every family that is
expanded (planner.graph.expand)."""

import dataclasses

import pytest

from planner.graph.expand import expand_layers
from planner.graph.tracing import trace_model
from planner.models import ModelSpec, resolve

CASES = [
    ("gpt-350m", {"hidden": 64, "heads": 4, "vocab": 256}, 1),
    ("llama3-8b", {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128, "vocab": 256}, 1),
    ("moe-380m", {"hidden": 64, "heads": 4, "experts": 4, "vocab": 256}, 2),
]


@pytest.mark.parametrize(("name", "config", "period"), CASES)
@pytest.mark.parametrize("layers", [5, 8])
def test_expanded_trace_is_the_full_trace(name, config, period, layers):
    model = resolve(ModelSpec(name=name, config={**config, "layers": layers}))
    shallow_layers = 2 * period + layers % period
    shallow = dataclasses.replace(
        model, config=dataclasses.replace(model.config, layers=shallow_layers)
    )
    for batch in (1, 2):
        full = trace_model(model, batch, 32, "bf16")
        expanded = expand_layers(trace_model(shallow, batch, 32, "bf16"), layers, period)
        want, got = full.to_dict(), expanded.to_dict()
        assert [n["name"] for n in got["nodes"]] == [n["name"] for n in want["nodes"]]
        for a, b in zip(got["nodes"], want["nodes"], strict=True):
            assert a == b, a["name"]
        assert got["edges"] == want["edges"]
        assert got == want
