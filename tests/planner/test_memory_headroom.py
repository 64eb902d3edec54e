"""Memory headroom (planner/cluster/headroom.py): device memory every plan leaves free.
Plans must fit in the rest; the default keeps 5%; the request can name a share or an amount,
and a bad value is an error naming the field."""

import subprocess
import sys

import pytest

from api.cli.main import main
from planner.cluster.headroom import DEFAULT_HEADROOM, headroom_bytes, with_headroom
from planner.cluster.profile import load_cluster
from planner.errors import InputError
from planner.request import resolve_request
from planner.search.search import search
from planner.search.space import SearchOptions

GIB = 2**30


def test_shares_and_amounts_are_read_as_people_write_them():
    memory = 80 * GIB
    assert headroom_bytes(None, memory, "f") == int(memory * DEFAULT_HEADROOM)
    assert headroom_bytes(0, memory, "f") == 0
    assert headroom_bytes(0.1, memory, "f") == 8 * GIB
    assert headroom_bytes("10%", memory, "f") == 8 * GIB
    assert headroom_bytes("0.1", memory, "f") == 8 * GIB
    assert headroom_bytes("4GiB", memory, "f") == 4 * GIB
    assert headroom_bytes("512 MiB", memory, "f") == 512 * 2**20
    for bad in ("-1", "95%", "4GB", "lots", True, [1], "79GiB"):
        with pytest.raises(InputError) as err:
            headroom_bytes(bad, memory, "cluster.memory_headroom")
        assert err.value.field == "cluster.memory_headroom"


def _inputs(headroom):
    cluster = with_headroom(load_cluster("aws-p3.16xlarge").with_nodes(1), headroom)
    training = {"global_batch_size": 16, "seq_len": 1024, "dtype": "fp16"}
    return resolve_request({"name": "gpt-760m"}, cluster, training).trace()


def test_the_search_leaves_the_headroom_free():
    options = SearchOptions(mesh=(1, 8, 1), layouts=("megatron",), executable_only=True, top_k=1)
    bare = search(_inputs(0), options).plan
    memory = bare.request.cluster.device_memory_bytes
    peak = bare.predicted.peak_memory_bytes
    assert bare.request.cluster.memory_headroom_bytes == 0
    # keep free just more than the bare plan leaves: it no longer fits, another one is chosen
    kept_mib = (memory - peak) // 2**20 + 1
    kept = kept_mib * 2**20
    tight = search(_inputs(f"{kept_mib}MiB"), options).plan
    assert tight.request.cluster.memory_headroom_bytes == kept
    assert tight.predicted.peak_memory_bytes <= memory - kept
    assert tight.predicted.step_time_s >= bare.predicted.step_time_s
    assert any(f"less {kept / GIB:.1f} GiB headroom" in line for line in tight.explanation)


def test_cli_estimate_reads_the_flag_and_names_it_in_errors(capsys):
    args = [
        "estimate", "--model", "gpt-760m", "--cluster", "aws-p3.16xlarge", "--nodes", "1",
        "--dp", "8", "--global-batch", "16", "--dtype", "fp16", "--json",
    ]  # fmt: skip
    assert main([*args, "--memory-headroom", "25%"]) == 0
    import json

    plan = json.loads(capsys.readouterr().out)
    assert plan["request"]["cluster"]["memory_headroom_bytes"] == 4 * GIB  # 25% of 16 GiB
    assert main([*args]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["request"]["cluster"]["memory_headroom_bytes"] == int(16 * GIB * 0.05)
    out = subprocess.run(
        [sys.executable, "-m", "api.cli", *args, "--memory-headroom", "4GB"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "--memory-headroom" in out.stderr
    assert "Traceback" not in out.stderr
