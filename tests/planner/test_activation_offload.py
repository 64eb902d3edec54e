"""Activation offload (planner/parallel/activation_offload.py): layer activations copied to
host memory and back instead of recomputed. The search takes it where the host link moves a
layer's activations faster than the device recomputes it, and checkpointing where it does
not; its terms are checked against figures computed here from the table and the profile.
The executor runs it (saved-tensor hooks) against the single-process reference:
tests/executor/test_activation_offload.py."""

import pytest

from planner.cluster.profile import load_cluster
from planner.errors import InputError
from planner.evaluate.config import ParallelConfig
from planner.evaluate.predict import predict
from planner.parallel.activation_offload import MODE as OFFLOAD
from planner.request import resolve_request
from planner.search.search import search
from planner.search.space import SearchOptions

GIB = 2**30
MODEL = {"name": "gpt-1.3b"}
TRAINING = {"global_batch_size": 64, "seq_len": 2048, "dtype": "fp16"}


def _inputs(link: float | None = None, memory_gib: float = 16.0):
    """GPT-1.3B at 2,048 tokens on 8 V100 (activations, not state, are the problem), with
    the host link of the profile or `link` bytes/s."""
    cluster = load_cluster("aws-p3.16xlarge").with_nodes(1)
    device = cluster.device.model_copy(update={"memory_bytes": int(memory_gib * GIB)})
    host = (
        cluster.host if link is None else cluster.host.model_copy(update={"link_bandwidth": link})
    )
    cluster = cluster.model_copy(update={"device": device, "host": host})
    return resolve_request(MODEL, cluster, TRAINING).trace()


def _options(**pins) -> SearchOptions:
    # eight samples of 2,048 tokens per micro-batch: the activations do not fit as they are
    return SearchOptions(
        mesh=(1, 8, 1),
        microbatch_sizes=(8,),
        layouts=("megatron",),
        executable_only=True,
        offload=False,
        **pins,
    )


def test_offload_wins_over_recompute_only_where_the_host_link_is_faster():
    # The datasheet's PCIe 3 link (16 GB/s one way) moves a layer's activations far slower
    # than a V100 recomputes them: checkpointing wins
    slow = search(_inputs(), _options()).plan
    assert not any(st.activation_offload for st in slow.stages)
    assert all(st.activation_checkpointing for st in slow.stages)
    pinned = search(_inputs(), _options(checkpointing=(OFFLOAD,))).plan
    assert all(st.activation_offload and not st.activation_checkpointing for st in pinned.stages)
    assert pinned.predicted.step_time_s > slow.predicted.step_time_s
    # a link 1,000x faster makes the copies cheaper than any recomputation: offload wins
    fast = search(_inputs(link=16e12), _options()).plan
    assert all(st.activation_offload for st in fast.stages), fast.explanation
    assert fast.predicted.step_time_s < slow.predicted.step_time_s


def test_copies_host_memory_and_device_memory_follow_the_table():
    inputs = _inputs()
    cluster, training = inputs.cluster, inputs.training
    cfg = ParallelConfig(dp=8, tp=1, pp=1, microbatches=4, zero=1, checkpointing=OFFLOAD)
    base = ParallelConfig(dp=8, tp=1, pp=1, microbatches=4, zero=1)
    mbs = cfg.microbatch_size(training.global_batch_size)
    graph = inputs.at(mbs)
    offloaded = predict(graph, cluster, training, cfg)
    kept = predict(graph, cluster, training, base)
    layers = [n for n in graph.nodes if n.layer is not None and n.layer >= 0]
    saved_per_layer = {}
    for n in layers:
        saved_per_layer[n.layer] = saved_per_layer.get(n.layer, 0) + n.saved_bytes
    inside = sum(saved_per_layer.values())
    link = cluster.host.link_bandwidth
    # 1F1B on one stage keeps one micro-batch in flight: the host holds one set of layers
    assert offloaded.host_bytes == pytest.approx(inside, rel=1e-6)
    # time: every saved byte out and back over the link, per micro-batch, not hidden
    extra = offloaded.pipeline_s - kept.pipeline_s
    assert extra == pytest.approx(4 * 2 * inside / link, rel=1e-6)
    # device: the activations outside the layers stay; a layer's backward holds the
    # gradient of its input and three of its largest output's size (the largest op's input
    # brought back, the gradient arriving and the one it makes), once the head's backward
    # has freed what the head saved; or the loss's buffers on top of all that stays
    outside = sum(n.saved_bytes for n in graph.nodes if n.layer is None)
    last = max(i for i, n in enumerate(graph.nodes) if n.layer is not None)
    head = sum(n.saved_bytes for n in graph.nodes[last:] if n.layer is None)
    transit = max(
        nodes[0].inputs[0].nbytes + 3 * max(n.outputs[0].nbytes for n in nodes if n.outputs)
        for nodes in ([n for n in layers if n.layer == k] for k in saved_per_layer)
    )
    workspace = kept.stages[0].memory.activations - inside - outside
    expected = max(outside + workspace, outside - head + transit)
    assert offloaded.stages[0].memory.activations == pytest.approx(expected, rel=1e-6)


def test_a_profile_without_a_host_link_refuses_it():
    inputs = _inputs()
    bare = inputs.cluster.model_copy(update={"host": None})
    cfg = ParallelConfig(dp=8, tp=1, pp=1, microbatches=4, checkpointing=OFFLOAD)
    with pytest.raises(InputError) as err:
        cfg.validate(bare, 64, 24)
    assert err.value.field == "stages[].activation_offload"


def test_graph_mode_leaves_it_out_and_the_capability_table_decides(monkeypatch):
    import planner.executable as executable
    from planner.search.space import executable_options
    from tests.planner.test_search import graph_refusal

    options = SearchOptions(executable_only=True)
    assert graph_refusal("activation_offload") is not None
    assert OFFLOAD not in executable_options(options, "graph").checkpointing
    assert OFFLOAD in executable_options(options, "modules").checkpointing
    monkeypatch.setitem(executable.RUNS, "activation_offload", executable.BOTH_PATHS)
    assert graph_refusal("activation_offload") is None
    assert OFFLOAD in executable_options(options, "graph").checkpointing


def test_the_step_peak_holds_the_layers_outside_and_one_backward_in_transit():
    from planner.parallel.checkpointing import activation_bytes

    offload = activation_bytes(
        1000,
        4,
        OFFLOAD,
        largest_layer_saved=250,
        unchecked_saved_per_microbatch=50,
        saved_after_layers=40,
    )
    assert offload == 50 * 4 - 40 + 250


def test_every_surface_takes_it_as_a_checkpointing_value(tmp_path):
    """The declaration adds "offload" to the checkpointing pin: the CLI's flag, the
    service's `search.checkpointing` and autopar.plan's keyword take it alike."""
    from api.cli.main import build_parser
    from api.service.schemas import SearchInput
    from planner.pins import PINS
    from planner.request import search_options

    pin = next(p for p in PINS if p.name == "checkpointing")
    assert OFFLOAD in pin.choices and "offload (no recompute" in pin.help
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["plan"]
    flags = ["--model", "gpt-350m", "--cluster", "cpu-local", "--global-batch", "8"]
    args = sub.parse_args([*flags, "--checkpointing", OFFLOAD])
    assert pin.from_cli(args.checkpointing) == OFFLOAD
    body = SearchInput(checkpointing=OFFLOAD)
    assert search_options(body.model_dump(exclude_none=True)).checkpointing == (OFFLOAD,)
