"""Reading a planner result: per-layer placement rows, and why one node got its strategy.

:func:`explain` answers ``adaptdist explain NODE``: for each mesh axis, every strategy the node's
decision allowed, costed with every other decision as the planner left it (its compute, the
resharding on its edges, its bytes at the memory peak), and the reason the chosen one won.
Costs are those of the node's whole decision: nodes that play the same part in repeated layers
share one, and so do the elementwise and view ops coarsened into their producer's; their costs
add up.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ...errors import UsageError
from .search import PlannerResult

_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class Alternative:
    """One strategy of a decision on one axis: seconds of compute and of resharding (the node's class,
    neighbours fixed), bytes at the memory peak, and whether it is the chosen one / allowed."""

    strategy: str
    compute_s: float
    reshard_s: float
    memory_bytes: float
    chosen: bool
    allowed: bool

    @property
    def total_s(self) -> float:
        return self.compute_s + self.reshard_s


@dataclass(frozen=True)
class AxisExplanation:
    axis: str
    decision: str
    members: int
    alternatives: list[Alternative]
    reason: str


def layer_rows(result: PlannerResult) -> list[tuple[str, str, int]]:
    """``(parameter pattern, placement per axis, how many parameters)`` rows: parameters whose names differ only
    in a layer index and that have the same placements are one row (``layers.*.attn.wq.weight``)."""
    names = list(result.plan.mesh)
    spec = getattr(result.plan, "pipeline", None)
    rows: dict[tuple[str, str], int] = {}
    for pn in result.graph.params():
        pls = [repr(p) for p in result.plan.param_placements.get(pn.fqn, ())] or ["R"] * len(names)
        text = " ".join(f"{a}:{p}" for a, p in zip(names, pls))
        if spec is not None:  # a pipeline plan: the stage holds it (not "pp:R"), then its stage's sub-mesh placement
            inner = " ".join(f"{a}:{p}" for a, p in zip(names, pls) if a != "pp")
            text = f"stage {stage_of_param(spec, pn.fqn or pn.name)}" + (f", {inner}" if inner else "")
        key = (_LAYER.sub(".*.", pn.fqn or pn.name), text)
        rows[key] = rows.get(key, 0) + 1
    return [(pattern, text, n) for (pattern, text), n in rows.items()]


def stage_of_param(spec: Any, fqn: str) -> int | str:
    """The index of the first stage of pipeline ``spec`` (:class:`~adaptdist.plan.PipelineSpec`) whose layers hold
    parameter ``fqn`` (a tied weight: the first of its stages), or ``"?"``."""
    for i, st in enumerate(spec.stages):
        if any(fqn == layer or fqn.startswith(layer + ".") for layer in st.layers):
            return i
    return "?"


def find_node(graph, name: str) -> str:
    """The planning-graph node ``name`` stands for: a node name, a parameter name, or a getitem of a node.

    Raises:
        UsageError: neither (with close matches).
    """
    if name in graph.nodes:
        return name
    by_fqn = {pn.fqn: pn.name for pn in graph.nodes.values() if pn.fqn}
    if name in by_fqn:
        return by_fqn[name]
    if name in graph.aliases:
        return graph.aliases[name][0]
    close = difflib.get_close_matches(name, list(graph.nodes) + list(by_fqn), n=5)
    raise UsageError(f"{name!r} is not a node or parameter of this graph"
                     + (f"; did you mean {', '.join(close)}?" if close else
                        "; `adaptdist plan --out plan.json` lists the node names under node_placements"))


def explain(result: PlannerResult, name: str) -> list[AxisExplanation]:
    """Why ``name`` (a node name or a parameter name) got its strategy on each axis (module docstring).

    Raises:
        UsageError: ``name`` is neither a node nor a parameter of the planned graph (with close matches).
    """
    return explain_axes(result.axes, find_node(result.graph, name))


def explain_axes(axes: Mapping[str, Any], node: str) -> list[AxisExplanation]:
    """:func:`explain` on ILP solutions ``axes`` (mesh axis -> :class:`~.search.AxisSolution`: the whole graph's,
    or one pipeline stage's intra-stage ILP) for planning-graph node ``node``; axes without it are left out."""
    out = []
    for axis, sol in axes.items():
        prob = sol.problem
        if node not in prob.var_of:
            continue
        choice = list(sol.choice)
        i = prob.var_of[node]
        v = prob.vars[i]
        alts = []
        own = prob.strat_of.get(node, v.strategies)  # a follower's own strategy per decision strategy
        for k, s in enumerate(own):
            reshard = v.reshard_s[k]
            for e in prob.edges:
                if e.src == i:
                    reshard += e.cost_s[e.src_of[k]][e.dst_of[choice[e.dst]]]
                elif e.dst == i:
                    reshard += e.cost_s[e.src_of[choice[e.src]]][e.dst_of[k]]
            mem = max((row[k] for row in v.memory_bytes), default=0.0)
            alts.append(Alternative(s.text(), v.compute_s[k], reshard, mem, k == choice[i], k in v.allowed))
        chosen = alts[choice[i]]
        out.append(AxisExplanation(axis, v.key, len(v.members) + len(v.followers), alts,
                                   _reason(prob, i, choice, alts, chosen)))
    return out


def lowered_lines(plan, node: str, fqn: str | None = None) -> list[str]:
    """What the lowering did with ``node`` under ``plan`` (a plan carrying its :class:`~adaptdist.plan.LoweringRecord`,
    as the lowered programs do): its placement per mesh axis against the planner's, and the lowering's departures
    from the planner's strategies (``adaptdist explain`` prints these lines). ``fqn``: the parameter ``node``
    holds (its planned placement is the plan's parameter placement, replicated when the plan lists none)."""
    record = plan.lowered
    if record is None:
        return ["(not lowered)"]
    out = []
    low = record.node_placements.get(node)
    planned = plan.node_placements.get(node)
    if fqn is not None:
        from ...placement import Replicate

        planned = plan.param_placements.get(fqn, tuple(Replicate() for _ in plan.mesh))
    if low is None:
        out.append(f"lowered: {node} is not a node of the lowered graph (a view or an op the lowering rewrote)")
    else:
        text = ", ".join(f"{a}: {p!r}" for a, p in zip(plan.mesh, low))
        if planned is None or tuple(planned) == tuple(low):
            out.append(f"lowered: {text}" + (" (as planned)" if planned is not None else ""))
        else:
            out.append(f"lowered: {text}; differs from the planner's "
                       + ", ".join(f"{a}: {p!r}" for a, p in zip(plan.mesh, planned)))
    out += [f"departure: {d.line()}" for d in record.departures]
    return out


def _reason(prob, i: int, choice: list[int], alts: list[Alternative], chosen: Alternative) -> str:
    v = prob.vars[i]
    cheaper = [(k, a) for k, a in enumerate(alts) if a.total_s < chosen.total_s - 1e-12]
    tied = [a.strategy for a in alts if a is not chosen and a.allowed and abs(a.total_s - chosen.total_s) <= 1e-12]
    if not cheaper:
        why = "it costs least given every other decision"
        if tied:
            why = (f"it costs least given every other decision, tied with {', '.join(tied)} (among equals the "
                   "solver's first optimum stands)")
        if len(v.allowed) < len(v.strategies):
            why += f" among those allowed ({'; '.join(v.why_restricted)})"
        return why
    k, best = min(cheaper, key=lambda t: t[1].total_s)
    if not best.allowed:
        return f"{best.strategy} would be {1e3 * (chosen.total_s - best.total_s):.3f} ms faster but is ruled out " \
               f"({'; '.join(v.why_restricted)})"
    trial = list(choice)
    trial[i] = k
    if not prob.memory_ok(trial):
        extra = best.memory_bytes - chosen.memory_bytes
        return (f"{best.strategy} would be {1e3 * (chosen.total_s - best.total_s):.3f} ms faster but needs "
                f"{extra / 2**20:,.1f} MiB more at the memory peak, beyond the device's "
                f"{prob.capacity_bytes / 2**30:.2f} GiB")
    return (f"{best.strategy} alone would be {1e3 * (chosen.total_s - best.total_s):.3f} ms faster here, but the "
            "joint choice is cheaper overall (it changes what this node's neighbours pay, on this or another axis)")
