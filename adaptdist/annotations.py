"""Manual plans: placements users give on parameters by name (globs), as Megatron or Paddle's
``shard_tensor`` would, e.g. ``{"blocks.*.fc.weight": Shard(0), "blocks.*.fc_out.weight": Shard(1)}``."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import yaml

from .errors import UsageError
from .placement import Placement, Replicate, Shard, parse_placement


def resolve_param_placements(shapes: Mapping[str, tuple[int, ...]], annotations: Mapping[str, Placement | str]
                             ) -> dict[str, Placement]:
    """Map each parameter/buffer name to the placement of the first glob matching it.

    Args:
        shapes: fqn -> global shape of every parameter and buffer.
        annotations: glob -> placement (a Placement or its text, e.g. ``"S(0)"``); order matters.

    Raises:
        UsageError: a glob matches no parameter, a placement does not parse, or it shards a
            dim the parameter does not have; names the glob and parameter.
    """
    out: dict[str, Placement] = {}
    for glob, pl in annotations.items():
        try:
            placement = parse_placement(pl) if isinstance(pl, str) else pl
        except ValueError as e:
            raise UsageError(f"annotation {glob!r}: {e}") from None
        if not isinstance(placement, (Shard, Replicate)):
            raise UsageError(
                f"annotation {glob!r}: a parameter is stored as S(dim) or R, not {placement!r} "
                "(a Partial value is what a computation produces, not how a weight is held)"
            )
        hits = [f for f in shapes if fnmatch.fnmatchcase(f, glob)]
        if not hits:
            close = sorted(shapes)[:6]
            raise UsageError(f"annotation {glob!r} matches no parameter; names look like {close}")
        for f in hits:
            if isinstance(placement, Shard) and placement.dim >= len(shapes[f]):
                raise UsageError(
                    f"annotation {glob!r} shards dim {placement.dim} of {f!r}, which has shape {list(shapes[f])}"
                )
            out.setdefault(f, placement)
    return {f: p for f, p in out.items() if not isinstance(p, Replicate)}


@dataclass(frozen=True)
class ManualPlan:
    """A manual plan on a 1-D mesh: the axis name, whether it splits the batch, and parameter globs.

    ``adaptdist train --plan`` takes a preset or a YAML file::

        schema_version: 1
        mesh_axis: tp            # the axis name (used in group names and reports)
        shard_batch: false       # split the batch on dim 0 over the axis (data parallel)?
        params:                  # glob -> placement, first match wins; others are replicated
          blocks.*.fc.weight: S(0)
          blocks.*.fc_out.weight: S(1)
    """

    name: str
    mesh_axis: str
    shard_batch: bool
    params: tuple[tuple[str, str], ...] = ()

    def placements(self, shapes: Mapping[str, tuple[int, ...]], trainable: set[str] | None = None
                   ) -> dict[str, Placement]:
        """Resolve the globs against the model's state (see :func:`resolve_param_placements`);
        the ``fsdp`` preset shards every trainable parameter (``trainable``) with a dim on dim 0."""
        if self.name == "fsdp":
            return {f: Shard(0) for f, s in shapes.items() if len(s) >= 1 and (trainable is None or f in trainable)}
        return resolve_param_placements(shapes, dict(self.params))

    @staticmethod
    def parse(text: str, model_module=None):
        """``dp``, ``fsdp``, ``tp`` (the model file's ``TP_PLAN`` globs), a YAML file, or a saved
        ``plan.json`` (returned as a :class:`~adaptdist.plan.Plan`).

        Raises:
            UsageError: an unknown preset, a model without ``TP_PLAN`` for ``tp``, or a bad file
                (names the field).
        """
        if text == "dp":
            return ManualPlan("dp", "dp", True)
        if text == "fsdp":
            return ManualPlan("fsdp", "dp", True)
        if text == "tp":
            tp = getattr(model_module, "TP_PLAN", None)
            if tp is None:
                raise UsageError("--plan tp uses the model file's TP_PLAN = {glob: placement}; this model file "
                                 "defines none: add one, or pass --plan FILE.yaml")
            if not isinstance(tp, dict):
                raise UsageError(f"the model file's TP_PLAN is a {type(tp).__name__}; it must be a dict "
                                 "{glob: placement}, e.g. {'fc1.weight': 'S(0)', 'fc2.weight': 'S(1)'}")
            return ManualPlan("tp", "tp", False, tuple(tp.items()))
        if "," in text:
            raise UsageError(f"--plan {text!r}: multi-axis meshes (dp,tp) are not supported yet; use dp, fsdp or tp")
        p = Path(text)
        if not p.is_file():
            raise UsageError(f"--plan {text!r} is neither dp, fsdp, tp nor an existing plan file")
        if p.suffix == ".json":
            from .plan import Plan

            return Plan.load(p)  # a saved plan (e.g. programs/plan.json), checked against the graph
        try:
            doc = yaml.safe_load(p.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise UsageError(f"plan file {text!r} is not valid YAML: {e}") from None
        if not isinstance(doc, dict):
            raise UsageError(f"plan file {text!r}: needs a mapping with 'schema_version: 1'")
        if doc.get("schema_version") != 1:
            raise UsageError(f"plan file {text!r}: 'schema_version' is {doc.get('schema_version')!r}; this "
                             "adaptdist reads 1")
        unknown = set(doc) - {"schema_version", "mesh_axis", "shard_batch", "params"}
        if unknown:
            raise UsageError(f"plan file {text!r}: unknown field(s) {sorted(unknown)}; the fields are "
                             "schema_version, mesh_axis, shard_batch, params")
        params = doc.get("params", {})
        if not isinstance(params, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()):
            raise UsageError(f"plan file {text!r}: field 'params' must map globs to placements like 'S(0)'")
        axis = doc.get("mesh_axis", "dp")
        shard_batch = doc.get("shard_batch", True)
        if not isinstance(axis, str) or not isinstance(shard_batch, bool):
            raise UsageError(f"plan file {text!r}: 'mesh_axis' must be a string and 'shard_batch' true or false")
        return ManualPlan(p.name, axis, shard_batch, tuple(params.items()))
