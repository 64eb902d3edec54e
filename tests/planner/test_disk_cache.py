"""The on-disk cache of traces and ILP layouts: a hit returns what was stored, a changed
model misses, and a corrupted entry is detected, removed and rebuilt."""

import gzip
import json

import pytest

from planner import disk_cache
from planner.cluster.profile import load_cluster
from planner.graph import trace_cache
from planner.models import ModelSpec, resolve
from planner.request import resolve_request
from planner.search.layout_cache import LayoutCache
from planner.search.search import search
from planner.search.space import SearchOptions

TINY = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    calls = []
    real = trace_cache.trace_model

    def counting(*args, **kw):
        calls.append(args[1:])
        return real(*args, **kw)

    monkeypatch.setattr(trace_cache, "trace_model", counting)
    return tmp_path, calls


def _entries(root, kind):
    return sorted((root / kind).glob("*.json.gz"))


def test_a_trace_is_stored_and_reused(cache):
    root, calls = cache
    model = resolve(ModelSpec(name="gpt-350m", config=TINY))
    first = trace_cache.trace_cached(model, 1, 32, "bf16")
    again = trace_cache.trace_cached(model, 1, 32, "bf16")
    assert len(calls) == 1 and len(_entries(root, "trace")) == 1
    assert again.to_dict() == first.to_dict()


def test_a_changed_config_misses(cache):
    root, calls = cache
    trace_cache.trace_cached(resolve(ModelSpec(name="gpt-350m", config=TINY)), 1, 32, "bf16")
    wider = {**TINY, "hidden": 96}
    graph = trace_cache.trace_cached(
        resolve(ModelSpec(name="gpt-350m", config=wider)), 1, 32, "bf16"
    )
    trace_cache.trace_cached(resolve(ModelSpec(name="gpt-350m", config=TINY)), 2, 32, "bf16")
    assert len(calls) == 3 and len(_entries(root, "trace")) == 3
    assert any(96 in p.shape for n in graph.nodes for p in n.params.values() if len(p.shape) == 2)


def test_traces_side_by_side_match_one_after_the_other(cache, tmp_path, monkeypatch):
    root, calls = cache
    model = resolve(ModelSpec(name="gpt-350m", config=TINY))
    both = trace_cache.trace_batches(model, (1, 2), 32, "bf16", workers=2)
    assert len(calls) == 1  # this process traced batch 1, a forked worker batch 2
    assert len(_entries(root, "trace")) == 2  # the worker stored its trace too
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "serial"))
    serial = trace_cache.trace_batches(model, (1, 2), 32, "bf16", workers=1)
    assert [g.to_dict() for g in both] == [g.to_dict() for g in serial]
    assert [g.data.batch for g in both] == [1, 2]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "tampered"])
def test_a_corrupted_entry_is_detected_and_rebuilt(cache, damage):
    root, calls = cache
    model = resolve(ModelSpec(name="gpt-350m", config=TINY))
    want = trace_cache.trace_cached(model, 1, 32, "bf16").to_dict()
    (path,) = _entries(root, "trace")
    raw = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"not a cache entry")
    elif damage == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    else:  # valid gzip and JSON, but a figure changed behind the checksum's back
        header, _, text = gzip.decompress(raw).partition(b"\n")
        payload = json.loads(text)
        payload["nodes"][3]["fwd_flops"] += 1
        path.write_bytes(gzip.compress(header + b"\n" + json.dumps(payload).encode()))
    got = trace_cache.trace_cached(model, 1, 32, "bf16")
    assert len(calls) == 2  # detected: traced again
    assert got.to_dict() == want
    assert disk_cache.load("trace", path.name.removesuffix(".json.gz")) is not None  # rebuilt


def test_ilp_layouts_are_reused_and_keyed_by_the_request(cache):
    del cache  # the fixture points the cache at a fresh directory
    cluster = load_cluster("dgx-a100-80g")
    request = {"name": "gpt-350m", "config": TINY}
    training = {"global_batch_size": 8, "seq_len": 32, "dtype": "bf16"}
    inputs = resolve_request(request, cluster, training).trace()
    first = LayoutCache(inputs, SearchOptions(), lambda *_: None)
    first.prepare([(1, 2), (1, 4)])
    second = LayoutCache(inputs, SearchOptions(), lambda *_: None)
    second.prepare([(1, 2), (1, 4)])
    assert (first.ilp_calls, first.cache_hits) == (2, 0)
    assert (second.ilp_calls, second.cache_hits) == (0, 2)
    for tp in (2, 4):
        assert second.get("ilp", 1, tp) == first.get("ilp", 1, tp)
    # the node count is not part of the key (a layout is per tp group, whose links depend
    # on the devices per node): `autopar size` reuses it across cluster sizes
    bigger = resolve_request(request, cluster.with_nodes(2), training).trace()
    third = LayoutCache(bigger, SearchOptions(), lambda *_: None)
    third.prepare([(1, 2)])
    assert (third.ilp_calls, third.cache_hits) == (0, 1)
    # another device memory budget (a headroom kept free) is another ILP: solved again
    from planner.cluster.headroom import with_headroom

    tighter = resolve_request(request, with_headroom(cluster, "25%"), training).trace()
    fourth = LayoutCache(tighter, SearchOptions(), lambda *_: None)
    fourth.prepare([(1, 2)])
    assert (fourth.ilp_calls, fourth.cache_hits) == (1, 0)


