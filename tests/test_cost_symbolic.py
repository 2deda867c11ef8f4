"""Symbolic costs: fits of integers, and symbolic == concrete at sample points and at points never compiled."""

import dataclasses

import pytest
import sympy
import torch
import torch.nn.functional as F

from adaptdist import _torch_compat as compat
from adaptdist.compiler.lowering import compile_model
from adaptdist.cost_models.estimate import estimate_programs
from adaptdist.cost_models.hardware import FixedCluster
from adaptdist.cost_models.schedule import schedule_from_graph
from adaptdist.cost_models.symbolic import (
    fit_integer, fit_symbolic_estimate, make_symbols, sample_points, symbolize,
)
from adaptdist.errors import UsageError
from models import MLP

B, T, DP = make_symbols(["dp"])
CLUSTER = FixedCluster.uniform([("h", 16)])


def _points(f):
    pts = [p for p, _ in sample_points(4, 8, {"dp": 2})]
    return [p.values() for p in pts], [f(*p.values()) for p in pts]


def test_sample_points_keep_the_batch_divisible():
    pts = sample_points(4, 8, {"dp": 2})
    assert [w for _, w in pts] == ["base", "B", "T", "dp", "validation"]
    assert all(p.batch_size % p.mesh_dict["dp"] == 0 for p, _ in pts)
    only_b = sample_points(4, 8, {"dp": 2}, vary=["B"])
    assert [(p.batch_size, p.seq_len, p.mesh_dict["dp"]) for p, _ in only_b] == [(4, 8, 2), (8, 8, 2), (24, 8, 2)]


@pytest.mark.parametrize("f,expected", [
    (lambda b, t, p: 32, sympy.Integer(32)),
    (lambda b, t, p: b * t // p, B * T / DP),
    (lambda b, t, p: 4 * b * t * t // p, 4 * B * T**2 / DP),
    (lambda b, t, p: t - 1, T - 1),
    (lambda b, t, p: (1000 + 16 * t) // p, (1000 + 16 * T) / DP),
])
def test_fit_integer_recovers_the_formula(f, expected):
    pts, vals = _points(f)
    assert sympy.simplify(fit_integer(vals, pts, (B, T, DP)) - expected) == 0


def test_uneven_shards_fit_no_formula():
    pts, vals = _points(lambda b, t, p: -(-5 // p))  # ceil(5 / p)
    assert fit_integer(vals, pts, (B, T, DP)) is None


def test_schedules_of_different_structure_are_refused():
    f32 = torch.float32
    a = compat.trace_fake(lambda x: x.relu(), [([4], f32)])
    b = compat.trace_fake(lambda x: x.sin().relu(), [([4], f32)])
    sa = schedule_from_graph(a, ["batch:0"], ["loss"])
    sb = schedule_from_graph(b, ["batch:0"], ["loss"])
    pts = [p for p, _ in sample_points(4, 8, {"dp": 2})][:2]
    with pytest.raises(UsageError, match="other nodes"):
        symbolize([sa, sb], pts, (B, T, DP))


FIELDS = ("step_s", "compute_s", "communication_s", "idle_s", "flops", "peak_memory_bytes")


def _concrete(rank_est):
    r = rank_est
    return {"step_s": r.step_s, "compute_s": r.compute_s, "communication_s": r.communication_s, "idle_s": r.idle_s,
            "flops": r.flops, "peak_memory_bytes": r.memory.peak_bytes}


def _assert_equal(sym, conc):
    for f in FIELDS:
        assert sym[f] == pytest.approx(conc[f], rel=1e-9, abs=1e-15), f


def test_mlp_dp_symbolic_equals_concrete_at_samples_and_new_points():
    def build(batch_size):
        torch.manual_seed(0)
        return MLP(16, 32, 4), (torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))), F.cross_entropy

    concrete = {}

    def compile_at(p):
        programs = compile_model(*build(p.batch_size), p.mesh_dict["dp"])
        concrete[(p.batch_size, p.mesh_dict["dp"])] = estimate_programs(programs, CLUSTER, "adamw").ranks[0]
        return programs

    sym = fit_symbolic_estimate(compile_at, 8, 1, {"dp": 2}, CLUSTER, "adamw")
    assert sym.unfitted == () and sym.fixed == ()
    assert sympy.simplify(sym.flops - (2 * 16 * 32 + 3 * 2 * 32 * 4 + 2 * 16 * 32) * B / DP) == 0  # by hand
    for p in sym.points:
        _assert_equal(sym.evaluate(p.batch_size, p.seq_len, p.mesh_dict),
                      _concrete(concrete[(p.batch_size, p.mesh_dict["dp"])]))
    for bs, dp in ((40, 2), (24, 4), (64, 8)):  # never compiled while fitting
        est = estimate_programs(compile_model(*build(bs), dp), CLUSTER, "adamw").ranks[0]
        _assert_equal(sym.evaluate(bs, 1, {"dp": dp}), _concrete(est))
    held = dataclasses.replace(sym, fixed=(("dp", 2),))
    with pytest.raises(UsageError, match="holds dp at 2"):
        held.evaluate(8, 1, {"dp": 4})


def test_gpt_tp_symbolic_equals_concrete_with_attention_and_seq_len():
    from adaptdist.annotations import ManualPlan
    from adaptdist.models import gpt

    plan = ManualPlan.parse("tp", gpt)

    def compile_at_sizes(batch_size, seq_len, tp):
        torch.manual_seed(0)
        model, batch, loss = gpt.factory(batch_size, seq_len, gpt.GPTConfig(dim=32, num_layers=1, num_heads=4,
                                                                            max_seq_len=seq_len))
        return compile_model(model, batch, loss, tp, plan)

    sym = fit_symbolic_estimate(lambda p: compile_at_sizes(p.batch_size, p.seq_len, p.mesh_dict["tp"]), 2, 8,
                                {"tp": 2}, CLUSTER, "sgd")
    assert sym.unfitted == ()
    assert sym.flops.free_symbols == {B, T, sympy.Symbol("tp", positive=True, integer=True)}
    for bs, sl, tp in ((6, 12, 2), (4, 16, 4)):
        est = estimate_programs(compile_at_sizes(bs, sl, tp), CLUSTER, "sgd").ranks[0]
        _assert_equal(sym.evaluate(bs, sl, {"tp": tp}), _concrete(est))
