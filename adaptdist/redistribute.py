"""Which collective turns one placement into another along one mesh axis: the one table.

The planner costs a transition with it (``compiler/planner/problem.py``), the lowering inserts it
(``passes/insert_redistributes.py``) and the plan-vs-emitted check expects it
(``compiler/consistency.py``). A transition is keyed by the kinds of its two placements
(``S``, ``R``, ``P``; ``S*`` for a shard on another dim than the source's):

======  ======  ==============  =========================================================
from    to      collective      note
======  ======  ==============  =========================================================
P       R       all_reduce
P       S       reduce_scatter  the lowering falls back to all_reduce + a local slice where
                                the consumer's rows are not torch.chunk blocks of groups
S       R       all_gather
S       S*      all_to_all      a shard of another dim
S       P       all_gather      then every rank but one zeroes its copy (local)
R       S       (local)         each rank slices its own rows
R       P       (local)         every rank but one zeroes its copy
======  ======  ==============  =========================================================
"""

from __future__ import annotations

from .placement import Partial, Placement, Replicate, Shard

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
"""Collective kinds, as the cost model names them."""

FUNCTIONAL_OP = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
                 "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single"}
"""Collective kind -> the ``_c10d_functional`` op the rank programs call for it."""

KIND_OF_OP = {op: kind for kind, op in FUNCTIONAL_OP.items()}
"""``_c10d_functional`` op name -> collective kind."""

TRANSITIONS: dict[tuple[str, str], str | None] = {
    ("P", "R"): "all_reduce",
    ("P", "S"): "reduce_scatter",
    ("S", "R"): "all_gather",
    ("S", "S*"): "all_to_all",
    ("S", "P"): "all_gather",
    ("R", "S"): None,
    ("R", "P"): None,
}
"""(from kind, to kind) -> collective kind; None: a local op (module docstring)."""


def _kind(p: Placement) -> str:
    return "S" if isinstance(p, Shard) else "P" if isinstance(p, Partial) else "R"


def transition_collective(src: Placement | None, dst: Placement | None) -> str | None:
    """The collective kind (:data:`COLLECTIVES`) that turns ``src`` into ``dst`` on one mesh axis; None when
    nothing is to do (the same placement, or an absent one) or a local op does it (R->S, R->P)."""
    if src is None or dst is None or src == dst:
        return None
    a, b = _kind(src), _kind(dst)
    if a == b == "S":
        b = "S*"
    assert isinstance(src, (Shard, Partial, Replicate)) and isinstance(dst, (Shard, Partial, Replicate))
    return TRANSITIONS.get((a, b))
