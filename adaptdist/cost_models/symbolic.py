"""Costs as sympy expressions in batch size ``B``, sequence length ``T`` and mesh-axis sizes.

A new batch size or world size is then re-costed by substitution, without capturing or
lowering again.

Design: fit the shapes, keep the formulas. The lowered program of one rank has the same
nodes at every (B, T, mesh) that keeps its structure; only its integers change: every dim of
every tensor and every storage's bytes (:meth:`~.schedule.StepSchedule.numbers`). So:

1. Compile at a few sample points around the base point ``(B0, T0, P0)`` (:func:`sample_points`):
   ``(2B0, T0, P0)``, ``(B0, 2T0, P0)``, per mesh axis ``(2B0, T0, P0 with that axis doubled)``,
   and a validation point ``(6B0, 3T0, 2P0)``. The batch stays a multiple of the batch axis.
   The lowering itself may depend on sizes (gradient buckets are filled by bytes, so doubling
   the mesh under FSDP regroups them): a variable whose sample lowers to other nodes is held at
   its base value (:attr:`SymbolicEstimate.fixed`) and the samples are redrawn without it.
2. Fit each integer's trajectory over the samples (:func:`fit_integer`), first as a monomial
   ``c B^a T^b prod_axis p^e`` (exponents from the ratios between the base and each
   perturbed sample, ``c`` a rational, e.g. a local batch ``B/dp``, a score matrix's ``B T^2 / dp``
   elements), else as a sum of two such terms ``c0 m0 + c1 m1`` (e.g. ``T - 1``, or a bucket of
   sharded parameters ``(c0 + c1 T) / dp``). A fit must
   reproduce every sample exactly, validation point included. An integer no form reproduces
   (an uneven shard, ``ceil(N / p)``) keeps its base value and its node is reported in
   :attr:`SymbolicEstimate.unfitted`: the estimate is exact only where that value holds.
3. Put the fitted expressions back into the base schedule and run the *same* cost code as the
   concrete estimate (torch's FLOP formulas on symbolic shapes, the alpha-beta formulas with
   the group size as the mesh-axis symbol, the liveness peak as a ``Max`` over maximal live
   sets, the overlap timeline with ``Max``). So at every sample point the symbolic cost equals
   the concrete one, and between them it is exact wherever the fits hold.

Link and device figures are those of the base cluster (rank ``rank``'s device, the tier of each
group at the base point); a calibrated cluster for another size is a new base.
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Mapping, Sequence

import sympy

from ..errors import AdaptdistError, UsageError
from ..mesh import base_group_name
from .communication import group_members, is_shm_priced, link_cost
from .compute import flop_formulas
from .estimate import collective_costs, rank_events
from .hardware import ClusterLike, as_cost_cluster
from .memory import estimate_memory, optimizer_model
from .numbers import is_symbolic
from .overlap import simulate
from .schedule import StepSchedule, build_schedule

log = logging.getLogger("adaptdist.cost_models")


@dataclass(frozen=True)
class SamplePoint:
    """Global batch size, sequence length and mesh-axis sizes of one compile."""

    batch_size: int
    seq_len: int
    mesh: tuple[tuple[str, int], ...]

    @property
    def mesh_dict(self) -> dict[str, int]:
        return dict(self.mesh)

    def values(self) -> tuple[int, ...]:
        """``(B, T, *axis sizes)``, the order of :attr:`SymbolicEstimate.symbols`."""
        return (self.batch_size, self.seq_len, *(s for _, s in self.mesh))


def sample_points(batch_size: int, seq_len: int, mesh: Mapping[str, int], vary: Sequence[str] | None = None
                  ) -> list[tuple[SamplePoint, str]]:
    """The base point, one perturbation per varied variable, and a validation point (module docstring),
    each with the variable it perturbs (``"base"``, ``"B"``, ``"T"``, an axis name, ``"validation"``).

    Args:
        vary: the variables to vary among ``"B"``, ``"T"`` and the mesh axes (default: all); the others
            stay at their base value in every sample.

    Raises:
        UsageError: a non-positive size, or an unknown variable in ``vary``.
    """
    if batch_size < 1 or seq_len < 1 or any(int(s) < 1 for s in mesh.values()):
        raise UsageError(f"sample point needs positive sizes, got B={batch_size}, T={seq_len}, mesh={dict(mesh)}")
    names = ["B", "T", *mesh]
    vary = list(names if vary is None else vary)
    if set(vary) - set(names):
        raise UsageError(f"cannot vary {sorted(set(vary) - set(names))}; the variables are {names}")
    base = tuple((a, int(s)) for a, s in mesh.items())
    b2 = 2 * batch_size if "B" in vary else batch_size
    pts = [(SamplePoint(batch_size, seq_len, base), "base")]
    if "B" in vary:
        pts.append((SamplePoint(2 * batch_size, seq_len, base), "B"))
    if "T" in vary:
        pts.append((SamplePoint(batch_size, 2 * seq_len, base), "T"))
    for k, (axis, _) in enumerate(base):
        if axis in vary:  # the batch doubles too, so a batch split over the axis stays even
            pts.append((SamplePoint(b2, seq_len, tuple((a, s * (2 if i == k else 1))
                                                       for i, (a, s) in enumerate(base))), axis))
    pts.append((SamplePoint(batch_size * (6 if "B" in vary else 1), seq_len * (3 if "T" in vary else 1),
                            tuple((a, s * (2 if a in vary else 1)) for a, s in base)), "validation"))
    return pts


def make_symbols(mesh_axes: Sequence[str]) -> tuple[sympy.Symbol, ...]:
    """``(B, T, <axis>...)`` as positive integer sympy symbols (an axis symbol is named after its axis)."""
    names = ["B", "T", *mesh_axes]
    return tuple(sympy.Symbol(n, positive=True, integer=True) for n in names)


def _monomials(nvars: int) -> list[tuple[int, ...]]:
    """Exponent tuples for (B, T, axes...): B, T in 0..2, each axis in -1..1, simplest first."""
    ranges = [range(0, 3), range(0, 3)] + [(0, -1, 1)] * (nvars - 2)
    out = list(itertools.product(*ranges))
    return sorted(out, key=lambda e: sum(abs(x) for x in e))


def _mono_value(exps: Sequence[int], point: Sequence[int]) -> Fraction:
    v = Fraction(1)
    for e, x in zip(exps, point):
        v *= Fraction(x) ** e
    return v


def _mono_expr(exps: Sequence[int], symbols: Sequence[sympy.Symbol]) -> sympy.Expr:
    out = sympy.Integer(1)
    for e, s in zip(exps, symbols):
        out *= s ** e
    return out


def fit_integer(values: Sequence[int], points: Sequence[Sequence[int]], symbols: Sequence[sympy.Symbol]
                ) -> sympy.Expr | None:
    """An expression in ``symbols`` that takes ``values[i]`` at ``points[i]`` for every i, or None.

    Tries ``c * m``, then ``c0 * m0 + c1 * m1`` for monomials ``m`` (module docstring), ``c`` rational,
    simplest monomials first; the first form that reproduces every sample wins. A two-term form counts
    only where at least three samples differ in ``(m0, m1)``: with two, any two values fit (``ceil(5/p)``
    at p = 2, 4 would pass as ``1 + 4/p``).
    """
    vals = [Fraction(int(v)) for v in values]
    if all(v == vals[0] for v in vals):
        return sympy.Integer(int(vals[0]))
    monos = _monomials(len(symbols))
    mvals = {e: [_mono_value(e, p) for p in points] for e in monos}
    for e in monos:
        mv = mvals[e]
        c = vals[0] / mv[0]
        if c != 0 and all(c * m == v for m, v in zip(mv, vals)):
            return sympy.Rational(c.numerator, c.denominator) * _mono_expr(e, symbols)
    for e0, e1 in itertools.combinations(monos, 2):
        m0, m1 = mvals[e0], mvals[e1]
        if len(set(zip(m0, m1))) < 3:  # two distinct term vectors: any two values fit, nothing is checked
            continue
        pair = next(((i, j) for i, j in itertools.combinations(range(len(vals)), 2)
                     if m0[i] * m1[j] - m0[j] * m1[i] != 0), None)
        if pair is None:
            continue
        i, j = pair
        det = m0[i] * m1[j] - m0[j] * m1[i]
        c0 = (vals[i] * m1[j] - vals[j] * m1[i]) / det
        c1 = (m0[i] * vals[j] - m0[j] * vals[i]) / det
        if c0 != 0 and c1 != 0 and all(c0 * a + c1 * b == v for a, b, v in zip(m0, m1, vals)):
            return (sympy.Rational(c0.numerator, c0.denominator) * _mono_expr(e0, symbols)
                    + sympy.Rational(c1.numerator, c1.denominator) * _mono_expr(e1, symbols))
    return None


def symbolize(schedules: Sequence[StepSchedule], points: Sequence[SamplePoint], symbols: Sequence[sympy.Symbol]
              ) -> tuple[StepSchedule, tuple[str, ...]]:
    """The first schedule with every integer replaced by its fit over all ``schedules`` (one per point).

    Returns:
        (symbolic schedule, names of nodes with an integer no form fits, kept at the base value).

    Raises:
        UsageError: the schedules differ in structure (the lowering made other nodes at some sample,
            e.g. another bucketing), naming the first node that differs and the sample.
    """
    base = schedules[0]
    ref = base.structure()
    for s, p in zip(schedules[1:], points[1:]):
        if s.structure() != ref:
            first = next((a[0] for a, b in zip(ref[0], s.structure()[0]) if a != b), "the storages")
            raise UsageError(
                f"the rank program at B={p.batch_size}, T={p.seq_len}, mesh={p.mesh_dict} has other nodes than at "
                f"the base point (first difference at {first!r}); its cost cannot be one formula. Estimate each "
                "size concretely (without --symbolic), or pick a base point whose neighbours lower alike "
                "(e.g. a larger --bucket-mb)"
            )
    columns = list(zip(*(s.numbers() for s in schedules)))
    labels = base.number_labels()
    pts = [p.values() for p in points]
    memo: dict[tuple, sympy.Expr | None] = {}
    numbers, unfitted = [], []
    for col, label in zip(columns, labels):
        if col not in memo:
            memo[col] = fit_integer(col, pts, symbols)
        expr = memo[col]
        if expr is None:
            unfitted.append(label.split(":")[0])
            expr = sympy.Integer(int(col[0]))
        numbers.append(expr)
    return base.with_numbers(numbers), tuple(dict.fromkeys(unfitted))


@dataclass(frozen=True)
class SymbolicEstimate:
    """One rank's step cost as expressions in :attr:`symbols` (``B``, ``T``, one per mesh axis).

    Attributes:
        step_s, compute_s, communication_s, idle_s: seconds (``step_s``, ``idle_s`` contain ``Max``).
        flops: FLOPs of the program. communication_bytes: sum of its collectives' full buffers.
        peak_memory_bytes: the liveness peak (a ``Max``); params_bytes, optimizer_state_bytes: its
            always-live parts.
        unfitted: nodes with an integer that is not a function of the symbols in the fitted forms.
        points: the sample points the fits reproduce.
        fixed: variables held at their base value (name, value): the lowering changes its structure
            when they change (e.g. other gradient buckets) or fails, so the formulas hold only at that value.
        timeline: the overlap timeline's intermediate times, in order: ``(timeline_k, its definition)``,
            each a ``Max`` over earlier ones and the symbols. ``step_s`` and ``idle_s`` are written in them
            (substituted out they nest every earlier ``Max``: exponentially long); see :meth:`expanded`.
    """

    symbols: tuple[sympy.Symbol, ...]
    step_s: sympy.Expr
    compute_s: sympy.Expr
    communication_s: sympy.Expr
    idle_s: sympy.Expr
    flops: sympy.Expr
    communication_bytes: sympy.Expr
    peak_memory_bytes: sympy.Expr
    params_bytes: sympy.Expr
    optimizer_state_bytes: sympy.Expr
    unfitted: tuple[str, ...]
    points: tuple[SamplePoint, ...]
    fixed: tuple[tuple[str, int], ...] = ()
    timeline: tuple[tuple[sympy.Symbol, sympy.Expr], ...] = ()

    FIELDS = ("step_s", "compute_s", "communication_s", "idle_s", "flops", "communication_bytes",
              "peak_memory_bytes", "params_bytes", "optimizer_state_bytes")

    def evaluate(self, batch_size: int, seq_len: int, mesh: Mapping[str, int]) -> dict[str, float]:
        """Every field at a point, as floats.

        Raises:
            UsageError: ``mesh`` names other axes than the symbols, or a :attr:`fixed` variable differs from
                its base value.
        """
        axes = [s.name for s in self.symbols[2:]]
        if sorted(mesh) != sorted(axes):
            raise UsageError(f"mesh {dict(mesh)} has other axes than this estimate's {axes}")
        args = (batch_size, seq_len, *(int(mesh[a]) for a in axes))
        given = dict(zip([s.name for s in self.symbols], args))
        for name, value in self.fixed:
            if given[name] != value:
                raise UsageError(f"this estimate holds {name} at {value} (the lowering changes its structure "
                                 f"or fails around it), so it cannot predict {name}={given[name]}; estimate that "
                                 "size concretely")
        return {f: float(v) for f, v in zip(self.FIELDS, self._function(*args))}

    def expanded(self, field: str) -> sympy.Expr:
        """``field`` with the :attr:`timeline` symbols substituted out (fine for a few collectives; the
        expression grows with every max it nests)."""
        expr = getattr(self, field)
        for sym, definition in reversed(self.timeline):
            expr = expr.xreplace({sym: definition})
        return expr

    @functools.cached_property
    def _function(self) -> Callable:
        # one function for all fields; the timeline's definitions are computed once, in order, as
        # common subexpressions
        return sympy.lambdify(self.symbols, [getattr(self, f) for f in self.FIELDS], modules="math",
                              cse=lambda exprs: (list(self.timeline), list(exprs)))


def symbolic_estimate(schedule: StepSchedule, symbols: Sequence[sympy.Symbol], cluster: ClusterLike,
                      optimizer: str = "adamw", algorithm: str = "ring", unfitted: Sequence[str] = (),
                      points: Sequence[SamplePoint] = (), fixed: Mapping[str, int] | None = None
                      ) -> SymbolicEstimate:
    """Cost a symbolic schedule (from :func:`symbolize`) with the concrete estimate's formulas.

    Collectives on group ``adaptdist:<axis>`` have group size ``<axis>``'s symbol (its value when the
    axis is in ``fixed``) and the alpha/beta of the group's links in ``cluster`` at the base point.

    Raises:
        UsageError: a collective group whose axis has no symbol; see also :func:`~.estimate.estimate_schedules`.
    """
    fixed = dict(fixed or {})
    axis_symbol: dict[str, Any] = {s.name: fixed.get(s.name, s) for s in symbols[2:]}
    links = {}
    for n in schedule.nodes:
        key = (n.group or "", n.collective or "")
        if n.kind == "collective" and key not in links:
            members = group_members(key[0], schedule.rank, schedule.mesh)
            links[key] = link_cost(cluster, key[1], members, shm=is_shm_priced(n.target))

    def group_size(node) -> Any:
        axis = base_group_name(node.group or "").partition(":")[2]
        if axis not in axis_symbol:
            raise UsageError(f"collective {node.name} runs on group {node.group!r}, not a mesh axis of "
                             f"{list(axis_symbol)}")
        return axis_symbol[axis]

    opt = optimizer_model(optimizer)
    colls = collective_costs(schedule, cluster, algorithm, group_size=group_size, links=links)
    events, flops, _ = rank_events(schedule, cluster.device(schedule.rank), colls, flop_formulas(), opt)
    definitions: list[tuple[sympy.Symbol, sympy.Expr]] = []

    def define(expr: Any) -> Any:
        if not is_symbolic(expr) or isinstance(expr, sympy.Symbol):
            return expr
        sym = sympy.Symbol(f"timeline_{len(definitions)}", positive=True)
        definitions.append((sym, expr))
        return sym

    t = simulate({schedule.rank: events}, define=define)[schedule.rank]
    mem = estimate_memory(schedule, opt)
    comm_bytes = sympy.Integer(0)
    for c in colls.values():
        comm_bytes += c.n_bytes
    return SymbolicEstimate(tuple(symbols), sympy.sympify(t.step_s), sympy.sympify(t.compute_s),
                            sympy.sympify(t.communication_s), sympy.sympify(t.idle_s), sympy.sympify(flops),
                            comm_bytes, sympy.sympify(mem.peak_bytes), sympy.sympify(mem.params_bytes),
                            sympy.sympify(mem.optimizer_state_bytes), tuple(unfitted), tuple(points),
                            tuple(fixed.items()), tuple(definitions))


def fit_symbolic_estimate(compile_at: Callable[[SamplePoint], Mapping[int, Any]], batch_size: int, seq_len: int,
                          mesh: Mapping[str, int], cluster: Any, optimizer: str = "adamw", algorithm: str = "ring",
                          rank: int = 0) -> SymbolicEstimate:
    """Compile at :func:`sample_points` around ``(batch_size, seq_len, mesh)``, fit, and cost symbolically.

    A variable whose perturbation lowers to a differently structured program (other buckets, other
    nodes), or does not lower at all (an ``AdaptdistError``, e.g. heads not divisible by a doubled
    tensor-parallel axis), is held at its base value (:attr:`SymbolicEstimate.fixed`) and the samples are redrawn
    without it; mesh axes are given up first, then T, then B.

    Args:
        compile_at: a sample point -> ``{rank: RankProgram}`` (e.g. ``compile_model`` of the model built
            for that batch size and sequence length on that mesh).
        cluster: the base point's cluster (:class:`~.hardware.ClusterLike` or ``adaptdist.cluster.Cluster``).
        rank: the rank whose program is costed (every sample must have it; rank 0 always exists).

    Raises:
        UsageError: no variable can vary without changing the program's structure, or the rank is
            missing; plus whatever ``compile_at`` raises.
    """
    schedules: dict[SamplePoint, StepSchedule | None] = {}

    def schedule_at(p: SamplePoint, base: bool = False) -> StepSchedule | None:
        """The rank's schedule at ``p``; None when a sample other than the base does not lower."""
        if p not in schedules:
            try:
                programs = compile_at(p)
            except AdaptdistError as e:
                if base:
                    raise
                log.info("sample B=%d T=%d mesh=%s does not lower (%s: %s)", p.batch_size, p.seq_len, p.mesh_dict,
                         type(e).__name__, e)
                schedules[p] = None
                return None
            if rank not in programs:
                raise UsageError(f"rank {rank} has no program at B={p.batch_size}, T={p.seq_len}, mesh={p.mesh_dict}")
            schedules[p] = build_schedule(programs[rank])
        return schedules[p]

    def structure(p: SamplePoint) -> tuple | None:
        s = schedule_at(p)
        return None if s is None else s.structure()

    names = ["B", "T", *mesh]
    vary = list(names)
    while True:
        pts = sample_points(batch_size, seq_len, mesh, vary)
        base = schedule_at(pts[0][0], base=True).structure()  # type: ignore[union-attr]
        changed = [what for p, what in pts[1:] if structure(p) != base]
        if not changed:
            break
        single = [w for w in changed if w != "validation"]
        drop = single[-1] if single else vary[-1]
        vary.remove(drop)
        if not vary:
            raise UsageError(
                f"the rank program changes its structure whichever of B, T, {', '.join(mesh)} changes (other "
                "buckets or nodes), so its cost is no single formula around this point; estimate each size "
                "concretely, or try a larger --bucket-mb"
            )
    symbols = make_symbols(list(mesh))
    base_values = dict(zip(names, pts[0][0].values()))
    fixed = {n: base_values[n] for n in names if n not in vary}
    points = [p for p, _ in pts]
    sym, unfitted = symbolize([schedules[p] for p in points], points, symbols)
    return symbolic_estimate(sym, symbols, as_cost_cluster(cluster), optimizer, algorithm, unfitted, points, fixed)
