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
    """Raise if any rank's ordered collectives differ from rank 0's.

    Raises:
        CollectiveMismatchError: names both ranks, the position, the nodes and what differs.
    """
    ranks = sorted(programs)
    ref = collective_calls(programs[ranks[0]])
    for r in ranks[1:]:
        calls = collective_calls(programs[r])
        for i, (a, b) in enumerate(zip(ref, calls)):
            if a.key() != b.key():
                raise CollectiveMismatchError(
                    f"collective #{i} differs between rank {ranks[0]} (node {a.node!r}: {a.op} on {a.group}, "
                    f"{a.numel} elements) and rank {r} (node {b.node!r}: {b.op} on {b.group}, {b.numel} elements); "
                    "running this would hang or mix data. This is a lowering bug: please report it with the model"
                )
        if len(calls) != len(ref):
            longer, n = (ranks[0], len(ref)) if len(ref) > len(calls) else (r, len(calls))
            extra = (ref if len(ref) > len(calls) else calls)[min(len(ref), len(calls))]
            raise CollectiveMismatchError(
                f"rank {ranks[0]} issues {len(ref)} collectives but rank {r} issues {len(calls)}; rank {longer} "
                f"has an extra {extra.op} at node {extra.node!r}; running this would hang"
            )