def test_the_cache_can_be_switched_off(cache, monkeypatch):
    root, calls = cache
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", "off")
    model = resolve(ModelSpec(name="gpt-350m", config=TINY))
    trace_cache.trace_cached(model, 1, 32, "bf16")
    trace_cache.trace_cached(model, 1, 32, "bf16")
    assert len(calls) == 2 and not (root / "trace").exists()


def test_layouts_survive_the_compact_json(cache):
    del cache
    from planner.intra_op.layout_map import dump_layouts, load_layouts
    from planner.intra_op.node_layout import layouts_from_json, layouts_to_json

    cluster = load_cluster("dgx-a100-80g")
    training = {"global_batch_size": 8, "seq_len": 32, "dtype": "bf16"}
    request = {"name": "gpt-350m", "config": {**TINY, "layers": 4}}
    inputs = resolve_request(request, cluster, training).trace()
    layouts = LayoutCache(inputs, SearchOptions(), lambda *_: None)
    layouts.prepare([(1, 2)])
    for kind in ("ilp", "megatron"):
        laid = layouts.get(kind, 1, 2)
        stored = layouts_to_json(laid)
        assert len(stored["layouts"]) < len(laid)  # identical layers' layouts written once
        assert layouts_from_json(json.loads(json.dumps(stored))) == laid
        shared = dump_layouts(laid)  # what the cache writes: copied layers are not written
        assert len(shared["own"]["nodes"]) < len(stored["nodes"])
        assert load_layouts(json.loads(json.dumps(shared)), layouts.graph(1)) == laid


def test_workers_without_a_disk_cache_plan_the_same(monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", "off")
    cluster = load_cluster("dgx-a100-80g")
    request = {"name": "gpt-350m", "config": {**TINY, "layers": 4}}
    training = {"global_batch_size": 16, "seq_len": 32, "dtype": "bf16"}
    plans = []
    for workers in (1, 2):
        inputs = resolve_request(request, cluster, training).trace(workers=workers)
        plans.append(search(inputs, SearchOptions(workers=workers)).plan)
    assert plans[0].model_dump(exclude={"search"}) == plans[1].model_dump(exclude={"search"})


def test_a_warm_search_reads_tables_and_plans_the_same(cache):
    root, calls = cache
    cluster = load_cluster("dgx-a100-80g")
    request = {"name": "gpt-350m", "config": {**TINY, "layers": 4}}
    training = {"global_batch_size": 16, "seq_len": 32, "dtype": "bf16"}

    def plan():
        inputs = resolve_request(request, cluster, training).trace()
        return search(inputs, SearchOptions()).plan

    cold = plan()
    assert _entries(root, "table")
    (root / "ilp").rename(root / "ilp-gone")  # layouts lost: the winner's is solved again
    warm = plan()
    assert len(calls) == 2  # traced once per micro-batch size, then read
    assert cold.search.ilp_calls > 0 and warm.search.ilp_calls <= 1
    strip = {"search"}
    assert warm.model_dump(exclude=strip) == cold.model_dump(exclude=strip)


def test_edited_planner_code_misses(cache, monkeypatch):
    root, calls = cache
    model = resolve(ModelSpec(name="gpt-350m", config=TINY))
    trace_cache.trace_cached(model, 1, 32, "bf16")
    monkeypatch.setattr(disk_cache, "_planner_digest", lambda: "another version of the code")
    trace_cache.trace_cached(model, 1, 32, "bf16")
    assert len(calls) == 2 and len(_entries(root, "trace")) == 2


@pytest.mark.parametrize("cache_dir", ["off", "fresh"])
def test_tables_built_side_by_side_equal_those_built_one_by_one(cache_dir, tmp_path, monkeypatch):
    """build_all's pool (one task per layout, priced per fp8 recipe) gives the tables
    table() builds one at a time, and names a tp of 1 as table() does."""
    from planner.parallel import fp8

    where = "off" if cache_dir == "off" else str(tmp_path)
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", where)
    cluster = load_cluster("dgx-h100")  # bf16 on H100: the fp8 recipes' tables too
    config = {"layers": 3, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn_hidden": 128}
    request = {"name": "llama3-8b", "config": config}
    training = {"global_batch_size": 8, "seq_len": 64, "dtype": "bf16"}
    inputs = resolve_request(request, cluster, training).trace()
    kinds = ["megatron", "megatron_sp", fp8.table_kind("megatron_sp", "tensorwise"), "ideal"]
    wanted = [(kind, mbs, tp) for kind in kinds for mbs in (1, 2) for tp in (1, 2, 4)]
    pooled = LayoutCache(inputs, SearchOptions(workers=2), lambda *_: None)
    pooled.build_all(wanted, "tables")
    serial = LayoutCache(inputs, SearchOptions(workers=1), lambda *_: None)
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", "off")  # each one built here, none read back
    for kind, mbs, tp in wanted:
        want = serial.table(kind, mbs, tp)
        if tp == 1 and kind != "ideal":
            kind = fp8.table_kind("megatron", fp8.split_kind(kind)[1])
        assert pooled.tables[(kind, mbs, tp)].to_json() == want.to_json(), (kind, mbs, tp)
    assert ("megatron_sp", 1, 1) not in pooled.tables  # one table for tp 1's layouts
