"""Compile-time check that every rank issues the same collectives in the same order.

A rank that calls a different collective, on a different group, or with a different
size than its peers would hang or corrupt data at run time; here it is a compile-time
:class:`~adaptdist.errors.CollectiveMismatchError` naming both ranks and the node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _torch_compat as compat
from ..errors import CollectiveMismatchError
from ..placement import Placement, Replicate
from ..redistribute import FUNCTIONAL_OP, transition_collective
from ..program import RankProgram


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as issued by one rank: op, group, input numel, and the node that issues it."""

    op: str
    group: str
    numel: int
    node: str

    def key(self) -> tuple[str, str, int]:
        return (self.op, self.group, self.numel)


def collective_calls(program: RankProgram) -> list[CollectiveCall]:
    """The ordered collectives of ``program`` (functional collectives, and adaptdist's shared-memory ones under
    the functional collective's name and the mesh axis's group name they carry; waits excluded)."""
    from ..comm_transport import SHM_FLATTEN_OP, SHM_OPS, SHM_START_OPS, is_shm_collective
    from ..mesh import base_group_name

    functional_of = {v: k for ops in (SHM_OPS, SHM_START_OPS) for k, v in ops.items()} | {SHM_FLATTEN_OP: "all_reduce"}
    calls = []
    for n in program.graph_module.graph.nodes:
        if n.op != "call_function":
            continue
        shm = is_shm_collective(n.target)
        if not shm and not compat.is_functional_collective(n.target):
            continue
        x = n.args[0]
        numel = x.meta["val"].numel() if isinstance(x, torch.fx.Node) else sum(a.meta["val"].numel() for a in x)
        op = str(n.target).split(".")[1]
        group = base_group_name(str(n.args[-1])) if shm else str(n.args[-1])  # the axis's, not the shm group's
        calls.append(CollectiveCall(functional_of.get(op, op) if shm else op, group, numel, n.name))
    return calls


def check_collectives(programs: dict[int, RankProgram]) -> None:
    """Raise unless the ranks' collectives can meet: every rank issues the same sequence of (op, group)
    (so no two groups wait on each other in a cycle), and the members of each group pass the same
    sizes to each of that group's collectives.

    Raises:
        CollectiveMismatchError: names both ranks, the position, the nodes and what differs.
    """
    from ..mesh import Mesh

    ranks = sorted(programs)
    p0 = programs[ranks[0]]
    mesh = Mesh(tuple(p0.mesh.items()))
    calls = {r: collective_calls(programs[r]) for r in ranks}
    ref = calls[ranks[0]]
    for r in ranks[1:]:
        _compare(ranks[0], ref, r, calls[r], lambda c: (c.op, c.group))
    for axis in mesh.names:
        group = mesh.group_name(axis)
        for members in mesh.groups(axis):
            first = [c for c in calls[members[0]] if c.group == group]
            for m in members[1:]:
                _compare(members[0], first, m, [c for c in calls[m] if c.group == group], CollectiveCall.key)


def _compare(ra: int, a_calls: list[CollectiveCall], rb: int, b_calls: list[CollectiveCall], key) -> None:
    for i, (a, b) in enumerate(zip(a_calls, b_calls)):
        if key(a) != key(b):
            raise CollectiveMismatchError(
                f"collective #{i} differs between rank {ra} (node {a.node!r}: {a.op} on {a.group}, "
                f"{a.numel} elements) and rank {rb} (node {b.node!r}: {b.op} on {b.group}, {b.numel} elements); "
                "running this would hang or mix data. This is a lowering bug: please report it with the model"
            )
    if len(a_calls) != len(b_calls):
        longer = ra if len(a_calls) > len(b_calls) else rb
        extra = (a_calls if len(a_calls) > len(b_calls) else b_calls)[min(len(a_calls), len(b_calls))]
        raise CollectiveMismatchError(
            f"rank {ra} issues {len(a_calls)} collectives but rank {rb} issues {len(b_calls)}; rank {longer} "
            f"has an extra {extra.op} at node {extra.node!r} on {extra.group}; running this would hang"
        )


def implied_collectives(frm: Placement, to: Placement, at_output: bool) -> set[str]:
    """The ``_c10d_functional`` ops a redistribution ``frm -> to`` lowers to, by the one table
    (:data:`adaptdist.redistribute.TRANSITIONS`); a P->S not at a gradient going to its parameter's shard
    (``at_output``) may be an all_reduce and a local slice instead, so it implies either."""
    kind = transition_collective(frm, to)
    if kind is None:
        return set()
    if kind == "reduce_scatter" and not at_output:
        return {FUNCTIONAL_OP["all_reduce"]}
    return {FUNCTIONAL_OP[kind]}


def check_against_plan(programs: dict[int, RankProgram], plan) -> None:
    """Raise unless the programs do what ``plan`` says: the lowering kept every parameter placement the
    decision fixed (``plan.param_placements``, on axes of size > 1), and on every mesh axis the programs
    issue exactly the kinds of collectives the lowering's reshard points (``plan.lowered``) imply (no
    collective it does not call for, none missing). The messages show the decision and the lowering.

    Raises:
        CollectiveMismatchError: names the parameter (planned vs lowered placement), or the axis, the
            collective kind and a node issuing it, or the reshard point whose collective is missing.
    """
    p0 = programs[min(programs)]
    record = plan.lowered
    if record is None:
        raise CollectiveMismatchError(f"plan {plan.name!r} carries no lowering record to check the programs against; "
                                      "this is a lowering bug: please report it with the model")
    rep = tuple(Replicate() for _ in plan.mesh)
    for f, planned in plan.param_placements.items():
        low = record.param_placements.get(f, rep)
        for k, a in enumerate(plan.mesh):
            if plan.mesh[a] > 1 and planned[k] != low[k]:
                raise CollectiveMismatchError(
                    f"plan {plan.name!r} decided {f} {planned[k]!r} on mesh axis {a!r}, but the lowering placed it "
                    f"{low[k]!r}; this is a lowering bug: please report it with the model")
    calls = collective_calls(p0)
    for axis in plan.mesh:
        group = f"adaptdist:{axis}"
        implied: dict[str, list[str]] = {}
        for r in record.redistributions.get(axis, ()):
            kinds = {r.collective} - {"local"}
            for kind in kinds:
                implied.setdefault(kind, []).append(f"{r.source} -> {r.consumer} ({r.src!r} -> {r.dst!r})")
        issued: dict[str, str] = {}
        for c in calls:
            if c.group == group:
                issued.setdefault(c.op, c.node)
        for kind, node in issued.items():
            if kind not in implied:
                decided = plan.node_strategies.get(node)
                raise CollectiveMismatchError(
                    f"rank {p0.rank} issues {kind} on mesh axis {axis!r} (node {node!r}) but the lowering of plan "
                    f"{plan.name!r} records no reshard point needing {kind} there (its reshard points on {axis!r} "
                    f"imply {sorted(implied) or 'none'}"
                    + (f"; the planner's strategy for {node!r}: "
                       + " / ".join(st.text() if st is not None else "-" for st in decided) if decided else "")
                    + "); this is a lowering bug: please report it with the model"
                )
        for kind, points in implied.items():
            if kind not in issued:
                raise CollectiveMismatchError(
                    f"the lowering of plan {plan.name!r} records a reshard point needing {kind} on mesh axis {axis!r} "
                    f"(at {points[0]}) but rank {p0.rank} issues none there; this is a lowering bug: please report "
                    "it with the model"
                )
