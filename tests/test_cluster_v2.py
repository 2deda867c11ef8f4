"""Cluster schema version 2: devices, links, calibration, heterogeneity, fingerprint, errors; detect."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import yaml

from adaptdist.calibrate.fit import FitError, fit_alpha_beta
from adaptdist.cli import main
from adaptdist.calibrate.local import load_cluster, local_cluster, uniform_host
from adaptdist.cluster import COLLECTIVES, Calibration, Cluster, CollectiveFit, Device, FrozenMap, Host, Link
from adaptdist.cluster_file import save_cluster
from adaptdist.errors import ClusterSpecError


def cpu(rank, host="a", flops=1e11, **kw):
    d = {"rank": rank, "kind": "cpu", "cores": 1.0, "peak_flops": {"float32": flops},
         "memory_bytes": 8 * 2**30, "memory_bandwidth_bytes_per_s": 1e10}
    d.update(kw)
    return d


def cuda(rank, **kw):
    d = {"rank": rank, "kind": "cuda", "peak_flops": {"float32": 19.5e12, "bfloat16": 312e12},
         "memory_bytes": 80 * 10**9, "memory_bandwidth_bytes_per_s": 2.0e12}
    d.update(kw)
    return d


INTRA = {"tier": "intra_host", "bandwidth_bytes_per_s": 1.5e9, "latency_s": 2e-4}
INTER = {"tier": "inter_host", "bandwidth_bytes_per_s": 1.25e9, "latency_s": 5e-5}


def doc(hosts=None, links=None, **top):
    d = {"schema_version": 2,
         "hosts": hosts if hosts is not None else [{"name": "a", "devices": [cpu(0), cpu(1)]}],
         "links": links if links is not None else [INTRA]}
    d.update(top)
    return d


def load(tmp_path, d, name="cluster.yaml") -> Cluster:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return load_cluster(p)


def error(tmp_path, d) -> str:
    with pytest.raises(ClusterSpecError) as ei:
        load(tmp_path, d)
    msg = str(ei.value)
    assert "cluster.yaml" in msg, msg  # names the file
    return msg


def hetero_doc():
    return doc(hosts=[{"name": "cpuhost", "devices": [cpu(0, host="cpuhost"), cpu(1, host="cpuhost", flops=5e10)]},
                      {"name": "gpuhost", "devices": [cuda(2), cuda(3)]}],
               links=[INTRA, INTER, {"ranks": [2, 3], "bandwidth_bytes_per_s": 3e11, "latency_s": 3e-6}])


# --- valid files ---------------------------------------------------------------------------------

def test_v2_file_gives_per_device_figures_and_links(tmp_path):
    c = load(tmp_path, hetero_doc())
    assert c.world_size == 4 and c.device_kinds == ("cpu", "cuda")
    d0, d1, d2 = c.device(0), c.device(1), c.device(2)
    assert (d0.kind, d0.host, d0.peak_flops["float32"], d0.cores) == ("cpu", "cpuhost", 1e11, 1.0)
    assert d1.peak_flops["float32"] == 5e10  # per-device figures, not per host
    assert (d2.kind, d2.peak_flops["bfloat16"], d2.memory_bytes, d2.memory_bandwidth_bytes_per_s, d2.cores) == \
        ("cuda", 312e12, 80 * 10**9, 2.0e12, None)
    assert "bfloat16" not in d0.peak_flops
    assert c.link(0, 1) == Link("intra_host", 1.5e9, 2e-4)
    assert c.link(1, 0) == c.link(0, 1)
    assert c.link(1, 2) == Link("inter_host", 1.25e9, 5e-5)
    l23 = c.link(3, 2)  # the pair entry beats the tier default; its tier is implied
    assert (l23.tier, l23.bandwidth_bytes_per_s, l23.latency_s, l23.ranks) == ("intra_host", 3e11, 3e-6, (2, 3))
    assert math.isclose(l23.time_s(3e11), 1 + 3e-6)
    assert repr(c) == "Cluster(cpuhost:2xcpu, gpuhost:2xcuda)"
    assert not c.calibrated and c.collective_fit("all_reduce", "inter_host") is None


def test_heterogeneous_cluster_refuses_one_backend_but_plans_per_device(tmp_path):
    c = load(tmp_path, hetero_doc())
    flops = [c.device(r).peak_flops["float32"] for r in range(4)]
    assert flops == [1e11, 5e10, 19.5e12, 19.5e12]
    with pytest.raises(ClusterSpecError, match="mixes device kinds"):
        c.backend  # noqa: B018
    assert c.hosts[1].device_kind == "cuda"


def test_yaml_12_floats_and_integral_float_bytes(tmp_path):
    p = tmp_path / "cluster.yaml"
    p.write_text("""\
