import json

import pytest
import torch

from planner.errors import InputError
from planner.graph.batch import extrapolate_batch, rescale_batch
from planner.graph.opgraph import OpGraph
from planner.graph.tracing import trace
from planner.models import ModelSpec, resolve
from tests.conftest import traced


def _eager_saved_bytes(module: torch.nn.Module, inputs: tuple) -> int:
    """Bytes of distinct storages autograd keeps, measured on real CPU tensors: parameters
    and buffers (a RoPE table, batch norm's running statistics) are held anyway."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in module.buffers()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return sum(seen.values())


@pytest.mark.parametrize(
    ("name", "config", "batch", "seq"),
    [
        ("mlp", {"hidden": 64, "ffn_hidden": 256, "layers": 2}, 4, 3),
        ("wresnet-250m", {"channels": 8, "width": 2, "image_size": 32}, 2, 1),
    ],
)
def test_saved_bytes_match_an_eager_run(name, config, batch, seq):
    """The trace's bytes-saved-for-backward equal what autograd really keeps on CPU."""
    resolved = resolve(ModelSpec(name=name, config=config))
    graph = trace(
        resolved.build(), resolved.example_inputs(batch, seq), seq=seq, strip_prefix="model."
    )
    torch.manual_seed(0)
    module = resolved.build(device="cpu")
    inputs = resolved.example_inputs(batch, seq, device="cpu")
    assert graph.total("saved_bytes") == _eager_saved_bytes(module, inputs)


def test_a_rope_table_is_no_activation():
    """Multiplying by a slice of the RoPE table saves a view of a buffer held once anyway:
    the bytes saved for backward do not grow with the table (all positions the model takes),
    as they did when the view was counted as its whole storage per micro-batch."""
    small = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128}
    short = traced("llama3-8b", batch=2, seq=16, dtype="fp32", seq_len=64, **small)
    long = traced("llama3-8b", batch=2, seq=16, dtype="fp32", seq_len=4096, **small)
    assert short.total("saved_bytes") == long.total("saved_bytes")


def test_nodes_carry_module_layer_and_costs(small_gpt):
    g = small_gpt
    assert g.num_layers == 4
    by_module = {n.module: n for n in g.nodes}
    fc1 = by_module["blocks.2.mlp.fc1"]
    assert fc1.kind == "linear" and fc1.layer == 2
    assert fc1.fwd_flops == 2 * 2 * 64 * 256 * 1024  # 2 * tokens * in * out
    assert fc1.bwd_flops == 2 * fc1.fwd_flops
    assert fc1.param_bytes == (256 * 1024 + 1024) * 2
    assert by_module["wte"].layer is None and by_module["wte"].kind == "embedding"
    attn = next(n for n in g.nodes if n.kind == "attention")
    assert attn.fwd_flops == 4 * 2 * 4 * 64 * 64 * 64  # 4 * b * heads * s * s * head_dim
    assert g.data.outputs == ["cross_entropy_loss"]
    # Tied LM head: one parameter, counted once.
    head = by_module["lm_head"]
    assert head.shared_params == ["wte.weight"] and head.param_bytes == 0


def test_graph_json_round_trip(small_gpt):
    text = small_gpt.to_json()
    again = OpGraph.from_json(text)
    assert again.to_json() == text
    assert again.summary() == small_gpt.summary()


def test_rescale_batch_is_linear():
    g2 = traced("mlp", batch=2, seq=1)
    g8 = traced("mlp", batch=8, seq=1)
    scaled = rescale_batch(g2, 8)
    assert scaled.train_flops == g8.train_flops
    assert scaled.total("saved_bytes") == g8.total("saved_bytes")
    assert [e.bytes for e in scaled.edges] == [e.bytes for e in g8.edges]


def _graph_dict(graph):
    return json.loads(graph.to_json())


def test_bad_graph_json_names_the_problem(small_gpt):
    with pytest.raises(InputError, match="graph: not valid JSON"):
        OpGraph.from_json("{oops")
    data = _graph_dict(small_gpt)
    data["schema_version"] = "99"
    with pytest.raises(InputError, match=r"graph\.schema_version: unsupported '99'"):
        OpGraph.from_dict(data)

    data = _graph_dict(small_gpt)
    data["edges"][3]["src"] = "ghost"
    with pytest.raises(InputError, match=r"edges\[3\]\.src: dangling edge ghost->.*'ghost'"):
        OpGraph.from_dict(data)

    data = _graph_dict(small_gpt)
    node = next(n for n in data["nodes"] if n["kind"] == "linear")
    node["fwd_flops"] = -5
    with pytest.raises(
        InputError, match=r"graph\.nodes\.\d+\.fwd_flops: .*greater than or equal to 0"
    ):
        OpGraph.from_dict(data)

    data = _graph_dict(small_gpt)
    node = next(n for n in data["nodes"] if n["kind"] == "linear")
    node["outputs"][0]["shape"][0] = -1
    with pytest.raises(
        InputError, match=r"graph\.nodes\.\d+\.outputs\.0\.shape\.0: .*greater than or equal to 0"
    ):
        OpGraph.from_dict(data)

    data = _graph_dict(small_gpt)
    data["edges"][0]["bytes"] = -1
    with pytest.raises(InputError, match=r"graph\.edges\.0\.bytes: .*greater than or equal to 0"):
        OpGraph.from_dict(data)

    data = _graph_dict(small_gpt)
    del data["nodes"][1]["kind"]
    with pytest.raises(InputError, match=r"graph\.nodes\.1\.kind: Field required"):
        OpGraph.from_dict(data)


