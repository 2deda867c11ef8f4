"""The per-rank estimate of lowered programs: hand-checked totals, heterogeneous clusters, the CLI."""

import textwrap

import pytest
import torch
import torch.nn.functional as F

from adaptdist.cli import main
from adaptdist.calibrate.local import local_cluster
from adaptdist.compiler.lowering import compile_model
from adaptdist.cost_models.communication import collective_time_s
from adaptdist.cost_models.estimate import estimate_programs
from adaptdist.cost_models.hardware import DeviceFigures, FixedCluster, LinkFigures
from adaptdist.errors import UsageError
from models import MLP

D_IN, D_HID, D_OUT, BATCH = 16, 32, 4, 8


@pytest.fixture(scope="module")
def mlp_programs():
    torch.manual_seed(0)
    model = MLP(D_IN, D_HID, D_OUT)
    batch = (torch.randn(BATCH, D_IN), torch.randint(0, D_OUT, (BATCH,)))
    return compile_model(model, batch, F.cross_entropy, 2)


def _cluster(peaks=(1e9, 1e9), bandwidths=(1e9, 1e9), hosts=("a", "a")) -> FixedCluster:
    devs = tuple(DeviceFigures(r, hosts[r], "cpu", {"float32": peaks[r]}, 2**30, bandwidths[r]) for r in range(2))
    return FixedCluster(devs, LinkFigures("intra_host", 1e9, 1e-5), LinkFigures("inter_host", 1e8, 1e-4))


def test_flops_and_collectives_by_hand(mlp_programs):
    est = estimate_programs(mlp_programs, _cluster(), "sgd").ranks[0]
    b = BATCH // 2
    # forward: fc1 2 b in hid, fc2 2 b hid out; backward: fc2 grad input + grad weight 2 x 2 b hid out,
    # fc1 grad weight 2 b in hid (the batch needs no gradient)
    assert est.flops == 2 * b * D_IN * D_HID + 2 * b * D_HID * D_OUT + 4 * b * D_HID * D_OUT + 2 * b * D_IN * D_HID
    n_params = D_IN * D_HID + D_HID + D_HID * D_OUT + D_OUT
    kinds = [(c.kind, c.n_bytes) for c in est.collectives]
    assert ("all_reduce", n_params * 4) in kinds  # one bucket of every gradient
    grads = next(c for c in est.collectives if c.n_bytes == n_params * 4)
    assert grads.time_s == pytest.approx(collective_time_s("all_reduce", n_params * 4, 2, 1e-5, 1e-9))
    assert est.communication_s == pytest.approx(sum(c.time_s for c in est.collectives))
    assert est.step_s == pytest.approx(est.compute_s + est.idle_s)
    assert 0 <= est.idle_s <= est.communication_s


def test_heterogeneous_devices_get_their_own_costs(mlp_programs):
    same = estimate_programs(mlp_programs, _cluster(), "adamw")
    het = estimate_programs(mlp_programs, _cluster(peaks=(1e9, 2.5e8), bandwidths=(1e9, 2.5e8)), "adamw")
    r0, r1 = het.ranks[0], het.ranks[1]
    # rank 1's device is 4x slower in every figure: every roofline time, hence its compute, is 4x
    assert r0.compute_s == pytest.approx(same.ranks[0].compute_s)
    assert r1.compute_s == pytest.approx(4 * r0.compute_s)
    # the fast rank waits for the slow one at the collectives; the job runs at the slow rank's pace
    assert r0.idle_s > r1.idle_s
    assert het.step_s == pytest.approx(max(r0.step_s, r1.step_s))
    assert het.step_s > same.step_s
    assert r0.memory == r1.memory  # same program, same bytes


def test_ranks_on_two_hosts_pay_the_inter_host_link(mlp_programs):
    one = estimate_programs(mlp_programs, _cluster(), "sgd").ranks[0]
    two = estimate_programs(mlp_programs, _cluster(hosts=("a", "b")), "sgd").ranks[0]
    assert {c.tier for c in two.collectives} == {"inter_host"}
    assert two.communication_s > one.communication_s


def test_real_cluster_and_errors(mlp_programs):
    est = estimate_programs(mlp_programs, local_cluster(2), "adamw")
    assert set(est.ranks) == {0, 1} and est.step_s > 0
    with pytest.raises(UsageError, match="cluster"):
        estimate_programs(mlp_programs, FixedCluster.uniform([("h", 1)]), "adamw")
    with pytest.raises(UsageError, match="optimizer"):
        estimate_programs(mlp_programs, _cluster(), "lamb")


@pytest.fixture
def model_file(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(textwrap.dedent("""
        import torch, torch.nn as nn, torch.nn.functional as F

        def factory(batch_size, seq_len):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
            return model, (torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))), F.cross_entropy
    """))
    return f"{f}:factory"


def test_cli_prints_the_estimate_table(model_file, capsys):
    assert main(["estimate", model_file, "--nproc", "2", "--batch-size", "8", "--optimizer", "sgd", "--plan", "dp"]) == 0
    out = capsys.readouterr().out
    assert "predicted step" in out and "peak MiB" in out and "all_reduce" in out
    assert out.count("cpu@localhost") == 2  # one row per rank
    flat = " ".join(out.split())
    assert "uncalibrated: these are default figures for cpu ranks" in flat  # --nproc: no measured figures
    assert "adaptdist cluster profile --nproc 2 --out cluster.yaml" in flat


def test_cli_symbolic_and_bad_optimizer(model_file, capsys):
    assert main(["estimate", model_file, "--nproc", "2", "--batch-size", "8", "--symbolic", "--plan", "dp"]) == 0
    out = capsys.readouterr().out
    # per sample: forward 2*16*32 + 2*32*4, backward 4*32*4 + 2*16*32 FLOPs; the batch split over dp
    assert "FLOPs per rank        = 2816*B/dp" in out
    assert "predictions at other sizes" in out
    with pytest.raises(SystemExit):
        main(["estimate", model_file, "--optimizer", "lamb"])