schema_version: 2
hosts:
  - name: a
    devices:
      - {rank: 0, kind: cuda, peak_flops: {float32: 19.5e12}, memory_bytes: 80e9, memory_bandwidth_bytes_per_s: 2e12}
      - {rank: 1, kind: cuda, peak_flops: {float32: 19.5e12}, memory_bytes: 80e9, memory_bandwidth_bytes_per_s: 2e12}
links:
  - {tier: intra_host, bandwidth_bytes_per_s: 1.5e11, latency_s: 1e-5}
""")
    c = load_cluster(p)
    assert c.device(1).memory_bytes == 80 * 10**9 and isinstance(c.device(1).memory_bytes, int)
    assert c.device(0).peak_flops["float32"] == 19.5e12 and c.link(0, 1).latency_s == 1e-5


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_round_trip_save_load(tmp_path, suffix):
    c = load(tmp_path, hetero_doc()).with_calibration(Calibration(
        FrozenMap({("intra_host", "all_reduce"): CollectiveFit(2e-4, 7e-10, 2, 0.05),
                   ("inter_host", "send_recv"): CollectiveFit(5e-5, 8e-10)}),
        measured_at="2025-01-01T00:00:00+00:00", backend="gloo", torch_version="2.13.0", wall_s=12.5))
    p = tmp_path / f"out.{suffix}"
    save_cluster(c, p, comment="a test")
    if suffix == "json":
        json.loads(p.read_text())
    else:
        assert p.read_text().startswith("# a test\n")
    back = load_cluster(p)
    assert back == c and hash(back) == hash(c)
    assert back.calibrated and back.collective_fit("all_reduce", "intra_host") == CollectiveFit(2e-4, 7e-10, 2, 0.05)
    assert back.collective_fit("all_gather", "intra_host") is None
    assert back.calibration.wall_s == 12.5 and repr(back).endswith(", calibrated)")


def test_local_round_trips_and_shares_cores(tmp_path):
    for n in (1, 2, 4):
        c = local_cluster(n)
        save_cluster(c, tmp_path / "c.yaml")
        assert load_cluster(tmp_path / "c.yaml") == c
    from adaptdist.calibrate.hardware import usable_cores

    c4 = local_cluster(4)
    assert c4.device(3).cores == usable_cores() / 4
    assert c4.device(0).peak_flops["float32"] == pytest.approx(local_cluster(2).device(0).peak_flops["float32"] / 2)
    assert all(v > 0 and math.isfinite(v) for d in c4.devices for v in d.peak_flops.values())
    assert local_cluster(1).links == ()  # one rank: no pair, no link needed
    cu = local_cluster(2, "cuda")
    assert cu.device(0).kind == "cuda" and cu.link(0, 1).bandwidth_bytes_per_s > c4.link(0, 1).bandwidth_bytes_per_s


def test_queries_reject_unknown_ranks_and_names():
    c = local_cluster(2)
    with pytest.raises(ClusterSpecError, match="no rank 2"):
        c.device(2)
    with pytest.raises(ClusterSpecError, match="no link to itself"):
        c.link(1, 1)
    with pytest.raises(ClusterSpecError, match="no rank 5"):
        c.link(0, 5)
    with pytest.raises(ClusterSpecError, match="'broadcast' is not one of"):
        c.collective_fit("broadcast", "intra_host")
    with pytest.raises(ClusterSpecError, match="'nvlink' is not one of"):
        c.collective_fit("all_reduce", "nvlink")


def test_value_objects_are_frozen_and_validate_themselves():
    c = local_cluster(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.device(0).memory_bytes = 1  # type: ignore[misc]
    with pytest.raises((TypeError, AttributeError)):
        c.device(0).peak_flops["float32"] = 1.0  # type: ignore[index]
    with pytest.raises(ClusterSpecError, match="bandwidth_bytes_per_s must be a positive"):
        Link("intra_host", 0.0, 1e-4)
    with pytest.raises(ClusterSpecError, match="beta_s_per_byte must be a positive"):
        CollectiveFit(1e-4, -1e-9)
    with pytest.raises(ClusterSpecError, match="peak_flops.*float32"):
        Device(0, "a", "cpu", {"bfloat16": 1e12}, 2**30, 1e10)
    with pytest.raises(ClusterSpecError, match="says it is on host 'b'"):
        Host("a", (Device(0, "b", "cpu", {"float32": 1e11}, 2**30, 1e10),))
    with pytest.raises(ClusterSpecError, match="no link for tier 'intra_host'"):
        Cluster((uniform_host("a", "cpu", 2),))


# --- bad files: each names the file, the field and the allowed form -------------------------------

def _drop(d: dict, key: str) -> dict:
    d = dict(d)
    del d[key]
    return d


@pytest.mark.parametrize("key", ["rank", "kind", "peak_flops", "memory_bytes", "memory_bandwidth_bytes_per_s"])
def test_device_field_missing(tmp_path, key):
    msg = error(tmp_path, doc(hosts=[{"name": "a", "devices": [cpu(0), _drop(cpu(1), key)]}]))
    assert f"'hosts[0].devices[1].{key}'" in msg and "is missing" in msg
    assert "memory_bandwidth_bytes_per_s: 1.0e+10" in msg  # shows the allowed form


@pytest.mark.parametrize("key", ["bandwidth_bytes_per_s", "latency_s"])
def test_link_field_missing(tmp_path, key):
    msg = error(tmp_path, doc(links=[_drop(INTRA, key)]))
    assert f"'links[0].{key}'" in msg and "is missing" in msg and "tier: intra_host" in msg


def test_links_missing(tmp_path):
    msg = error(tmp_path, _drop(doc(), "links"))
    assert "'links'" in msg and "is missing" in msg and "bandwidth_bytes_per_s" in msg


def test_host_devices_missing(tmp_path):
    msg = error(tmp_path, doc(hosts=[{"name": "a"}]))
    assert "'hosts[0].devices'" in msg and "is missing" in msg


def test_float32_flops_missing(tmp_path):
    msg = error(tmp_path, doc(hosts=[{"name": "a", "devices": [cpu(0, peak_flops={"bfloat16": 1e12}), cpu(1)]}]))
    assert "'hosts[0].devices[0].peak_flops'" in msg and "include float32" in msg


@pytest.mark.parametrize("value", [0, -1.5e9, "fast", None, True, float("inf")])
def test_link_bandwidth_not_positive(tmp_path, value):
    msg = error(tmp_path, doc(links=[dict(INTRA, bandwidth_bytes_per_s=value)]))
    assert "'links[0].bandwidth_bytes_per_s'" in msg and "bytes/s > 0" in msg and repr(value) in msg


@pytest.mark.parametrize("value", [0, -1e10])
def test_memory_bandwidth_not_positive(tmp_path, value):
    msg = error(tmp_path, doc(hosts=[{"name": "a", "devices": [cpu(0), cpu(1, memory_bandwidth_bytes_per_s=value)]}]))
    assert "'hosts[0].devices[1].memory_bandwidth_bytes_per_s'" in msg and "bytes/s > 0" in msg


def test_negative_latency_and_flops(tmp_path):
    msg = error(tmp_path, doc(links=[dict(INTRA, latency_s=-1e-4)]))
    assert "'links[0].latency_s'" in msg and "seconds >= 0" in msg
    msg = error(tmp_path, doc(hosts=[{"name": "a", "devices": [cpu(0, flops=-1.0), cpu(1)]}]))
    assert "'hosts[0].devices[0].peak_flops.float32'" in msg and "FLOP/s > 0" in msg


@pytest.mark.parametrize("value", [-1, 0, 1.5, "8GB"])
def test_memory_bytes_bad(tmp_path, value):
    msg = error(tmp_path, doc(hosts=[{"name": "a", "devices": [cpu(0, memory_bytes=value), cpu(1)]}]))
    assert "'hosts[0].devices[0].memory_bytes'" in msg and "integer bytes >= 1" in msg


def test_unknown_device_kind(tmp_path):
    msg = error(tmp_path, doc(hosts=[{"name": "a", "devices": [cpu(0), cpu(1, kind="tpu")]}]))
    assert "'hosts[0].devices[1].kind'" in msg and "'tpu'" in msg and "'cpu'" in msg and "'cuda'" in msg


def test_unknown_dtype(tmp_path):
    msg = error(tmp_path, doc(hosts=[{"name": "a", "devices": [cpu(0, peak_flops={"float32": 1e11, "fp8": 1e12}),
                                                              cpu(1)]}]))
    assert "'hosts[0].devices[0].peak_flops'" in msg and "'fp8'" in msg and "bfloat16" in msg


def test_link_names_missing_device(tmp_path):
    msg = error(tmp_path, doc(links=[INTRA, {"ranks": [1, 7], "bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4}]))
    assert "'links[1].ranks'" in msg and "rank 7" in msg and "does not exist" in msg and "0..1" in msg


def test_link_ranks_malformed(tmp_path):
    msg = error(tmp_path, doc(links=[INTRA, {"ranks": [1, 1], "bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4}]))
    assert "'links[1].ranks'" in msg and "two different ranks" in msg


def test_link_needs_tier_or_ranks(tmp_path):
    msg = error(tmp_path, doc(links=[{"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4}]))
    assert "'links[0]'" in msg and "'tier'" in msg and "'ranks: [a, b]'" in msg


def test_unknown_tier(tmp_path):
    msg = error(tmp_path, doc(links=[dict(INTRA, tier="nvlink")]))
    assert "'links[0].tier'" in msg and "'nvlink'" in msg and "'intra_host'" in msg and "'inter_host'" in msg


def test_pair_tier_contradicts_hosts(tmp_path):
    msg = error(tmp_path, doc(links=[INTRA, {"ranks": [0, 1], "tier": "inter_host", "bandwidth_bytes_per_s": 1e9,
                                            "latency_s": 1e-4}]))
    assert "'links[1].tier'" in msg and "intra_host" in msg


def test_tier_without_link(tmp_path):
    d = hetero_doc()
    d["links"] = [INTRA]
    msg = error(tmp_path, d)
    assert "no link for tier 'inter_host'" in msg and "4 pair(s)" in msg and "latency_s" in msg


def test_pairs_may_replace_a_tier_default(tmp_path):
    c = load(tmp_path, doc(links=[{"ranks": [0, 1], "bandwidth_bytes_per_s": 2e9, "latency_s": 1e-4}]))
    assert c.link(0, 1).bandwidth_bytes_per_s == 2e9


def test_duplicate_links(tmp_path):
    assert "two default links for tier 'intra_host'" in error(tmp_path, doc(links=[INTRA, INTRA]))
    pair = {"ranks": [0, 1], "bandwidth_bytes_per_s": 2e9, "latency_s": 1e-4}
    assert "two links for ranks [0, 1]" in error(tmp_path, doc(links=[pair, dict(pair, ranks=[1, 0])]))


def test_duplicate_ranks(tmp_path):
    msg = error(tmp_path, doc(hosts=[{"name": "a", "devices": [cpu(0), cpu(1)]},
                                     {"name": "b", "devices": [cpu(1, host="b")]}], links=[INTRA, INTER]))
    assert "'hosts[1].devices[0].rank'" in msg and "already the rank of hosts[0].devices[1]" in msg


def test_duplicate_ranks_direct():
    d = Device(0, "a", "cpu", {"float32": 1e11}, 2**30, 1e10)
    with pytest.raises(ClusterSpecError, match="duplicate rank 0"):
        Cluster((Host("a", (d,)), Host("b", (dataclasses.replace(d, host="b"),))),
                (Link("inter_host", 1e9, 1e-4),))


def test_ranks_with_a_gap(tmp_path):
    msg = error(tmp_path, doc(hosts=[{"name": "a", "devices": [cpu(0), cpu(2)]}]))
    assert "'hosts'" in msg and "0..1" in msg and "missing [1]" in msg


def test_unknown_keys(tmp_path):
    msg = error(tmp_path, doc(hosts=[{"name": "a", "devices": [cpu(0, gpus=2), cpu(1)]}]))
    assert "'hosts[0].devices[0]'" in msg and "unknown keys ['gpus']" in msg and "memory_bytes" in msg
    msg = error(tmp_path, doc(topology="ring"))
    assert "unknown keys ['topology']" in msg and "calibration" in msg


def test_bad_calibration(tmp_path):
    fit = {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9}
    msg = error(tmp_path, doc(calibration={"collectives": {"intra_host": {"broadcast": fit}}}))
    assert "'calibration.collectives.intra_host.broadcast'" in msg and "all_to_all" in msg
    msg = error(tmp_path, doc(calibration={"collectives": {"pcie": {"all_reduce": fit}}}))
    assert "'calibration.collectives.pcie'" in msg and "inter_host" in msg
    msg = error(tmp_path, doc(calibration={"collectives": {"intra_host": {"all_reduce": dict(fit, beta_s_per_byte=0)}}}))
    assert "'calibration.collectives.intra_host.all_reduce.beta_s_per_byte'" in msg and "> 0" in msg
    msg = error(tmp_path, doc(calibration={"collectives": {"intra_host": {"all_reduce": {"alpha_s": 1e-4}}}}))
    assert "beta_s_per_byte'" in msg and "is missing" in msg


def test_v1_fields_in_v2_file(tmp_path):
    msg = error(tmp_path, doc(hosts=[{"name": "h", "device_kind": "cpu", "num_devices": 2}]))
    assert "'hosts[0]'" in msg and "num_devices" in msg and "schema version 1" in msg and "devices:" in msg


# --- topology fingerprint ---------------------------------------------------------------------------

def test_fingerprint_stable_under_recalibration_and_figures(tmp_path):
    c = local_cluster(2)
    fp = c.topology_fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0
    recal = Cluster(
        tuple(Host(h.name, tuple(dataclasses.replace(d, peak_flops={"float32": 1.23e9},
                                                     memory_bandwidth_bytes_per_s=4.5e9) for d in h.devices))
              for h in c.hosts),
        (Link("intra_host", 9.9e8, 3e-4),),
        Calibration(FrozenMap({("intra_host", n): CollectiveFit(1e-4, 1e-9, 2) for n in COLLECTIVES})))
    assert recal.topology_fingerprint() == fp
    save_cluster(recal, tmp_path / "c.yaml")
    assert load_cluster(tmp_path / "c.yaml").topology_fingerprint() == fp
    renamed = Cluster((uniform_host("node7", "cpu", 2),), c.links)
    assert renamed.topology_fingerprint() == fp  # host names are not topology


def test_fingerprint_differs_for_other_topologies(tmp_path):
    fps = {
        local_cluster(2).topology_fingerprint(),
        local_cluster(3).topology_fingerprint(),
        local_cluster(2, "cuda").topology_fingerprint(),
        load(tmp_path, hetero_doc()).topology_fingerprint(),
        load(tmp_path, doc(hosts=[{"name": "a", "devices": [cpu(0)]}, {"name": "b", "devices": [cpu(1, host="b")]}],
                           links=[INTER])).topology_fingerprint(),
        # same hosts and kinds, ranks interleaved across hosts
        load(tmp_path, doc(hosts=[{"name": "a", "devices": [cpu(0), cpu(2)]},
                                  {"name": "b", "devices": [cpu(1, host="b"), cpu(3, host="b")]}],
                           links=[INTRA, INTER])).topology_fingerprint(),
        load(tmp_path, doc(hosts=[{"name": "a", "devices": [cpu(0), cpu(1)]},
                                  {"name": "b", "devices": [cpu(2, host="b"), cpu(3, host="b")]}],
                           links=[INTRA, INTER])).topology_fingerprint(),
    }
    assert len(fps) == 7


# --- alpha-beta fit -------------------------------------------------------------------------------------

def test_fit_recovers_a_line():
    sizes = [2**k for k in range(10, 25, 2)]
    ab = fit_alpha_beta(sizes, [2e-4 + 7e-10 * n for n in sizes])
    assert ab.alpha_s == pytest.approx(2e-4, rel=1e-9) and ab.beta_s_per_byte == pytest.approx(7e-10, rel=1e-9)
    assert ab.rms_rel_error < 1e-9


def test_fit_weighs_small_messages():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    times = [(1e-4 + 1e-9 * n) * f for n, f in zip(sizes, [1.1, 0.9, 1.05, 0.95, 1.0])]
    ab = fit_alpha_beta(sizes, times)
    assert 0.8e-4 < ab.alpha_s < 1.2e-4 and 0.9e-9 < ab.beta_s_per_byte < 1.1e-9
    assert 0.01 < ab.rms_rel_error < 0.2


def test_fit_clamps_to_physical_values():
    ab = fit_alpha_beta([1e3, 1e6], [1e-7, 2e-3])  # a line through them has alpha < 0
    assert ab.alpha_s == 0 and ab.beta_s_per_byte > 0
    ab = fit_alpha_beta([1e3, 1e4, 1e5], [3e-4, 2.5e-4, 2e-4])  # latency-bound, noise makes the slope negative
    assert ab.alpha_s >= 0 and ab.beta_s_per_byte == pytest.approx(2e-4 / 1e5)


@pytest.mark.parametrize("sizes,times", [([1e3], [1e-4]), ([1e3, 1e3], [1e-4, 2e-4]), ([1e3, 1e4], [1e-4]),
                                         ([1e3, 1e4], [0.0, 1e-3]), ([1e3, 1e4], [1e-4, float("nan")])])
def test_fit_errors(sizes, times):
    with pytest.raises(FitError):
        fit_alpha_beta(sizes, times)


# --- adaptdist cluster detect ---------------------------------------------------------------------------

def test_cli_detect_writes_a_loadable_uncalibrated_file(tmp_path, capsys):
    out = tmp_path / "c.yaml"
    assert main(["cluster", "detect", "--nproc", "3", "--device-kind", "cpu", "--out", str(out)]) == 0
    text = out.read_text()
    assert "uncalibrated" in text.splitlines()[1] and "calibration: null" in text
    c = load_cluster(out)
    assert c == local_cluster(3) and not c.calibrated
    err = capsys.readouterr().err
    assert "wrote" in err and str(out) in err and c.topology_fingerprint() in err
    assert main(["cluster", "detect", "--device-kind", "cpu", "--out", str(tmp_path / "c.json")]) == 0
    assert load_cluster(tmp_path / "c.json") == local_cluster(2)


def test_cli_detect_bad_out(tmp_path, capsys):
    assert main(["cluster", "detect", "--device-kind", "cpu", "--out", str(tmp_path / "no" / "dir" / "c.yaml")]) == 2
    assert "UsageError" in capsys.readouterr().err


def test_train_refuses_heterogeneous_cluster_clearly(tmp_path, capsys):
    """Every rank's device is checked before anything compiles: on a machine without CUDA the cluster's cuda rank
    is named (with a GPU, the synchronous mode refuses the mix: tests/test_devices.py)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the cuda rank's device exists")
    p = tmp_path / "cluster.yaml"
    p.write_text(yaml.safe_dump(hetero_doc()))
    assert main(["train", "--cluster", str(p), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "DeviceUnavailableError" in err and "rank 2 (host 'gpuhost', device cuda:0)" in err, err


def test_readme_cluster_example_loads(tmp_path):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Cluster"):]
    section = section[:section.index("\n## ", 1)]
    example = section[section.index("```yaml\n") + 8:]
    (tmp_path / "cluster.yaml").write_text(example[:example.index("```")])
    c = load_cluster(tmp_path / "cluster.yaml")
    assert c.calibrated and c.world_size == 2 and c.collective_fit("all_reduce", "intra_host").alpha_s == 1.39e-4


def test_pickle_and_copy_keep_the_cluster(tmp_path):
    import copy
    import pickle

    c = load(tmp_path, hetero_doc()).with_calibration(Calibration(
        FrozenMap({("intra_host", "all_reduce"): CollectiveFit(2e-4, 7e-10, 2)})))
    for back in (pickle.loads(pickle.dumps(c)), copy.deepcopy(c)):
        assert back == c and hash(back) == hash(c)
        assert back.link(2, 3) == c.link(2, 3) and back.device(3) == c.device(3)
        assert back.collective_fit("all_reduce", "intra_host") == CollectiveFit(2e-4, 7e-10, 2)
