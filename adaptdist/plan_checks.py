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
    _check_types(doc, source)


def _is_str_list(v: object, lengths: tuple[int, ...] | None = None) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v) and (lengths is None or len(v) in lengths)


def _check_types(doc: object, source: str) -> None:
    """The fields :meth:`~adaptdist.plan.Plan.from_json` reads without checking their JSON type first have it
    (the reshard points and departures it checks itself; fields it does not know are left alone: a newer
    adaptdist may add some)."""
    from . import limits

    def fail(name: str, want: str, got: object) -> UsageError:
        import reprlib

        return UsageError(f"plan {source!r}: field {name!r} must be {want}, got {type(got).__name__} "
                          f"{reprlib.repr(got)}")

    if not isinstance(doc, dict):
        raise UsageError(f"plan {source!r} is not a JSON object")
    v = doc.get("schema_version")
    if "schema_version" in doc and (type(v) is not int):
        raise fail("schema_version", "an integer (1 or 2)", v)
    mesh = doc.get("mesh")
    if "mesh" in doc:
        pairs = mesh if isinstance(mesh, list) else list(mesh.items()) if isinstance(mesh, dict) else None
        if pairs is None or not all(isinstance(m, (list, tuple)) and len(m) == 2 and isinstance(m[0], str)
                                    and type(m[1]) is int and m[1] >= 1 for m in pairs):
            raise fail("mesh", "[[axis name, size >= 1], ...]", mesh)
        names = [m[0] for m in pairs]
        if len(set(names)) != len(names):
            raise fail("mesh", "axes of distinct names", mesh)
        world = 1
        for _, n in pairs:
            world *= n
            if world > limits.max_ranks():
                raise UsageError(f"plan {source!r}: field 'mesh' {mesh!r} gives more than {limits.max_ranks()} "
                                 "ranks, the limit (ADAPTDIST_MAX_RANKS; README, Trust and limits)")
    if doc.get("batch_axis") is not None and not isinstance(doc["batch_axis"], str):
        raise fail("batch_axis", "a mesh axis name or null", doc["batch_axis"])
    for key in ("graph_fingerprint", "name"):
        if key in doc and not isinstance(doc[key], str):
            raise fail(key, "a string", doc[key])

    def placement_map(name: str, value: object) -> None:
        if not isinstance(value, dict) or not all(_is_str_list(x) for x in value.values()):
            raise fail(name, "an object of name -> [placement text per mesh axis]", value)

    for key in ("param_placements", "node_placements", "node_strategies"):
        if key in doc:
            placement_map(key, doc[key])
    low = doc.get("lowered")
    if low is not None:
        if not isinstance(low, dict):
            raise fail("lowered", "an object or null", low)
        for key in ("param_placements", "node_placements"):
            if key in low:
                placement_map(f"lowered.{key}", low[key])


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
