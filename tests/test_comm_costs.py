"""Shared-memory collectives in the calibration, the cluster file and the cost models (``--comm``): one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptdist.kernels as kernels
from adaptdist.calibrate.local import load_cluster, local_cluster
from adaptdist.calibrate.profile import calibrate
from adaptdist.cluster import COLLECTIVES, SHM_COLLECTIVES
from adaptdist.cluster_file import save_cluster
from adaptdist.comm_transport import cluster_for_comm
from adaptdist.cost_models.communication import functional_collective_kind, link_cost
from adaptdist.errors import ClusterSpecError


def _results(world=2):
    gloo = [[1024, 2.0e-4 + 1024e-9], [65536, 2.0e-4 + 65536e-9], [2**20, 2.0e-4 + 2**20 * 1e-9]]
    shm = [[n, 1.0e-5 + n * 1e-10] for n, _ in gloo]
    results = {}
    for r in range(world):
        coll = {**{n: gloo for n in COLLECTIVES}, **{f"shm:{n}": shm for n in SHM_COLLECTIVES}} if r == 0 else {}
        results[r] = {"rank": r, "collectives": coll, "peak_flops": {"float32": 4e10}, "failed_dtypes": {},
                      "memory_bandwidth_bytes_per_s": 5e9, "threads": 1, "device_name": "cpu", "memory_bytes": None}
    return results


def test_profile_files_shm_fits_beside_gloo_and_the_file_keeps_them(tmp_path):
    c = calibrate(local_cluster(2), _results())
    ar, shm = c.collective_fit("all_reduce", "intra_host"), c.collective_fit("all_reduce", "shm")
    assert ar.alpha_s == pytest.approx(2.0e-4, rel=1e-3) and shm.alpha_s == pytest.approx(1.0e-5, rel=1e-3)
    assert shm.beta_s_per_byte == pytest.approx(1e-10, rel=1e-3) and shm.num_ranks == 2
    assert c.collective_fit("send_recv", "shm") is None  # the kernels have no send/recv
    path = tmp_path / "c.yaml"
    save_cluster(c, path)
    assert "shm:" in path.read_text()
    again = load_cluster(path)
    assert again.collective_fit("reduce_scatter", "shm") == c.collective_fit("reduce_scatter", "shm")
    with pytest.raises(ClusterSpecError, match="send_recv.*is not a collective"):
        bad = path.read_text().replace("shm:\n", "shm:\n      send_recv: {alpha_s: 1.0e-5, beta_s_per_byte: 1.0e-10}\n", 1)
        (tmp_path / "bad.yaml").write_text(bad)
        load_cluster(tmp_path / "bad.yaml")


def test_one_host_groups_cost_the_shm_fits_under_comm(monkeypatch):
    c = calibrate(local_cluster(2), _results())
    gloo = link_cost(c, "all_reduce", [0, 1])
    assert cluster_for_comm(c, "gloo") is c
    shm_view = cluster_for_comm(c, "shm")
    shm = link_cost(shm_view, "all_reduce", [0, 1])
    assert shm.calibrated and shm.alpha_s < gloo.alpha_s / 10 and shm.beta_s_per_byte < gloo.beta_s_per_byte
    assert shm_view.collective_fit("send_recv", "intra_host") == c.collective_fit("send_recv", "intra_host")
    assert shm_view.topology_fingerprint() == c.topology_fingerprint()
    plain = local_cluster(2)
    marked = plain.with_shm_collectives()  # nothing measured: same figures, marked for the estimated shm costs
    assert marked.shm_collectives and not plain.shm_collectives and marked.calibration == plain.calibration
    monkeypatch.setattr(kernels, "load", lambda: kernels.LoadResult(None, "disabled"))
    assert cluster_for_comm(c, "auto") is c  # auto without the kernels: gloo's figures


@pytest.mark.skipif(not kernels.available(), reason=f"shm kernels not built: {kernels.load_error()}")
def test_estimate_costs_shm_programs_with_the_shm_fits():
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.cost_models.estimate import estimate_programs
    from adaptdist.lowering_options import LoweringOptions

    assert functional_collective_kind(torch.ops.adaptdist.shm_all_reduce.default) == "all_reduce"
    assert functional_collective_kind(torch.ops.adaptdist.shm_all_gather_into_tensor.default) == "all_gather"
    c = calibrate(local_cluster(2), _results())

    def lowered(comm):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 4))
        return compile_model(model, (torch.randn(8, 64), torch.randint(0, 4, (8,))), F.cross_entropy, 2, None,
                             LoweringOptions(comm=comm, hosts=("h", "h")))

    on_gloo = estimate_programs(lowered("gloo"), c, "sgd")
    on_shm = estimate_programs(lowered("shm"), cluster_for_comm(c, "shm"), "sgd")
    g, s = on_gloo.ranks[0].communication_s, on_shm.ranks[0].communication_s
    assert s > 0 and s < g / 5, (s, g)  # the shm ops are costed, with the shm fits


@pytest.mark.skipif(not kernels.available(), reason=f"shm kernels not built: {kernels.load_error()}")
def test_uncalibrated_shm_axes_cost_the_shm_defaults_concretely_and_symbolically():
    """A cluster without shm fits (not profiled with the kernels): a one-host axis's shm ops are costed at the cost
    model's shared-memory figures, not gloo's, by the concrete estimate and by ``estimate --symbolic``'s formulas
    alike (which agree at the base point); a gloo program keeps gloo's figures."""
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.cost_models.estimate import estimate_programs
    from adaptdist.cost_models.hardware import default_shm_link
    from adaptdist.cost_models.symbolic import fit_symbolic_estimate
    from adaptdist.lowering_options import LoweringOptions

    c = local_cluster(2)  # estimated figures: no calibration block at all

    def compile_at(point, comm):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 4))
        batch = (torch.randn(point.batch_size, 64), torch.randint(0, 4, (point.batch_size,)))
        world = point.mesh_dict["dp"]
        return compile_model(model, batch, F.cross_entropy, world, None, LoweringOptions(comm=comm, hosts=("h",)))

    comm_s = {}
    for comm in ("shm", "gloo"):
        from adaptdist.cost_models.symbolic import SamplePoint

        concrete = estimate_programs(compile_at(SamplePoint(8, 1, (("dp", 2),)), comm), c, "sgd")
        comm_s[comm] = concrete.ranks[0].communication_s
        if comm == "shm":
            sym = fit_symbolic_estimate(lambda p: compile_at(p, comm), 8, 1, {"dp": 2}, c, "sgd")
            assert float(sym.evaluate(8, 1, {"dp": 2})["communication_s"]) == pytest.approx(comm_s[comm], rel=1e-9)
        tiers = {(x.calibrated, x.tier) for x in concrete.ranks[0].collectives}
        assert tiers == {(False, "intra_host")}, tiers
    shm_link, gloo_link = default_shm_link("cpu"), c.link(0, 1)
    assert shm_link.bandwidth_bytes_per_s > gloo_link.bandwidth_bytes_per_s
    assert 0 < comm_s["shm"] < comm_s["gloo"] / 5, comm_s


