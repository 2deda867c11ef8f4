"""The two-stream timeline against hand-drawn schedules."""

import pytest
import sympy

from adaptdist.cost_models.overlap import Compute, Issue, Wait, merge_computes, simulate
from adaptdist.errors import CollectiveMismatchError


def _one(events):
    return simulate({0: events})[0]


def test_communication_hidden_up_to_the_computation_between_issue_and_wait():
    # compute 5, issue a 10 s collective, compute 3 (overlaps), wait: 7 s idle, then compute 2
    t = _one([Compute(5), Issue(1, "g", 10), Compute(3), Wait(1), Compute(2)])
    assert (t.step_s, t.compute_s, t.communication_s, t.idle_s) == (17, 10, 10, 7)


def test_fully_hidden_when_the_window_is_longer():
    t = _one([Issue(1, "g", 4), Compute(6), Wait(1)])
    assert (t.step_s, t.idle_s) == (6, 0)


def test_collectives_on_one_group_run_one_after_another():
    # both issued at 0 and 1; the second starts when the first ends (10) and ends at 20; compute ends at 12
    t = _one([Issue(1, "g", 10), Compute(1), Issue(2, "g", 10), Compute(11), Wait(1), Wait(2)])
    assert (t.step_s, t.idle_s) == (20, 8)
    # on two groups (two streams) they overlap each other: ends at max(10, 11) = 11 < 12
    t2 = _one([Issue(1, "a", 10), Compute(1), Issue(2, "b", 10), Compute(11), Wait(1), Wait(2)])
    assert (t2.step_s, t2.idle_s) == (12, 0)


def test_a_slow_rank_makes_its_peers_wait():
    events = {
        0: [Compute(2), Issue(1, "g", 3), Wait(1), Compute(1)],
        1: [Compute(6), Issue(1, "g", 3), Wait(1), Compute(1)],
    }
    t = simulate(events, lambda r, e: (0, 1))
    # the collective starts when rank 1 joins at 6 and ends at 9
    assert t[0].step_s == t[1].step_s == 10
    assert (t[0].idle_s, t[1].idle_s) == (7, 3)
    assert (t[0].compute_s, t[1].compute_s) == (3, 7)


def test_mismatched_collective_counts_are_refused():
    with pytest.raises(CollectiveMismatchError):
        simulate({0: [Issue(1, "g", 1), Wait(1)], 1: []}, lambda r, e: (0, 1))


def test_merge_and_symbolic_timeline_equal_numbers():
    x = sympy.Symbol("x", positive=True)
    ev = [Compute(x), Compute(2 * x), Issue(3, "g", 5 * x), Compute(x), Wait(3), Compute(1)]
    assert len(merge_computes(ev)) == 5
    t = _one(merge_computes(ev))
    for v in (0.5, 1.0, 3.0):
        num = _one([Compute(v), Compute(2 * v), Issue(3, "g", 5 * v), Compute(v), Wait(3), Compute(1)])
        assert float(t.step_s.subs(x, v)) == pytest.approx(num.step_s)
        assert float(t.idle_s.subs(x, v)) == pytest.approx(num.idle_s)


def test_named_maxima_keep_a_long_symbolic_timeline_linear():
    """40 collectives: nesting every max would double the expression per collective; naming each keeps it small."""
    x = sympy.Symbol("x", positive=True)
    defs = []

    def define(e):
        if isinstance(e, sympy.Basic) and not isinstance(e, sympy.Symbol) and e.free_symbols:
            s = sympy.Symbol(f"t{len(defs)}")
            defs.append((s, e))
            return s
        return e

    def events(d):
        ev = []
        for k in range(40):
            ev += [Compute(d), Issue(k, "g", 3 * d), Compute(d), Wait(k)]
        return ev

    t = simulate({0: events(x)}, define=define)[0]
    assert len(defs) <= 2 * 40 and all(sympy.count_ops(e) < 10 for _, e in defs)
    value = {x: 0.5}
    for s, e in defs:
        value[s] = float(e.xreplace(value))
    num = simulate({0: events(0.5)})[0]
    assert float(t.step_s.xreplace(value)) == pytest.approx(num.step_s)
    assert float(t.idle_s.xreplace(value)) == pytest.approx(num.idle_s)
