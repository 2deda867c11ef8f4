"""The global planner: the mesh shape and every node's strategy of least predicted step time within memory.

Search:

1. **Mesh shapes** (:func:`mesh_candidates`): every factorisation of the world size into at most
   :data:`MAX_AXES` axes of size >= 2: an optional batch axis ``dp`` (it splits the batch; its
   parameters may be sharded too: ZeRO/FSDP) outermost, then model-parallel axes ``tp``, ``tp2``,
   ``tp3``. Ranks are laid out row-major (the last axis varies fastest), so the innermost axes join
   consecutive ranks, which share a host: the communication-heavy model-parallel axes land on the
   fastest links, the batch axis across hosts; on several hosts the model-parallel axes stay inside
   one. A fixed mesh skips the enumeration.
2. For each shape, **one ILP per mesh axis** (:mod:`.ilp`) with the other axes' strategies held
   fixed: the batch axis first, then the model-parallel axes, then again until no axis changes its
   choice (block coordinate descent, at most :data:`MAX_ROUNDS` rounds), each solve warm-started
   from the last. With many shapes, every shape gets one round and the :data:`REFINE_TOP`
   fastest get the rest. Each ILP is exact for its axis given the others; the joint choice is a local
   optimum of the whole. The per-axis form is what keeps the LLaMA-3-8B case (32 layers, 8x8
   mesh) to a few thousand variables.
3. Every shape's final choice is **evaluated** with every axis known (:func:`evaluate`): compute,
   each axis's communication, peak memory per rank. The fastest shape that fits wins; ties go to
   the earlier shape in :func:`mesh_candidates` order (fewer axes, larger batch axis first); shapes
   within :data:`TIE_TOLERANCE` of the fastest count as ties.

The result is a :class:`~adaptdist.plan.Plan` (``name="auto"``) the lowering takes like any other;
the lowering places activations by its own propagation from the parameters and the batch, and the
ILP's activation choices are kept in ``node_placements`` for ``adaptdist explain``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ...cost_models.memory import optimizer_model
from ...errors import PlanInfeasibleError, UsageError
from ...mesh import Mesh
from ...plan import Plan, graph_fingerprint
from ...placement import Placement, Replicate
from ...strategy import Strategy
from ..capture import CapturedGraph
from .graph import PlanningGraph, build_planning_graph
from .ilp import ILPResult, Infeasible, solve
from .random_walk import random_walk
from .problem import (AxisProblem, Constraints, OtherAxis, build_axis_problem, chosen_strategies, pinned_nodes,
                      strategies_on_axis)

log = logging.getLogger("adaptdist.planner")

MAX_AXES = 3
MAX_ROUNDS = 2
SEARCHERS: dict[str, Callable] = {"ilp": solve, "random_walk": random_walk}

TIE_TOLERANCE = 0.01
"""Mesh shapes predicted within this fraction of the fastest count as ties (the model is not that exact);
the first in :func:`mesh_candidates` order wins: a batch axis before none, fewer axes before more."""
REFINE_TOP = 3
"""With more mesh shapes than this, each gets one round and only this many fastest get the rest."""
BATCH_AXIS = "dp"
MODEL_AXES = ("tp", "tp2", "tp3")


@dataclass(frozen=True)
class MeshCandidate:
    """A mesh shape to try and the axis that splits the batch (None: no batch axis)."""

    mesh: Mesh
    batch_axis: str | None

    def __str__(self) -> str:
        return str(self.mesh)


@dataclass
class Evaluation:
    """A complete choice, costed with every axis known: seconds and bytes per rank."""

    compute_s: float
    overhead_s: float
    communication_s: Mapping[str, float]
    memory_bytes: float
    capacity_bytes: float

    @property
    def step_s(self) -> float:
        """Predicted step time: compute + op overhead + communication (not overlapped: an upper bound)."""
        return self.compute_s + self.overhead_s + sum(self.communication_s.values())

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.capacity_bytes


@dataclass
class AxisSolution:
    """One mesh axis's last problem, the solver's result on it, and ``choice``: the strategy index of each of
    ``problem``'s decisions (the result's, or, when the problem was rebuilt with every other axis final for
    the evaluation, the same strategies re-indexed in the rebuilt problem)."""

    problem: AxisProblem
    result: ILPResult
    choice: tuple[int, ...]


@dataclass
class PlannerResult:
    """What :func:`plan_auto` found: the plan, its prediction, every axis's last ILP, every shape tried,
    and the time of each phase (seconds)."""

    plan: Plan
    candidate: MeshCandidate
    predicted: Evaluation
    axes: dict[str, AxisSolution]
    tried: list[tuple[MeshCandidate, Evaluation | str]]
    phases_s: dict[str, float]
    graph: PlanningGraph
    chosen: dict[str, dict[str, Strategy]] = field(default_factory=dict)
    calibrated: bool = True
    pipeline: Any = None  # the inter-stage planner's PipelineChoice, or why it gave none (str): stages.with_pipeline
    splits: dict[MeshCandidate, str] = field(default_factory=dict)  # each costed shape: what its plan splits, in words

    @property
    def solve_s(self) -> float:
        return self.phases_s.get("solve", 0.0)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Ordered factorisations of ``n`` into 1..``parts`` factors, each >= 2."""
    if n == 1:
        return [()]
    out = [(n,)]
    if parts > 1:
        for d in _divisors(n):
            if 2 <= d < n:
                out.extend((d,) + rest for rest in _factorizations(n // d, parts - 1) if rest)
    return out


def mesh_candidates(world_size: int, batch_size: int, max_axes: int = MAX_AXES, host_size: int | None = None
                    ) -> list[MeshCandidate]:
    """Every mesh shape the planner tries (module docstring), in a fixed order. With ``host_size`` (devices
    per host, on a cluster of several hosts), the model-parallel axes stay inside a host (their product
    at most ``host_size``), unless the batch is too small for that to use every rank."""
    if world_size == 1:
        return [MeshCandidate(Mesh.one_axis(BATCH_AXIS, 1), BATCH_AXIS)]
    out = []
    for dp in sorted(_divisors(world_size), reverse=True):
        rest = world_size // dp
        left = max_axes - (1 if dp > 1 else 0)
        for model in _factorizations(rest, left):
            if rest > 1 and not model:
                continue
            axes = ([(BATCH_AXIS, dp)] if dp > 1 else []) + list(zip(MODEL_AXES, model))
            if axes:
                out.append(MeshCandidate(Mesh(tuple(axes)), BATCH_AXIS if dp > 1 else None))
    if host_size and host_size < world_size:
        inside = [c for c in out if world_size // (c.mesh.size(BATCH_AXIS) if c.batch_axis else 1) <= host_size]
        out = inside or out
    return sorted(out, key=lambda c: (len(c.mesh.names), out.index(c)))


def _axis_order(c: MeshCandidate) -> list[str]:
    """The axes solved, in order: the batch axis first, then the model-parallel ones; axes of size 1 change
    nothing and are left out, unless every axis has size 1 (one rank: its one axis is still costed)."""
    first = [c.batch_axis] if c.batch_axis and c.mesh.size(c.batch_axis) > 1 else []
    order = first + [a for a in c.mesh.names if a != c.batch_axis and c.mesh.size(a) > 1]
    return order or [c.batch_axis or c.mesh.names[0]]


def _host_size(cluster: Any) -> int | None:
    """Devices on the largest host, or None on a single host."""
    hosts: dict[str, int] = {}
    for r in range(cluster.world_size):
        h = cluster.device(r).host
        hosts[h] = hosts.get(h, 0) + 1
    return max(hosts.values()) if len(hosts) > 1 else None


def _capacity_bytes(cluster: Any) -> float:
    """The least device memory in the cluster: every rank runs the same plan, so the smallest must fit."""
    return float(min(cluster.device(r).memory_bytes for r in range(cluster.world_size)))


def evaluate(pg: PlanningGraph, c: MeshCandidate, problems: Mapping[str, AxisProblem],
             choices: Mapping[str, Sequence[int]], capacity_bytes: float) -> Evaluation:
    """Cost a complete choice: compute with every axis's split, each axis's communication, the peak memory.
    ``problems[a]`` must have been built with every other axis solved (as the last round builds them)."""
    axes = [a for a in _axis_order(c)]
    comm = {a: problems[a].communication_s(choices[a]) for a in axes}
    last = problems[axes[-1]]
    compute = last.compute_s(choices[axes[-1]])
    memory = last.memory_bytes(choices[axes[-1]])
    overhead = sum(pn.overhead_s for pn in pg.nodes.values() if pn.kind == "op")
    return Evaluation(compute, overhead, comm, memory, capacity_bytes)


def _hint(problem: AxisProblem, previous: Mapping[str, Strategy] | None) -> list[int] | None:
    if not previous:
        return None
    hint = []
    for v in problem.vars:
        s = previous.get(v.members[0])
        hint.append(v.strategies.index(s) if s in v.strategies and v.strategies.index(s) in v.allowed
                    else v.allowed[0])
    return hint


def solve_candidate(pg: PlanningGraph, c: MeshCandidate, cluster: Any, constraints: Constraints, state_copies: int,
                    capacity_bytes: float, cache: dict, time_limit_s: float,
                    warm: Mapping[str, Mapping[str, Strategy]] | None = None, rounds: int = MAX_ROUNDS,
                    start: Mapping[str, Mapping[str, Strategy]] | None = None, searcher: Callable = solve,
                    replicate_fallback: bool = False) -> tuple[Evaluation, dict[str, AxisSolution], dict[str, dict[str, Strategy]]]:
    """Coordinate descent over ``c``'s axes (module docstring), ``rounds`` rounds from ``start`` (each axis's
    strategies from an earlier call; None: every axis unsolved), each axis solved by ``searcher`` (the ILP's
    :func:`~.ilp.solve`, or the baseline :func:`~.random_walk.random_walk`); returns the evaluation, each
    axis's last problem and result, and each axis's chosen strategies.

    Raises:
        Infeasible: an axis's ILP has no solution (memory, or constraints), with the reason.
    """
    order = _axis_order(c)
    chosen: dict[str, dict[str, Strategy] | None] = {a: (dict(start[a]) if start and a in start else None)
                                                     for a in order}  # a warm plan only hints
    sols: dict[str, AxisSolution] = {}
    strat = {a: strategies_on_axis(pg, c.mesh.size(a), a == c.batch_axis, cache, replicate_fallback) for a in order}
    for rnd in range(rounds):
        changed = False
        for a in order:
            others = [OtherAxis(b, c.mesh.size(b), chosen[b]) for b in order if b != a]
            prob = build_axis_problem(pg, c.mesh, a, c.batch_axis, cluster, strat[a], others, constraints,
                                      state_copies, capacity_bytes)
            prev = chosen[a] or (warm or {}).get(a)
            res = searcher(prob, time_limit_s=time_limit_s, hint=_hint(prob, prev))
            new = chosen_strategies(prob, res.choice)
            changed |= new != chosen[a]
            chosen[a] = new
            sols[a] = AxisSolution(prob, res, res.choice)
            log.debug("mesh %s round %d axis %s: %.4f s (%s, gap %.2g%%, %d vars)", c, rnd, a, res.objective_s,
                      res.status, 100 * res.gap, res.num_variables)
        if not changed or len(order) == 1:
            break
    if len(order) > 1:  # rebuild each axis with all others final, so the evaluation sees every axis
        for a in order:
            others = [OtherAxis(b, c.mesh.size(b), chosen[b]) for b in order if b != a]
            prob = build_axis_problem(pg, c.mesh, a, c.batch_axis, cluster, strat[a], others, constraints,
                                      state_copies, capacity_bytes)
            choice = tuple(prob.vars[i].strategies.index(chosen[a][v.members[0]]) for i, v in enumerate(prob.vars))
            sols[a] = AxisSolution(prob, sols[a].result, choice)
    choices = {a: sols[a].choice for a in order}
    ev = evaluate(pg, c, {a: s.problem for a, s in sols.items()}, choices, capacity_bytes)
    return ev, sols, {a: dict(chosen[a] or {}) for a in order}


def _check_pins(pg: PlanningGraph, constraints: Constraints) -> None:
    from .problem import _matches

    axes_known = {BATCH_AXIS, *MODEL_AXES}
    by_node: dict[tuple[str, str], tuple[str, str]] = {}
    for pat, per_axis in constraints.pins.items():
        unknown = set(per_axis) - axes_known
        if unknown:
            raise UsageError(f"pin {pat!r} names mesh axes {sorted(unknown)}; the planner's axes are "
                             f"{BATCH_AXIS} (splits the batch) and {', '.join(MODEL_AXES)}")
        hit = [m for m in pg.nodes if _matches(pat, pg, m)]
        if not hit:
            raise UsageError(f"pin {pat!r} matches no parameter and no node of this graph")
        for m in hit:
            for axis, place in per_axis.items():
                prev = by_node.get((m, axis))
                if prev is not None and prev[1] != place:
                    raise PlanInfeasibleError(
                        f"pins {prev[0]!r} ({prev[1]} on {axis}) and {pat!r} ({place} on {axis}) contradict "
                        f"each other on {pg.nodes[m].fqn or m!r}; drop one of them")
                by_node[(m, axis)] = (pat, place)


def plan_auto(captured: CapturedGraph, cluster: Any, *, mesh: Mesh | None = None, batch_axis: str | None = None,
              constraints: Constraints | None = None, optimizer: str = "adamw", time_limit_s: float = 30.0,
              previous: Plan | None = None, progress: Callable[[str], None] | None = None,
              searcher: str = "ilp", replicate_fallback: bool = False) -> PlannerResult:
    """Choose the mesh shape (unless ``mesh`` is given) and every node's strategy (module docstring).

    Args:
        captured: the joint graph (fake or real values).
        cluster: a ``ClusterLike`` (``adaptdist.cluster.Cluster`` or ``FixedCluster``): its world size is
            the device count; each device's speed and memory are used (the slowest and the smallest).
        mesh: a fixed mesh; ``batch_axis`` then names its batch axis (default: ``dp`` if it has one).
        constraints: user pins and forbidden axes.
        optimizer: sizes the optimizer state (``adamw``, ``adam``, ``sgd``, ``sgd-momentum``).
        time_limit_s: per ILP solve.
        previous: an earlier automatic plan to warm-start from: on its mesh shape, the descent starts from
            its strategies (and MIP backends that take hints get them).
        searcher: ``ilp`` (the default) or ``random_walk`` (the baseline of :mod:`.random_walk`).
        replicate_fallback: ops with no sharding strategy run whole on every rank (their inputs gathered)
            instead of raising UnsupportedOpError (``--replicate-fallback``).

    Raises:
        PlanInfeasibleError: no mesh shape fits the memory, or the pins contradict (message says which).
        UsageError: a pin names an unknown axis or matches nothing; a fixed mesh does not match the cluster.
    """
    constraints = constraints or Constraints()
    if searcher not in SEARCHERS:
        raise UsageError(f"searcher {searcher!r} is not one of {sorted(SEARCHERS)}")
    search_fn = SEARCHERS[searcher]
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    pg0 = build_planning_graph(captured, cluster)
    pins = pinned_nodes(pg0, constraints)
    pg = build_planning_graph(captured, cluster, pins) if pins else pg0
    _check_pins(pg, constraints)
    phases["graph"] = time.perf_counter() - t0
    world = cluster.world_size
    if mesh is not None:
        if mesh.world_size != world:
            raise UsageError(f"mesh {mesh} has {mesh.world_size} ranks but the cluster has {world}")
        ba = batch_axis if batch_axis is not None else (BATCH_AXIS if BATCH_AXIS in mesh.names else None)
        candidates = [MeshCandidate(mesh, ba)]
    else:
        candidates = mesh_candidates(world, captured.batch_size, host_size=_host_size(cluster))
    pinned_axes = {a for per in constraints.pins.values() for a in per} | {a for v in constraints.forbid.values()
                                                                          for a in v}
    state_copies = optimizer_model(optimizer).state_copies
    capacity = _capacity_bytes(cluster)
    warm = _warm_from_plan(previous)
    cache: dict = {}
    tried: list[tuple[MeshCandidate, Evaluation | str]] = []
    best = None
    t1 = time.perf_counter()
    # screening: one round of every shape; the REFINE_TOP fastest that fit get the remaining rounds
    screen = len(candidates) > REFINE_TOP
    found: dict[MeshCandidate, tuple] = {}
    for k, c in enumerate(candidates):
        if pinned_axes - set(c.mesh.names) and mesh is None:
            tried.append((c, f"lacks the pinned axes {sorted(pinned_axes - set(c.mesh.names))}"))
            continue
        if progress:
            progress(f"mesh {c} ({k + 1} of {len(candidates)} shapes, {time.perf_counter() - t0:.0f} s)")
        try:
            start = warm if warm is not None and previous is not None and dict(previous.mesh) == c.mesh.as_dict() \
                else None
            found[c] = solve_candidate(pg, c, cluster, constraints, state_copies, capacity, cache, time_limit_s, warm,
                                       rounds=1 if screen else MAX_ROUNDS, searcher=search_fn, start=start,
                                       replicate_fallback=replicate_fallback)
        except Infeasible as e:
            tried.append((c, f"infeasible ({e})"))
    if screen:
        ranked = sorted(found, key=lambda c: (not found[c][0].fits, found[c][0].step_s, candidates.index(c)))
        for k, c in enumerate(ranked[:REFINE_TOP]):
            if progress:
                progress(f"refine mesh {c} ({k + 1} of {min(REFINE_TOP, len(ranked))}, {time.perf_counter() - t0:.0f} s)")
            try:
                found[c] = solve_candidate(pg, c, cluster, constraints, state_copies, capacity, cache, time_limit_s,
                                           warm, rounds=MAX_ROUNDS - 1, start=found[c][2], searcher=search_fn,
                                           replicate_fallback=replicate_fallback)
            except Infeasible as e:
                tried.append((c, f"infeasible ({e})"))
                del found[c]
    feasible = []
    what: dict[MeshCandidate, str] = {}
    for c in candidates:
        if c not in found:
            continue
        ev, sols, chosen = found[c]
        if not ev.fits:
            tried.append((c, f"needs {_size(ev.memory_bytes)} per rank, devices hold {_size(capacity)} (memory)"))
            continue
        tried.append((c, ev))
        feasible.append((c, ev, sols, chosen))
        what[c] = what_it_splits(pg, c, chosen)
    if feasible:
        fastest = min(f[1].step_s for f in feasible)
        # shapes predicted within TIE_TOLERANCE of the fastest are ties: the first in canonical order wins
        best = next(f for f in feasible if f[1].step_s <= fastest * (1 + TIE_TOLERANCE))
    tried.sort(key=lambda t: candidates.index(t[0]))
    phases["solve"] = time.perf_counter() - t1
    if best is None:
        raise _infeasible(pg, candidates, tried, capacity, constraints, cluster, state_copies, cache)
    c, ev, sols, chosen = best
    t2 = time.perf_counter()
    plan = _to_plan(captured, pg, c, chosen)
    phases["plan"] = time.perf_counter() - t2
    log.info("planner: mesh %s, batch axis %s, predicted %.2f ms per step, %.2f GiB per rank (%d shapes, %.2f s)",
             c.mesh, c.batch_axis, 1e3 * ev.step_s, ev.memory_bytes / 2**30, len(tried), sum(phases.values()))
    return PlannerResult(plan, c, ev, sols, tried, phases, pg, chosen,
                         calibrated=bool(getattr(cluster, "calibrated", True)), splits=what)


def what_it_splits(pg: PlanningGraph, c: MeshCandidate, chosen: Mapping[str, Mapping[str, Strategy]]) -> str:
    """What the plan of shape ``c`` (its axes' ``chosen`` strategies) splits, in words for the table of shapes tried:
    ``batch over dp``, ``3 parameters sharded on tp``, and for a model axis that shards no parameter but whose nodes
    split their work (their activations' batch dim: data parallelism under that axis's name) ``no parameter
    sharded on tp: 443 of 497 ops split their rows (as data parallel)``, or ``nothing split``."""
    from .problem import splits

    ops = [n for n in pg.nodes if pg.nodes[n].kind == "op"]
    parts = [f"batch over {c.batch_axis}"] if c.batch_axis and c.mesh.size(c.batch_axis) > 1 else []
    for a in c.mesh.names:
        if a == c.batch_axis or c.mesh.size(a) == 1:
            continue
        per = chosen.get(a, {})
        sharded = sum(1 for pn in pg.params() if (s := per.get(pn.name)) is not None and s.outputs
                      and s.outputs[0] is not None and not isinstance(s.outputs[0], Replicate))
        if sharded:
            parts.append(f"{sharded} parameter{'s' if sharded != 1 else ''} sharded on {a}")
            continue
        split = sum(1 for n in ops if (s := per.get(n)) is not None and splits(s))
        parts.append(f"no parameter sharded on {a}: {split} of {len(ops)} ops split their work (as data parallel)"
                     if split else f"nothing split on {a}")
    return "; ".join(parts) or "nothing split"


def _warm_from_plan(previous: Plan | None) -> dict[str, dict[str, Strategy]] | None:
    """Each axis's node strategies from an earlier automatic plan (its ``node_strategies``), to start the
    coordinate descent from; None for a plan without them."""
    if previous is None or not previous.node_strategies:
        return None
    return previous.axis_hints()


def _to_plan(captured: CapturedGraph, pg: PlanningGraph, c: MeshCandidate, chosen: Mapping[str, Mapping[str, Strategy]]
             ) -> Plan:
    names = c.mesh.names

    def place(node: str, a: str) -> Placement:
        s = chosen.get(a, {}).get(node)
        return s.outputs[0] if s is not None and s.outputs and s.outputs[0] is not None else Replicate()

    params = {}
    for pn in pg.params():
        # on an axis of one rank every placement holds the whole tensor: Replicate, as the lowering holds it (a
        # tie the ILP broke toward S(1) there once read "sharded" in plan and explain on one rank)
        pls = tuple(place(pn.name, a) if c.mesh.size(a) > 1 else Replicate() for a in names)
        if any(not isinstance(p, Replicate) for p in pls):
            params[pn.fqn] = pls
    ops = [n for n in pg.nodes if pg.nodes[n].kind == "op"]
    def node_place(node: str, a: str) -> Any:
        s = chosen.get(a, {}).get(node)
        return tuple(s.outputs) if s is not None and len(s.outputs) > 1 else place(node, a)  # one per output

    nodes = {n: tuple(node_place(n, a) for a in names) for n in ops}
    strategies = {n: tuple(chosen.get(a, {}).get(n) for a in names) for n in ops}
    return Plan(mesh=c.mesh.as_dict(), batch_axis=c.batch_axis, param_placements=params,
                graph_fingerprint=graph_fingerprint(captured.gm), node_placements=nodes, name="auto",
                node_strategies=strategies)


def _size(n: float) -> str:
    """Bytes as MiB below 1 GiB, else GiB."""
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _infeasible(pg: PlanningGraph, candidates: Sequence[MeshCandidate], tried, capacity: float,
                constraints: Constraints, cluster: Any, state_copies: int, cache: dict) -> PlanInfeasibleError:
    """The error for "no shape worked", naming the constraint that bit."""
    lines = [f"  mesh {c}: {r if isinstance(r, str) else 'ok'}" for c, r in tried]
    state = sum(sum(p.out_bytes) * (1 + (state_copies + 1 if p.name in pg.grad_of else 0)) for p in pg.params())
    world = cluster.world_size
    dev = min((cluster.device(r) for r in range(world)), key=lambda d: d.memory_bytes)
    if any("memory" in r or "GiB" in r for _, r in tried if isinstance(r, str)):
        acts = max((sum(sum(p.out_bytes) for p in pg.live_at(step)) for step in pg.peak_steps), default=0)
        tips = ["more devices"]
        if acts > state:
            tips.append("a smaller --batch-size or --seq-len")
        if state >= 0.3 * (state + acts) and state_copies > 0:
            tips.append("an optimizer with less state (--optimizer sgd)")
        return PlanInfeasibleError(
            f"no mesh shape fits device memory: rank {dev.rank} ({dev.kind} on {dev.host}) holds "
            f"{_size(capacity)}; the step holds parameters + gradients + optimizer state of {_size(state)} and "
            f"activations of {_size(acts)} at its memory peak (unsharded), at least {_size((state + acts) / world)} "
            f"per rank even if every tensor were split over all {world} ranks. Try {', or '.join(tips)}.\n"
            + "\n".join(lines))
    if constraints.pins or constraints.forbid:
        return PlanInfeasibleError(
            "the pins and forbidden axes leave no consistent strategy for some node on every mesh shape: "
            f"pins {dict(constraints.pins)}, forbidden {dict(constraints.forbid)}; drop or relax one.\n" +
            "\n".join(lines))
    return PlanInfeasibleError("no mesh shape gave a plan:\n" + "\n".join(lines))

