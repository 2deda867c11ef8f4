"""adaptdist cluster profile: a real (tiny) run on 2 gloo ranks, and turning measurements into a cluster."""

from __future__ import annotations

import math
import re
import time

import pytest

from adaptdist.calibrate.profile import calibrate
from adaptdist.cli import main
from adaptdist.calibrate.local import load_cluster, local_cluster
from adaptdist.cluster import COLLECTIVES
from adaptdist.errors import ClusterSpecError


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_profile_two_gloo_ranks_quick(tmp_path, capsys):
    out = tmp_path / "calibrated.yaml"
    t0 = time.perf_counter()
    rc = main(["cluster", "profile", "--nproc", "2", "--device-kind", "cpu", "--quick", "--timeout-s", "30",
               "--out", str(out)])
    wall = time.perf_counter() - t0  # no bound on it here (timeout guard above): a timed unit test fails under load
    err = capsys.readouterr().err
    assert rc == 0, err
    m = re.search(r"profiled 2 cpu ranks in ([\d.]+) s", err)
    assert m and 0 < float(m.group(1)) <= wall + 1, err
    c = load_cluster(out)
    assert c.calibrated and c.world_size == 2 and c.calibration.backend == "gloo"
    assert c.topology_fingerprint() == local_cluster(2).topology_fingerprint()  # same machine, same topology
    for name in COLLECTIVES:
        fit = c.collective_fit(name, "intra_host")
        assert fit is not None, name
        assert math.isfinite(fit.alpha_s) and fit.alpha_s >= 0, (name, fit)
        assert math.isfinite(fit.beta_s_per_byte) and fit.beta_s_per_byte > 0, (name, fit)
        assert fit.time_s(65536) > 0 and fit.num_ranks == 2
        assert c.collective_fit(name, "inter_host") is None  # one host: nothing measured between hosts
    sr = c.collective_fit("send_recv", "intra_host")
    link = c.link(0, 1)
    assert link.latency_s == sr.alpha_s and link.bandwidth_bytes_per_s == pytest.approx(1 / sr.beta_s_per_byte)
    for d in c.devices:
        assert set(d.peak_flops) >= {"float32"}
        assert all(math.isfinite(v) and v > 0 for v in d.peak_flops.values()), d.peak_flops
        assert math.isfinite(d.memory_bandwidth_bytes_per_s) and d.memory_bandwidth_bytes_per_s > 0
        assert d.memory_bytes == local_cluster(2).device(d.rank).memory_bytes
    assert "collectives: time(n) = alpha + beta n" in err and "all_to_all" in err


def _fake_results(world=2, flops=(4e10, 3e10)):
    pts = [[1024, 2.0e-4 + 1024e-9], [65536, 2.0e-4 + 65536e-9], [2**20, 2.0e-4 + 2**20 * 1e-9]]
    results = {}
    for r in range(world):
        results[r] = {"rank": r, "collectives": {n: pts for n in COLLECTIVES} if r == 0 else {},
                      "peak_flops": {"float32": flops[r], "bfloat16": flops[r] * 2}, "failed_dtypes": {},
                      "memory_bandwidth_bytes_per_s": 5e9 + r, "threads": 1, "device_name": "cpu",
                      "memory_bytes": None}
    return results


def test_calibrate_from_measurements():
    base = local_cluster(2)
    c = calibrate(base, _fake_results(), wall_s=3.25)
    assert c.calibrated and c.calibration.wall_s == 3.25 and c.calibration.torch_version
    fit = c.collective_fit("all_reduce", "intra_host")
    assert fit.alpha_s == pytest.approx(2e-4) and fit.beta_s_per_byte == pytest.approx(1e-9)
    assert c.link(0, 1).bandwidth_bytes_per_s == pytest.approx(1e9) and c.link(0, 1).latency_s == pytest.approx(2e-4)
    assert dict(c.device(0).peak_flops) == {"float32": 4e10, "bfloat16": 8e10}
    assert c.device(1).peak_flops["float32"] == 3e10 and c.device(1).memory_bandwidth_bytes_per_s == 5e9 + 1
    assert c.device(1).memory_bytes == base.device(1).memory_bytes and c.device(1).cores == base.device(1).cores
    assert c.topology_fingerprint() == base.topology_fingerprint()


def test_calibrate_missing_rank_or_float32():
    with pytest.raises(ClusterSpecError, match=r"rank\(s\) \[1\]"):
        calibrate(local_cluster(2), {0: _fake_results()[0]})
    res = _fake_results()
    res[1]["peak_flops"] = {"bfloat16": 1e10}
    res[1]["failed_dtypes"] = {"float32": "no kernel"}
    with pytest.raises(ClusterSpecError, match="rank 1 could not time a float32 matmul: no kernel"):
        calibrate(local_cluster(2), res)


def test_profile_rejects_bad_sizes():
    from adaptdist.calibrate.profile import profile_local

    with pytest.raises(ClusterSpecError, match="two distinct sizes"):
        profile_local(2, "cpu", (4096,))


def test_a_point_is_the_median_batch_and_send_recv_one_way():
    from adaptdist.calibrate.bench import point_seconds

    # one batch slowed by outside load (9 ms) moves neither the median nor the point
    assert point_seconds("all_reduce", [1.0e-3, 1.2e-3, 9.0e-3, 1.1e-3, 1.3e-3]) == pytest.approx(1.2e-3)
    assert point_seconds("all_reduce", [2e-3, 4e-3]) == pytest.approx(3e-3)
    assert point_seconds("send_recv", [1.0e-3, 1.2e-3, 1.4e-3]) == pytest.approx(0.6e-3)  # half a round trip


def test_profile_times_the_functional_collectives_the_programs_issue():
    """On a 1-rank gloo group: every timed call is a functional collective + wait_tensor (a new tensor, as in
    a rank program), not the in-place ``dist`` call on a reused buffer; the compute burst is a no-op off CPU
    or at busy_s = 0, and runs on CPU."""
    import torch
    import torch.distributed as dist

    from adaptdist import _torch_compat as compat
    from adaptdist.calibrate.bench import PROFILE_GROUP, _collective_call, _compute_burst

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        compat.register_process_group(PROFILE_GROUP, dist.group.WORLD)
        cpu = torch.device("cpu")
        for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            out = _collective_call(name, 4096, 1, 0, cpu)()
            assert isinstance(out, torch.Tensor) and out.numel() == 1024, name
        assert _compute_burst(0.0, cpu)() is None
        assert _compute_burst(1e-3, torch.device("cuda")) is not None  # no-op; never touches a GPU
        burst = _compute_burst(1e-4, cpu)
        burst()
    finally:
        dist.destroy_process_group()