def test_planner_prices_one_host_axes_with_the_transport_the_lowering_takes():
    """An uncalibrated cluster (no shm fits): under ``--comm shm`` the planner's ILP prices a one-host axis's
    collectives at the estimated shared-memory figures (``default_shm_link``), not gloo's, so the plan's predicted
    communication drops by at least their bandwidth ratio; send/recv (pipelines' sends, on gloo) keeps gloo's link;
    a two-host axis keeps gloo's link either way."""
    from adaptdist.calibrate.local import estimated_cluster
    from adaptdist.compiler.capture import capture
    from adaptdist.compiler.planner import plan_auto
    from adaptdist.cost_models.hardware import default_shm_link
    from adaptdist.mesh import Mesh

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 8))
    captured = capture(model, (torch.randn(16, 256), torch.randint(0, 8, (16,))), F.cross_entropy)
    c = local_cluster(2)
    comm, plans = {}, {}
    for mode, cluster in (("gloo", cluster_for_comm(c, "gloo")), ("shm", cluster_for_comm(c, "shm"))):
        result = plan_auto(captured, cluster, mesh=Mesh.parse("dp=2"), optimizer="sgd")
        comm[mode] = result.predicted.communication_s["dp"]
        plans[mode] = dict(result.plan.param_placements)
    if kernels.available():  # the torch.compile backend plans on the same view (adaptdist.backend(comm=...))
        from adaptdist.compiler import dynamo_backend

        config = dynamo_backend.AdaptdistBackend(comm="shm", mesh="dp=2", optimizer="sgd")
        assert dict(dynamo_backend._auto_plan(captured, config, 2).param_placements) == plans["shm"]
    shm_link, gloo_link = default_shm_link("cpu"), c.link(0, 1)
    ratio = shm_link.bandwidth_bytes_per_s / gloo_link.bandwidth_bytes_per_s
    # the same plan would cost at most 1/ratio of gloo's (cheaper alpha too); the planner may pick a better one for it
    assert comm["gloo"] > 0 and 0 < comm["shm"] <= comm["gloo"] / ratio, (comm, ratio)
    shm_view = cluster_for_comm(c, "shm")
    assert link_cost(shm_view, "send_recv", [0, 1]) == link_cost(c, "send_recv", [0, 1])
    two_hosts = estimated_cluster((("a", "cpu", 1), ("b", "cpu", 1)))
    assert link_cost(cluster_for_comm(two_hosts, "shm"), "all_reduce", [0, 1]) == link_cost(two_hosts, "all_reduce",
                                                                                            [0, 1])