def test_every_family_traces():
    for name, cfg in [
        ("llama3-8b", {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 2, "ffn_hidden": 512}),
        ("moe-380m", {"layers": 2, "hidden": 128, "heads": 4, "experts": 4}),
    ]:
        g = trace(
            resolve(ModelSpec(name=name, config=cfg)).build(),
            resolve(ModelSpec(name=name, config=cfg)).example_inputs(2, 32),
            strip_prefix="model.",
        )
        assert g.num_layers == 2
        assert g.param_count == resolve(ModelSpec(name=name, config=cfg)).param_count
        kinds = {n.kind for n in g.nodes}
        assert {"linear", "attention", "norm", "loss"} <= kinds
        if name.startswith("moe"):
            assert "einsum" in kinds


def test_graphs_without_blocks_get_balanced_layers():
    from planner.graph.batch import cluster_layers

    torch.manual_seed(0)
    with torch.device("meta"):
        body = torch.nn.Sequential(
            *[m for _ in range(6) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())]
        )
    x = torch.zeros(4, 256, device="meta")

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = body

        def forward(self, x):
            return self.body(x).sum()

    graph = trace(Loss(), (x,))
    assert graph.num_layers == 0
    clustered = cluster_layers(graph)
    assert clustered.num_layers == 6
    per_layer = [sum(n.fwd_flops for n in clustered.nodes if n.layer == i) for i in range(6)]
    assert len(set(per_layer)) == 1  # six equal linears, one per layer
    assert cluster_layers(clustered) is clustered


def test_a_one_block_model_is_planned_on_its_one_layer(tmp_path):
    """Its plan covers the model's one layer (not pseudo-layers cut by cost, which the Plan
    contract refuses: stages cover the model's blocks) and loads."""
    from api.cli import main as cli_main
    from planner.plan import Plan

    out = tmp_path / "plan.json"
    args = ["plan", "--model", "gpt-350m", "--config", "layers=1", "hidden=64", "heads=4"]
    args += ["vocab=128", "--cluster", "cpu-local", "--global-batch", "8", "--seq", "16"]
    assert cli_main([*args, "--no-baselines", "-o", str(out)]) == 0
    plan = Plan.from_json(out.read_text())
    assert [st.layers for st in plan.stages] == [[0, 1]]


@pytest.mark.parametrize("name", ["gpt-350m", "moe-380m", "llama3-8b"])
def test_costs_are_linear_in_the_batch(name):
    """The search traces at micro-batch 1 and rescales; that must be exact."""
    cfg = {"layers": 2, "hidden": 256, "heads": 4}
    if name.startswith("llama"):
        cfg.update(kv_heads=2, ffn_hidden=512)
    g1 = traced(name, batch=1, seq=128, **cfg)
    g2 = traced(name, batch=2, seq=128, **cfg)
    g4 = traced(name, batch=4, seq=128, **cfg)
    exact = extrapolate_batch(g1, g2, 4)
    # Everything but the recorded op arguments (a view's sizes), which the planner reads
    # only for dims, is exactly the batch-4 trace.
    assert [n.model_dump(exclude={"attrs"}) for n in exact.nodes] == [
        n.model_dump(exclude={"attrs"}) for n in g4.nodes
    ]
    assert exact.edges == g4.edges
    scaled = rescale_batch(g1, 4)  # the one-trace path, for graph files
    assert scaled.train_flops == g4.train_flops
    # Saved bytes: exact but for a few batch-independent scalars the loss keeps.
    assert scaled.total("saved_bytes") == pytest.approx(g4.total("saved_bytes"), rel=1e-4)


def test_a_one_block_model_keeps_its_one_layer_at_every_micro_batch():
    """A one-block model is planned on its one block (cost-balanced pseudo-layers would give
    stages that do not cover the model's layers, which the Plan contract refuses): the graph
    at every micro-batch size has the base trace's one layer."""
    from tests.conftest import planning_inputs

    training = {"global_batch_size": 8, "seq_len": 16, "dtype": "fp32"}
    config = {"layers": 1, "hidden": 64, "heads": 4, "vocab": 128}
    inputs = planning_inputs({"name": "gpt-350m", "config": config}, training, "cpu-local")
    assert inputs.second is not None and inputs.base.num_layers == 1
    for mbs in (1, 2, 4, 8):
        graph = inputs.at(mbs)
        assert [n.layer for n in graph.nodes] == [n.layer for n in inputs.base.nodes]
        assert graph.train_flops == mbs * inputs.at(1).train_flops


def test_a_resized_graph_checks_its_values_and_only_trusts_an_unchanged_structure(small_gpt):
    data = small_gpt.data
    nodes = list(data.nodes)
    i = next(k for k, n in enumerate(nodes) if n.kind == "linear")
    nodes[i] = nodes[i].model_copy(update={"fwd_flops": -5})  # model_copy does not validate
    with pytest.raises(InputError, match=r"nodes\[.*\]\.fwd_flops: negative value -5"):
        OpGraph.resized(data.model_copy(update={"nodes": nodes}), small_gpt)
    # another structure (an edge to a node that does not exist) is checked whole
    edges = list(data.edges)
    edges[3] = edges[3].model_copy(update={"src": "ghost"})
    with pytest.raises(InputError, match=r"edges\[3\]\.src: dangling edge ghost->"):
        OpGraph.resized(data.model_copy(update={"edges": edges}), small_gpt)
    same = OpGraph.resized(data.model_copy(update={"batch": 3}), small_gpt)
    assert same.data.batch == 3 and same.summary()["nodes"] == small_gpt.summary()["nodes"]
