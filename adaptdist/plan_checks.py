"""Checks of a saved plan (``plan.json``) beyond :meth:`adaptdist.plan.Plan.from_json`'s field types: the
document's size and depth (:mod:`adaptdist.limits`), and, against the graph it is applied to, the meaning
of every parameter placement -- the parameter exists, a ``S(dim)`` names a dim it has, a stored weight is
not ``Partial`` -- with the same words the YAML plan path uses (:func:`adaptdist.annotations.resolve_param_placements`),
before any lowering pass runs."""

from __future__ import annotations

from typing import Mapping

from .errors import UsageError
from .placement import Partial, Shard


def check_plan_doc(doc: object, source: str) -> None:
    """Refuse a parsed plan document deeper or larger than the limits of :mod:`adaptdist.limits`.

    Raises:
        UsageError: names ``source``.
    """
    from .safe_load import check_shape

    check_shape(doc, f"plan {source!r}", UsageError)


def check_plan_params(plan, shapes: Mapping[str, tuple[int, ...]], source: str | None = None) -> None:
    """Every parameter placement of ``plan`` (a :class:`~adaptdist.plan.Plan`) fits the graph's state tensors
    ``shapes`` (fqn -> global shape); ``source`` names the plan (default: its name).

    Raises:
        UsageError: a placement for a tensor the graph does not have, a Shard of a dim it lacks, or a Partial;
            names the plan file, the field ``param_placements[fqn]`` and the mesh axis.
    """
    src = source or getattr(plan, "_source", None) or plan.name or "the plan"
    axes = list(plan.mesh)
    for fqn, pls in plan.param_placements.items():
        field = f"field param_placements[{fqn!r}]"
        if fqn not in shapes:
            close = sorted(shapes)[:6]
            raise UsageError(f"plan {src!r}: {field} names a parameter this model does not have; names look like "
                             f"{close}")
        shape = list(shapes[fqn])
        for axis, p in zip(axes, pls):
            if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
                raise UsageError(f"plan {src!r}: {field} shards dim {p.dim} of {fqn!r} on mesh axis {axis!r}, "
                                 f"which has shape {shape}")
            if isinstance(p, Partial):
                raise UsageError(f"plan {src!r}: {field} is {p!r} on mesh axis {axis!r}; a parameter is stored as "
                                 "S(dim) or R, not as a Partial value")
