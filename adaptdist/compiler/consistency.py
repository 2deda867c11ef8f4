"""Compile-time check that every rank issues the same collectives in the same order.

A rank that calls a different collective, on a different group, or with a different
size than its peers would hang or corrupt data at run time; here it is a compile-time
:class:`~adaptdist.errors.CollectiveMismatchError` naming both ranks and the node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CollectiveMismatchError
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
    """The ordered collectives of ``program`` (functional collectives; waits excluded)."""
    calls = []
    for n in program.graph_module.graph.nodes:
        if n.op != "call_function" or not str(n.target).startswith("_c10d_functional.") or "wait" in str(n.target):
            continue
        x = n.args[0]
        numel = x.meta["val"].numel() if isinstance(x, torch.fx.Node) else sum(a.meta["val"].numel() for a in x)
        calls.append(CollectiveCall(str(n.target).split(".")[1], str(n.args[-1]), numel, n.name))
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


def implied_collectives(frm: str, to: str, at_output: bool) -> set[str]:
    """The collective kinds a redistribution ``frm -> to`` (placement texts) lowers to: P->R
    all_reduce; S->R all_gather; S(i)->S(j) all_to_all; P->S reduce_scatter for a gradient going to its
    parameter's shard (``at_output``), else all_reduce and a local slice; R->S a local slice."""
    if frm.startswith("P"):
        return {"reduce_scatter_tensor"} if to.startswith("S") and at_output else {"all_reduce"}
    if frm.startswith("S") and to.startswith("S") and frm != to:
        return {"all_to_all_single"}
    if frm.startswith("S") and frm != to:
        return {"all_gather_into_tensor"}
    return set()


def check_against_plan(programs: dict[int, RankProgram], plan) -> None:
    """Raise unless, on every mesh axis, the programs issue exactly the kinds of collectives the
    plan's reshard points imply (no collective the plan does not call for, none missing).

    Raises:
        CollectiveMismatchError: names the axis, the collective kind and a node issuing it, or
            the reshard point whose collective is missing.
    """
    p0 = programs[min(programs)]
    calls = collective_calls(p0)
    for axis in plan.mesh:
        group = f"adaptdist:{axis}"
        implied: dict[str, list[str]] = {}
        for consumer, src, frm, to, *by in plan.redistributions.get(axis, []):
            kinds = ({by[0]} - {"local"}) if by else implied_collectives(frm, to, consumer == "output")
            for kind in kinds:
                implied.setdefault(kind, []).append(f"{src} -> {consumer} ({frm} -> {to})")
        issued: dict[str, str] = {}
        for c in calls:
            if c.group == group:
                issued.setdefault(c.op, c.node)
        for kind, node in issued.items():
            if kind not in implied:
                raise CollectiveMismatchError(
                    f"rank {p0.rank} issues {kind} on mesh axis {axis!r} (node {node!r}) but plan {plan.name!r} "
                    f"implies no {kind} there (its reshard points on {axis!r} imply {sorted(implied) or 'none'}); "
                    "this is a lowering bug: please report it with the model"
                )
        for kind, points in implied.items():
            if kind not in issued:
                raise CollectiveMismatchError(
                    f"plan {plan.name!r} implies a {kind} on mesh axis {axis!r} (at {points[0]}) but rank "
                    f"{p0.rank} issues none there; this is a lowering bug: please report it with the model"
                )
