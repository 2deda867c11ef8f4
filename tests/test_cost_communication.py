"""alpha-beta collective formulas, group membership and link selection against hand computations."""

import math

import pytest
import sympy

from adaptdist._torch_compat import is_functional_collective
from adaptdist.cost_models.communication import (
    collective_time_s, functional_collective_kind, group_members, link_cost, per_step_fit,
)
from adaptdist.cost_models.hardware import AlphaBeta, DeviceFigures, FixedCluster, LinkFigures
from adaptdist.errors import UsageError

A, BETA, N = 1e-5, 1e-9, 1_000_000  # 10 us per message, 1 GB/s, 1 MB


@pytest.mark.parametrize("collective,p,expected", [
    # ring all_reduce 2(p-1)a + 2(p-1)/p n b
    ("all_reduce", 4, 2 * 3 * A + 2 * 3 / 4 * N * BETA),
    ("all_reduce", 2, 2 * A + N * BETA),
    # all_gather / reduce_scatter / all_to_all (p-1)a + (p-1)/p n b
    ("all_gather", 4, 3 * A + 3 / 4 * N * BETA),
    ("reduce_scatter", 8, 7 * A + 7 / 8 * N * BETA),
    ("all_to_all", 4, 3 * A + 3 / 4 * N * BETA),
    ("send_recv", 2, A + N * BETA),
    ("broadcast", 8, 3 * (A + N * BETA)),
])
def test_ring_formulas(collective, p, expected):
    assert collective_time_s(collective, N, p, A, BETA, "ring") == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("collective,p,expected", [
    ("all_reduce", 8, 2 * 3 * A + 2 * N * BETA),          # double binary tree: 2 log2(p) a + 2 n b
    ("all_reduce", 5, 2 * 3 * A + 2 * N * BETA),          # ceil(log2 5) = 3
    ("all_gather", 8, 3 * A + 7 / 8 * N * BETA),          # recursive doubling
    ("reduce_scatter", 4, 2 * A + 3 / 4 * N * BETA),      # recursive halving
    ("all_to_all", 8, 3 * A + N / 2 * 3 * BETA),          # Bruck
])
def test_tree_formulas(collective, p, expected):
    assert collective_time_s(collective, N, p, A, BETA, "tree") == pytest.approx(expected, rel=1e-12)


def test_auto_takes_the_faster_and_one_rank_costs_nothing():
    small, big = 64, 64 * 2**20
    for n in (small, big):
        ring = collective_time_s("all_reduce", n, 16, A, BETA, "ring")
        tree = collective_time_s("all_reduce", n, 16, A, BETA, "tree")
        assert collective_time_s("all_reduce", n, 16, A, BETA, "auto") == min(ring, tree)
    # latency-bound: tree wins; bandwidth-bound: ring wins
    def t(n, algorithm):
        return collective_time_s("all_reduce", n, 16, A, BETA, algorithm)

    assert t(small, "tree") < t(small, "ring")
    assert t(big, "ring") < t(big, "tree")
    assert collective_time_s("all_reduce", N, 1, A, BETA) == 0.0
    with pytest.raises(UsageError, match="algorithm"):
        collective_time_s("all_reduce", N, 2, A, BETA, "butterfly")
    with pytest.raises(UsageError, match="gossip"):
        collective_time_s("gossip", N, 2, A, BETA)


def test_formulas_accept_sympy():
    p, n = sympy.symbols("p n", positive=True)
    t = collective_time_s("all_reduce", n, p, A, BETA)
    assert float(t.subs({p: 4, n: N})) == pytest.approx(collective_time_s("all_reduce", N, 4, A, BETA), rel=1e-12)


def test_per_step_fit_divides_out_the_ring_coefficients():
    # a whole-collective fit t(n) = a + b n measured on 4 ranks gives back t(n) at p = 4
    a, b = 3e-4, 2e-9
    alpha, beta = per_step_fit("all_reduce", 4, a, b)
    assert alpha == pytest.approx(a / 6) and beta == pytest.approx(b * 4 / 6)
    assert collective_time_s("all_reduce", N, 4, alpha, beta) == pytest.approx(a + b * N, rel=1e-12)
    with pytest.raises(UsageError):
        per_step_fit("all_reduce", 1, a, b)


def test_group_members_row_major():
    assert group_members("adaptdist:dp", 1, {"dp": 4}) == (0, 1, 2, 3)
    mesh = {"dp": 2, "tp": 2}
    assert group_members("adaptdist:tp", 2, mesh) == (2, 3)
    assert group_members("adaptdist:dp", 3, mesh) == (1, 3)
    assert group_members("adaptdist:tp", 5, {"pp": 2, "dp": 2, "tp": 2}) == (4, 5)
    assert group_members("adaptdist:dp", 5, {"pp": 2, "dp": 2, "tp": 2}) == (5, 7)
    with pytest.raises(UsageError, match="adaptdist:<axis>"):
        group_members("adaptdist:pp", 0, mesh)
    with pytest.raises(UsageError, match="outside"):
        group_members("adaptdist:dp", 4, mesh)


def test_functional_collective_kinds():
    import torch

    ops = torch.ops._c10d_functional
    assert functional_collective_kind(ops.all_reduce.default) == "all_reduce"
    assert functional_collective_kind(ops.all_gather_into_tensor.default) == "all_gather"
    assert functional_collective_kind(ops.reduce_scatter_tensor.default) == "reduce_scatter"
    assert functional_collective_kind(ops.all_to_all_single.default) == "all_to_all"
    assert functional_collective_kind(ops.wait_tensor.default) == "wait"
    assert functional_collective_kind(torch.ops.aten.mm.default) is None
    # by op handle, not by name: a string that prints like a collective is not one
    assert functional_collective_kind("_c10d_functional.all_reduce.default") is None
    assert not is_functional_collective(ops.wait_tensor.default) and is_functional_collective(ops.all_reduce.default)


def _two_hosts(fits=None) -> FixedCluster:
    devs = tuple(DeviceFigures(r, "a" if r < 2 else "b", "cpu", {"float32": 1e11}, 2**30, 1e10) for r in range(4))
    return FixedCluster(devs, LinkFigures("intra_host", 1e10, 1e-6), LinkFigures("inter_host", 1e9, 1e-5),
                        fits or {})


def test_link_cost_takes_the_slowest_hop_and_calibrated_fits():
    cl = _two_hosts()
    intra = link_cost(cl, "all_reduce", (0, 1))
    assert (intra.tier, intra.alpha_s, intra.beta_s_per_byte, intra.calibrated) == ("intra_host", 1e-6, 1e-10, False)
    cross = link_cost(cl, "all_reduce", (0, 1, 2, 3))  # hops 1-2 and 3-0 cross hosts
    assert (cross.tier, cross.alpha_s, cross.beta_s_per_byte) == ("inter_host", 1e-5, 1e-9)
    fitted = _two_hosts({("all_gather", "inter_host"): AlphaBeta(4e-4, 3e-9, num_ranks=4)})
    lc = link_cost(fitted, "all_gather", (0, 1, 2, 3))
    assert lc.calibrated
    # the fit is reproduced at the group size it was measured on
    assert collective_time_s("all_gather", N, 4, lc.alpha_s, lc.beta_s_per_byte) == pytest.approx(4e-4 + 3e-9 * N)
    assert not link_cost(fitted, "all_reduce", (0, 1, 2, 3)).calibrated  # no fit for all_reduce: the link
    assert link_cost(cl, "all_reduce", (2,)).alpha_s == 0.0
    assert math.isclose(cl.link(0, 3).bandwidth_bytes_per_s, 1e9)

