"""The strategy-selection ILP of one mesh axis, solved with OR-Tools (after Alpa, Zheng et al., OSDI 2022, s.4.2).

Given an :class:`~.problem.AxisProblem` -- decisions ``i`` with strategies ``k``, edges ``e`` between
decisions, memory rows ``j`` -- with every cost in integer units of :data:`OBJECTIVE_UNIT_S`
(:func:`to_units` is the only place seconds become units). A decision is one node's strategy after
two reductions made by :func:`~.problem.build_axis_problem`: chains of single-input ops (elementwise,
views, reductions) are coarsened into their producer's decision, and the nodes that play the same part
in repeated layers of one parity (even or odd layers) share one decision (:func:`~.graph.layer_classes`).

================  ===============================================================  ==================
name              constraint                                                       built by
================  ===============================================================  ==================
one_strategy[i]   sum_k x[i,k] = 1,  x[i,k] in {0, 1}, k over the strategies pins   :func:`_strategies`
                  and forbidden axes allow
edge_src[e,p]     sum_q y[e,p,q] = sum_{k: out_k = p} x[src(e),k]                   :func:`_edges`
edge_dst[e,q]     sum_p y[e,p,q] = sum_{k: in_k = q} x[dst(e),k],  0 <= y <= 1      :func:`_edges`
memory[j]         sum_{i,k} mem[j][i,k] x[i,k] <= capacity - fixed[j]               :func:`_memory`
bucket[b]         bucket[b] >= sum of the x (or y) of one decision (edge) whose      :func:`_buckets`
                  choices issue a bucketed collective of kind ``b``, 0 <= bucket <= 1
================  ===============================================================  ==================

objective: ``min sum_{i,k} compute[i,k] x[i,k] + sum_{e,p,q} reshard[e,p,q] y[e,p,q]`` -- the axis's
predicted compute plus resharding time (:mod:`.problem` gives both), plus ``sum_b latency[b] bucket[b]``: the
latency of each bucketed collective kind (gradient reductions, parameter gathers) once per step where any choice
issues one (:attr:`~.problem.AxisProblem.bucket_latency_s`; ``bucket[b]`` may stay continuous: minimized, it is
the largest of 0/1 indicators) -- plus a tie-break: ``w`` times the bytes
the reshards move per rank (``moved[i,k]``, ``moved[e,p,q]``: :func:`~.problem.reshard_bytes`), so of two
choices of equal predicted time the one that communicates less wins (a column-parallel layer whose tiny
all_gather the model prices at 0 ns does not tie with no split). ``w`` (:func:`tie_break_weight`) is
:data:`TIE_BREAK_UNITS` divided by the most bytes any choice could move (the sum over every decision and edge of
its largest entry), so the whole tie-break term of any choice stays below half an objective unit: every time
coefficient is a whole number of units (:func:`to_units`), so two choices whose predicted times differ at all
differ by at least one unit, which the tie-break can never outweigh; it only orders choices of equal time.

The edge variables are indexed by the *placements* at each end (``p`` the producer's output
placement, ``q`` what the consumer needs), not by strategy pairs: strategies that agree on a
placement share a variable, so an edge has at most ``(ndim + 2)^2`` of them. With both marginals
fixed by equalities, ``y`` is the joint indicator of the two choices whenever ``x`` is integral
(the LP relaxation of this "marginal" form is the local polytope, tight on trees), which is why
``y`` may stay continuous. An edge whose end has a single allowed strategy becomes a unary cost
of the other end.

The parameter/gradient/optimizer consistency is in the problem, not extra rows: the gradient's
edge ends at the parameter's own placement (a replicated parameter pays all_reduce, a sharded
one reduce_scatter, by :func:`~.problem.reshard_collective`), and the optimizer state is counted
in the parameter's placement in the memory rows.

Solver: a MIP backend through ``pywraplp`` (HiGHS, then SCIP, then CBC: the first this OR-Tools
has; ``../shared/DESIGN.md`` records that CP-SAT with 2 workers stalls on this machine), one
thread, so the same inputs give the same plan on every rank; a time limit, and the gap between
the best plan and the proven bound reported.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Sequence

from ...errors import InternalError
from .problem import AxisProblem

OBJECTIVE_UNIT_S = 1e-9
"""Resolution of the objective: costs are rounded to whole nanoseconds (:func:`to_units`)."""

SOLVERS = ("HIGHS", "SCIP", "CBC")
RELATIVE_GAP = 1e-4
TIE_BREAK_UNITS = 0.5
"""The most the communication tie-break may add to any choice's objective, in objective units (module docstring):
below the one unit by which two different predicted times must differ, so it decides ties only."""


def to_units(seconds: float) -> float:
    """``seconds`` as a whole number of :data:`OBJECTIVE_UNIT_S` (the objective's integer scaling)."""
    return float(round(seconds / OBJECTIVE_UNIT_S))


@dataclass(frozen=True)
class ILPResult:
    """A solved axis: ``choice[i]`` the strategy index of var ``i``; objective and bound in seconds;
    ``gap`` ``(objective - bound) / objective``; ``status`` ``optimal`` or ``feasible`` (time limit hit)."""

    choice: tuple[int, ...]
    objective_s: float
    bound_s: float
    gap: float
    status: str
    solve_s: float
    num_variables: int
    num_constraints: int
    solver: str


class Infeasible(Exception):
    """The ILP has no solution (the caller turns this into PlanInfeasibleError with the reason)."""


def _new_solver():
    from ortools.linear_solver import pywraplp

    for name in SOLVERS:
        s = pywraplp.Solver.CreateSolver(name)
        if s is not None:
            return s, name
    raise InternalError(f"OR-Tools offers none of the MIP solvers {SOLVERS}; reinstall ortools")


def tie_break_weight(problem: AxisProblem) -> float:
    """Objective units per byte moved (module docstring): :data:`TIE_BREAK_UNITS` over the most bytes any choice
    could move, 0 when no reshard moves anything."""
    most = sum(max((v.reshard_bytes[k] for k in v.allowed), default=0.0) for v in problem.vars)
    most += sum(max((b for row in e.bytes_moved for b in row), default=0.0) for e in problem.edges)
    return TIE_BREAK_UNITS / most if most > 0 else 0.0


def _row(solver, lb: float, ub: float, name: str, terms) -> None:
    """One linear row ``lb <= sum(coef * var) <= ub`` through the low-level API (the natural
    ``solver.Add(expr)`` spends most of the model-building time in Python)."""
    c = solver.Constraint(lb, ub, name)
    for coef, var in terms:
        c.SetCoefficient(var, coef)


def _strategies(solver, problem: AxisProblem) -> list[dict[int, object]]:
    x = []
    for i, v in enumerate(problem.vars):
        xi = {k: solver.BoolVar(f"x[{i},{k}]") for k in v.allowed}
        if not xi:
            raise Infeasible(f"one_strategy[{v.key}]: no strategy left ({'; '.join(v.why_restricted)})")
        _row(solver, 1.0, 1.0, f"one_strategy[{i}]", [(1.0, var) for var in xi.values()])
        x.append(xi)
    return x


def _edges(solver, problem: AxisProblem, x: list[dict[int, object]], unary: list[dict[int, float]],
           unary_bytes: list[dict[int, float]], per_byte: float,
           bucket_rows: list[tuple[str, list]]) -> list:
    terms = []
    for ei, e in enumerate(problem.edges):
        sa, da = problem.vars[e.src].allowed, problem.vars[e.dst].allowed
        moved = e.bytes_moved or [[0.0] * len(e.dst_places) for _ in e.src_places]
        bucket = e.buckets or [[""] * len(e.dst_places) for _ in e.src_places]
        if len(da) == 1 or len(sa) == 1:
            # one end is decided: the edge is a cost of the other end's strategies
            if len(da) == 1:
                q = e.dst_of[da[0]]
                for k in sa:
                    unary[e.src][k] += e.cost_s[e.src_of[k]][q]
                    unary_bytes[e.src][k] += moved[e.src_of[k]][q]
                picks = [(bucket[e.src_of[k]][q], x[e.src][k]) for k in sa]
            else:
                p = e.src_of[sa[0]]
                for k in da:
                    unary[e.dst][k] += e.cost_s[p][e.dst_of[k]]
                    unary_bytes[e.dst][k] += moved[p][e.dst_of[k]]
                picks = [(bucket[p][e.dst_of[k]], x[e.dst][k]) for k in da]
            for b in sorted({b for b, _ in picks if b}):
                bucket_rows.append((b, [var for c, var in picks if c == b]))
            continue
        ps = sorted({e.src_of[k] for k in sa})
        qs = sorted({e.dst_of[k] for k in da})
        y = {(p, q): solver.NumVar(0.0, 1.0, f"y[{ei},{p},{q}]") for p in ps for q in qs}
        for p in ps:
            _row(solver, 0.0, 0.0, f"edge_src[{ei},{p}]",
                 [(1.0, y[p, q]) for q in qs] + [(-1.0, x[e.src][k]) for k in sa if e.src_of[k] == p])
        for q in qs:
            _row(solver, 0.0, 0.0, f"edge_dst[{ei},{q}]",
                 [(1.0, y[p, q]) for p in ps] + [(-1.0, x[e.dst][k]) for k in da if e.dst_of[k] == q])
        terms.extend((to_units(e.cost_s[p][q]) + per_byte * moved[p][q], y[p, q]) for p in ps for q in qs
                     if e.cost_s[p][q] > 0 or moved[p][q] > 0)
        for b in sorted({bucket[p][q] for p in ps for q in qs if bucket[p][q]}):
            bucket_rows.append((b, [y[p, q] for p in ps for q in qs if bucket[p][q] == b]))
    return terms


def _buckets(solver, problem: AxisProblem, x: list[dict[int, object]], bucket_rows: list[tuple[str, list]]) -> list:
    """``bucket[kind] >= sum`` of the indicators of the choices that issue a bucketed ``kind`` collective, one row per
    decision or edge (its indicators sum to at most 1); the objective pays the kind's latency once
    (:attr:`~.problem.AxisProblem.bucket_latency_s`)."""
    for i, v in enumerate(problem.vars):
        for b in sorted({b for k in v.allowed for b in v.buckets[k]}):
            bucket_rows.append((b, [x[i][k] for k in v.allowed if b in v.buckets[k]]))
    z = {b: solver.NumVar(0.0, 1.0, f"bucket[{b}]") for b in sorted({b for b, _ in bucket_rows})}
    for j, (b, vars_) in enumerate(bucket_rows):
        _row(solver, -solver.infinity(), 0.0, f"bucket[{b},{j}]", [(1.0, v) for v in vars_] + [(-1.0, z[b])])
    return [(to_units(problem.bucket_latency_s.get(b, 0.0)), z[b]) for b in z]


def _memory(solver, problem: AxisProblem, x: list[dict[int, object]]) -> None:
    for j in range(len(problem.peak_steps)):
        budget = problem.capacity_bytes - problem.fixed_bytes[j]
        _row(solver, -solver.infinity(), budget, f"memory[{j}]",
             [(v.memory_bytes[j][k], x[i][k]) for i, v in enumerate(problem.vars) for k in v.allowed
              if v.memory_bytes[j][k]])


def solve(problem: AxisProblem, time_limit_s: float = 30.0, hint: Sequence[int] | None = None,
          memory: bool = True) -> ILPResult:
    """Solve ``problem``'s ILP (module docstring); ``hint`` warm-starts from a previous choice.

    Raises:
        Infeasible: no choice satisfies the constraints (e.g. memory), with the constraint family named.
    """
    from ortools.linear_solver import pywraplp

    t0 = time.perf_counter()
    solver, name = _new_solver()
    solver.SuppressOutput()
    solver.SetNumThreads(1)
    solver.SetTimeLimit(int(time_limit_s * 1000))
    if name == "HIGHS":  # setting any parameter turns HiGHS's banner back on
        solver.SetSolverSpecificParametersAsString("output_flag=false")
    x = _strategies(solver, problem)
    unary = [{k: v.compute_s[k] + v.reshard_s[k] for k in v.allowed} for v in problem.vars]
    unary_bytes = [{k: v.reshard_bytes[k] for k in v.allowed} for v in problem.vars]
    per_byte = tie_break_weight(problem)
    bucket_rows: list[tuple[str, list]] = []
    terms = _edges(solver, problem, x, unary, unary_bytes, per_byte, bucket_rows)
    terms += _buckets(solver, problem, x, bucket_rows)
    if memory:
        _memory(solver, problem, x)
    objective = solver.Objective()
    for i, xi in enumerate(x):
        for k, var in xi.items():
            objective.SetCoefficient(var, to_units(unary[i][k]) + per_byte * unary_bytes[i][k])
    for c, var in terms:
        objective.SetCoefficient(var, c)
    objective.SetMinimization()
    if hint is not None and name != "HIGHS":  # HiGHS through pywraplp crashes on hints (measured, ortools 9.15)
        pairs = [(x[i][k], 1.0 if hint[i] == k else 0.0) for i, xi in enumerate(x) for k in xi]
        solver.SetHint([p[0] for p in pairs], [p[1] for p in pairs])
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(pywraplp.MPSolverParameters.RELATIVE_MIP_GAP, RELATIVE_GAP)
    status = solver.Solve(params)
    if status == pywraplp.Solver.INFEASIBLE:
        raise Infeasible("memory" if memory else "strategies")
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        raise Infeasible(f"the solver {name} returned status {status} within {time_limit_s:.0f} s")
    choice = tuple(max(xi, key=lambda k: xi[k].solution_value()) for xi in x)
    obj = problem.objective_s(choice)
    bound = objective.BestBound() * OBJECTIVE_UNIT_S  # with the tie-break's < 0.5 units: capped at the objective
    gap = 0.0 if obj <= 0 else max(0.0, (obj - bound) / obj)
    return ILPResult(choice, obj, min(bound, obj), gap, "optimal" if status == pywraplp.Solver.OPTIMAL else "feasible",
                     time.perf_counter() - t0, solver.NumVariables(), solver.NumConstraints(), name)


def brute_force(problem: AxisProblem, memory: bool = True) -> tuple[tuple[int, ...], float]:
    """The optimum by enumerating every choice (tests, toy problems only); among choices of equal time (to the
    objective's resolution, :data:`OBJECTIVE_UNIT_S`), the one that moves the fewest bytes (the ILP's tie-break).

    Raises:
        Infeasible: no choice fits the memory rows.
    """
    best: tuple[float, tuple[int, ...], tuple[int, float]] | None = None
    for choice in itertools.product(*[v.allowed for v in problem.vars]):
        if memory and not problem.memory_ok(choice):
            continue
        t = problem.objective_s(choice)
        key = (round(t / OBJECTIVE_UNIT_S), problem.communication_bytes(choice))
        if best is None or key < best[2]:
            best = (t, tuple(choice), key)
    if best is None:
        raise Infeasible("memory")
    return best[1], best[0]
