from importlib import resources

import pytest
import yaml

from planner.cluster.profile import bundled_names, load_cluster
from planner.errors import InputError

REQUIRED = ["aws-p3.16xlarge", "cpu-local", "dgx-a100-80g", "dgx-h100", "h200"]


def test_bundled_profiles_load_with_sources():
    assert set(REQUIRED) <= set(bundled_names())
    for name in REQUIRED:
        profile = load_cluster(name)
        assert profile.name == name
        assert profile.sources, f"{name} cites no source"
        assert load_cluster(name).content_hash == profile.content_hash


def test_nodes_override():
    p3 = load_cluster("aws-p3.16xlarge", nodes=8)
    assert p3.num_devices == 64
    assert p3.content_hash != load_cluster("aws-p3.16xlarge").content_hash
    with pytest.raises(InputError, match="--nodes"):
        load_cluster("aws-p3.16xlarge", nodes=0)


def test_group_link_uses_the_right_tier():
    dgx = load_cluster("dgx-a100-80g", nodes=2)
    bw, lat, crosses = dgx.group_link(list(range(8)))
    assert (bw, lat, crosses) == (300e9, 5e-6, False)
    # One device per node in the group: 8 such groups share each node's 200 GB/s.
    bw, lat, crosses = dgx.group_link([0, 8])
    assert (bw, crosses) == (200e9 / 8, True)
    # Whole nodes in the group: the node's NICs serve it alone (capped by NVLink).
    bw, _, _ = dgx.group_link(list(range(16)))
    assert bw == 200e9


def _write(tmp_path, mutate):
    source = resources.files("cluster_profiles") / "dgx-a100-80g.yaml"
    data = yaml.safe_load(source.read_text())
    mutate(data)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (
            lambda d: d["links"]["intra_node"].update(bandwidth=0),
            r"cluster\.links\.intra_node\.bandwidth",
        ),
        (
            lambda d: d["device"].pop("memory_bytes"),
            r"cluster\.device\.memory_bytes: Field required",
        ),
        (lambda d: d["device"]["peak_flops"].update(fp4=1e15), r"cluster\.device\.peak_flops\.fp4"),
        (lambda d: d.update(nodes=-1), r"cluster\.nodes"),
        (lambda d: d["efficiency"].update(matmul=1.5), r"cluster\.efficiency\.matmul"),
        (lambda d: d.update(colour="blue"), r"cluster\.colour: Extra inputs"),
    ],
)
def test_invalid_profiles_name_the_field(tmp_path, mutate, field):
    with pytest.raises(InputError, match=field):
        load_cluster(_write(tmp_path, mutate))


def test_unknown_cluster_and_bad_yaml(tmp_path):
    with pytest.raises(InputError, match=r"--cluster: unknown cluster 'tpu-pod'.*dgx-a100-80g"):
        load_cluster("tpu-pod")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(InputError, match="not valid YAML"):
        load_cluster(str(bad))
    with pytest.raises(InputError, match="cannot read"):
        load_cluster(str(tmp_path / "missing.yaml"))


def test_unknown_dtype_names_the_field():
    with pytest.raises(
        InputError, match=r"dtype: device V100-SXM2-16GB has no peak FLOP/s for 'bf16'"
    ):
        load_cluster("aws-p3.16xlarge").peak_flops("bf16")
