"""Cluster: local clusters, schema-version-1 cluster files and their errors (version 2: test_cluster_v2.py)."""

from __future__ import annotations

import dataclasses

import pytest

from adaptdist.calibrate.local import load_cluster, local_cluster, uniform_host
from adaptdist.cluster import Cluster
from adaptdist.cluster_file import SCHEMA_VERSION, cluster_from_dict, cluster_to_dict, save_cluster
from adaptdist.errors import AdaptdistError, ClusterSpecError


def write(tmp_path, text: str, name: str = "cluster.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def load_error(tmp_path, text: str) -> str:
    p = write(tmp_path, text)
    with pytest.raises(ClusterSpecError) as ei:
        load_cluster(p)
    msg = str(ei.value)
    assert "cluster.yaml" in msg, msg  # every file error names the file
    return msg


# --- local_cluster -------------------------------------------------------------------------------

def test_local():
    c = local_cluster(3)
    assert c.world_size == 3
    assert c.device_kind == "cpu"
    assert c.backend == "gloo"
    assert [h.name for h in c.hosts] == ["localhost"] and c.hosts[0].num_devices == 3
    assert [d.rank for d in c.devices] == [0, 1, 2] and all(d.kind == "cpu" for d in c.devices)
    assert c.hosts == (uniform_host("localhost", "cpu", 3),)
    assert repr(c) == "Cluster(localhost:3xcpu)"
    assert not c.calibrated and c.collective_fit("all_reduce", "intra_host") is None


def test_local_cuda_backend_is_nccl():
    assert local_cluster(2, "cuda").backend == "nccl"


@pytest.mark.parametrize("n", [0, -2, 1.5, "2", None, True])
def test_local_bad_nproc(n):
    with pytest.raises(ClusterSpecError, match="positive"):
        local_cluster(n)


def test_local_bad_device_kind():
    with pytest.raises(ClusterSpecError, match="device_kind 'tpu'"):
        local_cluster(2, "tpu")


def test_errors_are_adaptdist_errors():
    assert issubclass(ClusterSpecError, AdaptdistError)


# --- load_cluster: valid ------------------------------------------------------------------------------

def test_from_yaml_valid(tmp_path):
    p = write(tmp_path, "schema_version: 1\nhosts:\n  - {name: localhost, device_kind: cpu, num_devices: 2}\n")
    c = load_cluster(p)
    assert c == local_cluster(2)
    assert c.world_size == 2 and c.backend == "gloo"


def test_from_yaml_two_hosts_and_round_trip(tmp_path):
    p = write(tmp_path, """\
schema_version: 1
hosts:
  - name: a
    device_kind: cpu
    num_devices: 2
  - name: b
    device_kind: cpu
    num_devices: 3
""")
    c = load_cluster(str(p))
    assert [h.name for h in c.hosts] == ["a", "b"]
    assert c.world_size == 5
    assert cluster_to_dict(c)["schema_version"] == SCHEMA_VERSION
    assert cluster_from_dict(cluster_to_dict(c)) == c


def test_from_yaml_cuda(tmp_path):
    p = write(tmp_path, "schema_version: 1\nhosts:\n  - {name: gpu0, device_kind: cuda, num_devices: 8}\n")
    c = load_cluster(p)
    assert c.device_kind == "cuda" and c.backend == "nccl" and c.world_size == 8


# --- load_cluster: errors -----------------------------------------------------------------------------

def test_file_missing(tmp_path):
    with pytest.raises(ClusterSpecError, match="does not exist") as ei:
        load_cluster(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(ei.value)


def test_not_yaml(tmp_path):
    msg = load_error(tmp_path, "hosts: [unclosed\n")
    assert "not valid YAML" in msg


def test_not_utf8(tmp_path):
    p = tmp_path / "cluster.yaml"
    p.write_bytes(b"schema_version: 1\nhosts: \xff\xfe\n")
    with pytest.raises(ClusterSpecError, match="cluster.yaml"):
        load_cluster(p)


def test_schema_version_missing(tmp_path):
    msg = load_error(tmp_path, "hosts:\n  - {name: h, device_kind: cpu, num_devices: 2}\n")
    assert "'schema_version'" in msg and "missing" in msg


@pytest.mark.parametrize("version", ["3", "'1'", "0", "true", "1.0", "'2'"])
def test_schema_version_wrong(tmp_path, version):
    msg = load_error(tmp_path, f"schema_version: {version}\nhosts:\n  - {{name: h, device_kind: cpu, num_devices: 2}}\n")
    assert "'schema_version'" in msg and "version 1" in msg and f"version {SCHEMA_VERSION}" in msg


def test_version_1_round_trips_as_version_2(tmp_path):
    c = load_cluster(write(tmp_path, "schema_version: 1\nhosts:\n  - {name: h, device_kind: cpu, num_devices: 2}\n"))
    assert SCHEMA_VERSION == 2 and cluster_to_dict(c)["schema_version"] == 2
    out = tmp_path / "v2.yaml"
    save_cluster(c, out)
    assert load_cluster(out) == c


def test_hosts_missing(tmp_path):
    msg = load_error(tmp_path, "schema_version: 1\n")
    assert "'hosts'" in msg and "missing" in msg


@pytest.mark.parametrize("hosts", ["[]", "localhost", "{name: h}"])
def test_hosts_not_a_nonempty_list(tmp_path, hosts):
    msg = load_error(tmp_path, f"schema_version: 1\nhosts: {hosts}\n")
    assert "'hosts'" in msg and "non-empty list" in msg


def test_host_not_a_mapping(tmp_path):
    msg = load_error(tmp_path, "schema_version: 1\nhosts:\n  - localhost\n")
    assert "'hosts[0]'" in msg and "mapping" in msg


@pytest.mark.parametrize("field", ["name", "device_kind", "num_devices"])
def test_host_field_missing(tmp_path, field):
    h = {"name": "h", "device_kind": "cpu", "num_devices": 2}
    del h[field]
    body = ", ".join(f"{k}: {v}" for k, v in h.items())
    msg = load_error(tmp_path, f"schema_version: 1\nhosts:\n  - {{{body}}}\n")
    assert f"'hosts[0].{field}'" in msg and "missing" in msg


@pytest.mark.parametrize("field,value", [("num_devices", '"two"'), ("num_devices", "2.0"), ("num_devices", "true"),
                                         ("name", "3"), ("device_kind", "[cpu]")])
def test_host_field_wrong_type(tmp_path, field, value):
    h = {"name": "h", "device_kind": "cpu", "num_devices": "2", field: value}
    body = ", ".join(f"{k}: {v}" for k, v in h.items())
    msg = load_error(tmp_path, f"schema_version: 1\nhosts:\n  - {{{body}}}\n")
    assert f"'hosts[0].{field}'" in msg and "must be" in msg


def test_bad_device_kind(tmp_path):
    msg = load_error(tmp_path, "schema_version: 1\nhosts:\n  - {name: h, device_kind: tpu, num_devices: 2}\n")
    assert "device_kind 'tpu'" in msg and "'cpu'" in msg and "'cuda'" in msg


@pytest.mark.parametrize("n", [0, -1])
def test_num_devices_not_positive(tmp_path, n):
    msg = load_error(tmp_path, f"schema_version: 1\nhosts:\n  - {{name: h, device_kind: cpu, num_devices: {n}}}\n")
    assert "num_devices" in msg and "positive" in msg


def test_unknown_host_key(tmp_path):
    msg = load_error(tmp_path, "schema_version: 1\nhosts:\n  - {name: h, device_kind: cpu, num_devices: 2, gpus: 4}\n")
    assert "'hosts[0]'" in msg and "unknown keys" in msg and "gpus" in msg


def test_unknown_top_level_key(tmp_path):
    msg = load_error(tmp_path, "schema_version: 1\nlinks: []\nhosts:\n  - {name: h, device_kind: cpu, num_devices: 2}\n")
    assert "unknown top-level keys" in msg and "links" in msg


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n", "42\n"])
def test_not_a_mapping(tmp_path, text):
    msg = load_error(tmp_path, text)
    assert "mapping" in msg


def test_duplicate_host_names(tmp_path):
    msg = load_error(tmp_path, """\
schema_version: 1
hosts:
  - {name: a, device_kind: cpu, num_devices: 1}
  - {name: a, device_kind: cpu, num_devices: 2}
""")
    assert "duplicate host names" in msg


def test_mixed_device_kinds_load_but_have_no_single_backend(tmp_path):
    c = load_cluster(write(tmp_path, """\
schema_version: 1
hosts:
  - {name: a, device_kind: cpu, num_devices: 1}
  - {name: b, device_kind: cuda, num_devices: 2}
"""))
    assert c.device_kinds == ("cpu", "cuda") and c.world_size == 3
    assert [c.device(r).kind for r in range(3)] == ["cpu", "cuda", "cuda"]
    assert c.link(0, 1).tier == "inter_host" and c.link(1, 2).tier == "intra_host"
    for attr in ("backend", "device_kind"):
        with pytest.raises(ClusterSpecError) as ei:
            getattr(c, attr)
        msg = str(ei.value)
        assert "mixes device kinds" in msg and "'cpu'" in msg and "'cuda'" in msg and "gloo" in msg and "nccl" in msg


def test_empty_cluster_direct():
    with pytest.raises(ClusterSpecError, match="at least one host"):
        Cluster(())


# --- frozen ----------------------------------------------------------------------------------------

def test_frozen():
    c = local_cluster(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hosts = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hosts[0].num_devices = 4  # type: ignore[misc]
    assert isinstance(c.hosts, tuple)
    assert hash(c) == hash(local_cluster(2))


# --- the file schema takes its figures from the caller --------------------------------------------

def test_version_1_needs_the_callers_estimates(tmp_path):
    from adaptdist import cluster_file
    from adaptdist.calibrate.local import estimated_cluster

    p = write(tmp_path, "schema_version: 1\nhosts:\n  - {name: a, device_kind: cpu, num_devices: 2}\n"
                        "  - {name: b, device_kind: cpu, num_devices: 1}\n")
    with pytest.raises(ClusterSpecError, match="no figures.*adaptdist.calibrate.local.load_cluster"):
        cluster_file.load_cluster(p)
    c = cluster_file.load_cluster(p, estimated_cluster)
    assert c == load_cluster(p) and [h.ranks for h in c.hosts] == [(0, 1), (2,)]
    assert c.tiers == ("intra_host", "inter_host") and not c.calibrated
    seen = []
    assert cluster_file.load_cluster(p, lambda hosts: seen.append(hosts) or local_cluster(3)) == local_cluster(3)
    assert seen == [(("a", "cpu", 2), ("b", "cpu", 1))]
