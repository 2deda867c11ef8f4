"""Manual plans: placements users give on parameters by name (globs), as Megatron or Paddle's
``shard_tensor`` would, e.g. ``{"blocks.*.fc.weight": Shard(0), "blocks.*.fc_out.weight": Shard(1)}``."""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


from .errors import UsageError
from .mesh import Mesh

log = logging.getLogger("adaptdist")
from .placement import Placement, Replicate, Shard, parse_placement


def resolve_param_placements(shapes: Mapping[str, tuple[int, ...]], annotations: Mapping[str, Placement | str],
                             keep_globs: bool = True, keep_replicate: bool = False) -> dict[str, Placement]:
    """Map each parameter/buffer name to the placement of the first glob matching it.

    Args:
        shapes: fqn -> global shape of every parameter and buffer.
        annotations: glob -> placement (a Placement or its text, e.g. ``"S(0)"``); order matters.
        keep_globs: when False, a glob that only says ``R`` need not match anything (one mesh
            axis of a multi-axis plan).
        keep_replicate: also return parameters a glob places ``R`` explicitly (completion leaves
            those replicated); by default only sharded ones are returned.

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
        if not hits and not keep_globs and isinstance(placement, Replicate):
            continue
        if not hits:
            close = sorted(shapes)[:6]
            raise UsageError(f"annotation {glob!r} matches no parameter; names look like {close}")
        for f in hits:
            if isinstance(placement, Shard) and placement.dim >= len(shapes[f]):
                raise UsageError(
                    f"annotation {glob!r} shards dim {placement.dim} of {f!r}, which has shape {list(shapes[f])}"
                )
            out.setdefault(f, placement)
    return {f: p for f, p in out.items() if keep_replicate or not isinstance(p, Replicate)}


@dataclass(frozen=True)
class ManualPlan:
    """A manual plan: mesh axis names, the axis that splits the batch, and parameter globs per axis.

    Axis sizes come from ``--mesh`` (or, for a one-axis plan, the world size). ``adaptdist
    train --plan`` takes a preset (``dp``, ``fsdp``, ``tp``, ``dp,tp``) or a YAML file::

        schema_version: 2
        mesh: [dp, tp]           # axis names, outermost first (sizes: --mesh dp=2,tp=2)
        batch_axis: dp           # the axis that splits the batch on dim 0 (null: none)
        params:                  # glob -> one placement per mesh axis; first match wins
          blocks.*.fc.weight: [R, S(0)]
          blocks.*.fc_out.weight: [R, S(1)]

    Version-1 files (one axis: ``mesh_axis``, ``shard_batch``, ``params: {glob: S(0)}``) still load.
    """

    name: str
    mesh_axes: tuple[str, ...]
    batch_axis: str | None
    params: tuple[tuple[str, tuple[str, ...]], ...] = ()
    fsdp_axis: str | None = None

    def __post_init__(self) -> None:
        if self.batch_axis is not None and self.batch_axis not in self.mesh_axes:
            raise UsageError(f"plan {self.name!r}: batch_axis {self.batch_axis!r} is not one of the mesh axes "
                             f"{list(self.mesh_axes)}")
        for glob, pls in self.params:
            if len(pls) != len(self.mesh_axes):
                raise UsageError(f"plan {self.name!r}: {glob!r} gives {len(pls)} placement(s) for the "
                                 f"{len(self.mesh_axes)}-axis mesh {list(self.mesh_axes)}; give one per axis")

    # compatibility with one-axis callers
    @property
    def mesh_axis(self) -> str:
        return self.mesh_axes[0]

    @property
    def shard_batch(self) -> bool:
        return self.batch_axis is not None

    def mesh(self, world_size: int, mesh_arg: str | None = None) -> Mesh:
        """The mesh for ``world_size`` ranks: ``--mesh`` if given (its axes must be this plan's), else
        the one axis sized to the world, else an even split (model-parallel axes get the smaller factor).

        Raises:
            UsageError: ``--mesh`` names other axes or another number of ranks.
        """
        if mesh_arg:
            mesh = Mesh.parse(mesh_arg)
            if mesh.names != self.mesh_axes:
                raise UsageError(f"--mesh {mesh_arg!r} has axes {list(mesh.names)} but plan {self.name!r} uses "
                                 f"{list(self.mesh_axes)}; write e.g. --mesh "
                                 + ",".join(f"{a}=N" for a in self.mesh_axes))
            if mesh.world_size != world_size:
                raise UsageError(f"--mesh {mesh_arg!r} has {mesh.world_size} ranks but the job has {world_size} "
                                 f"(--nproc/--cluster); make them agree")
            return mesh
        if len(self.mesh_axes) == 1:
            return Mesh.one_axis(self.mesh_axes[0], world_size)
        if len(self.mesh_axes) != 2:
            raise UsageError(f"plan {self.name!r} has {len(self.mesh_axes)} mesh axes: give their sizes with --mesh")
        small = max(d for d in range(1, int(world_size ** 0.5) + 1) if world_size % d == 0)
        model_axis = next(a for a in self.mesh_axes if a != self.batch_axis)
        if small == 1:
            log.warning("plan %r on %d ranks: the only even split gives mesh axis %r size 1, so it does nothing; "
                        "pass --mesh to choose the sizes", self.name, world_size, model_axis)
        return Mesh(tuple((a, small if a == model_axis else world_size // small) for a in self.mesh_axes))

    def axis_placements(self, shapes: Mapping[str, tuple[int, ...]], trainable: set[str] | None = None,
                        axis_sizes: Mapping[str, int] | None = None) -> dict[str, dict[str, Placement]]:
        """mesh axis -> {fqn: Placement}: the globs resolved against the model's state (see
        :func:`resolve_param_placements`); ``fsdp_axis`` shards every trainable parameter
        (``trainable``) along that axis, unless a glob placed it there, on the dim :func:`fsdp_dim`
        chooses for the axis's size (``axis_sizes``; 2 when not given): dim 0 when every rank gets
        rows of it, else its largest dim that does (ViT's ``[1, 1, D]`` class token: dim 2); a parameter
        no dim of which every rank can share in (e.g. ``[1]``) is placed ``R`` explicitly (logged)."""
        out: dict[str, dict[str, Placement]] = {}
        for k, axis in enumerate(self.mesh_axes):
            try:
                out[axis] = resolve_param_placements(shapes, {g: pls[k] for g, pls in self.params}, keep_globs=False,
                                                     keep_replicate=True)
            except UsageError as e:  # the plan (a file's name) and the field, before the glob's own words
                raise UsageError(f"plan {self.name!r}: field params, mesh axis {axis!r}: {e}") from None
        if self.fsdp_axis is not None:
            pl = out.setdefault(self.fsdp_axis, {})
            n = (axis_sizes or {}).get(self.fsdp_axis, 2)
            moved = []
            for f, s in shapes.items():
                if len(s) >= 1 and (trainable is None or f in trainable) and f not in pl:
                    d = fsdp_dim(s, n)
                    pl[f] = Replicate() if d is None else Shard(d)
                    if d != 0:
                        moved.append(f"{f} {list(s)} -> {pl[f]!r}")
            if moved:
                log.info("plan %r: %d parameter(s) have fewer than %d rows on dim 0, so FSDP shards another dim or "
                         "keeps them replicated: %s", self.name, len(moved), n, ", ".join(moved))
        return out

    def placements(self, shapes: Mapping[str, tuple[int, ...]], trainable: set[str] | None = None
                   ) -> dict[str, Placement]:
        """One-axis plans: fqn -> Placement (see :meth:`axis_placements`)."""
        assert len(self.mesh_axes) == 1, self.mesh_axes
        return self.axis_placements(shapes, trainable)[self.mesh_axes[0]]

    @staticmethod
    def parse(text: str, model_module=None, model: Any = None):
        """``dp``, ``fsdp``, ``tp`` or ``dp,tp`` (``tp`` uses the model file's ``TP_PLAN`` globs, else the tensor-parallel
        plan a Hugging Face ``model`` carries: :func:`adaptdist.hf_tp_plan.hf_tp_plan`), ``ep``
        (expert parallelism: a one-axis mesh ``ep`` splitting the batch, the model file's ``EP_PLAN`` globs
        sharding the stacked experts' weights on their expert dim), a YAML file, or a saved ``plan.json``
        (returned as a :class:`~adaptdist.plan.Plan`).

        Raises:
            UsageError: an unknown preset, a model without ``TP_PLAN`` (nor a Hugging Face plan) for ``tp``
                (``EP_PLAN`` for ``ep``), or a bad file (names the field).
        """
        presets = {"dp": ("dp",), "fsdp": ("fsdp",), "tp": ("tp",), "dp,tp": ("dp", "tp")}
        key = text.replace(" ", "")
        if key == "ep":  # expert parallelism (issue 14, moe): the batch split on ep, EP_PLAN's experts on it
            return ManualPlan("ep", ("ep",), "ep", tuple((g, (p,)) for g, p in _ep_plan(model_module).items()))
        if key in presets:
            parts = presets[key]
            axes = tuple("dp" if p == "fsdp" else p for p in parts)
            batch = "dp" if "dp" in axes else None
            params: tuple = ()
            if "tp" in parts:
                k = axes.index("tp")
                params = tuple((g, tuple(p if i == k else "R" for i in range(len(axes))))
                               for g, p in _tp_plan(model_module, model).items())
            return ManualPlan(key, axes, batch, params, fsdp_axis="dp" if "fsdp" in parts else None)
        if "," in text:
            raise UsageError(f"--plan {text!r}: the multi-axis preset is dp,tp; for other meshes "
                             "write a plan file (see `adaptdist train --help`)")
        p = Path(text)
        if not p.is_file():
            raise UsageError(f"--plan {text!r} is neither auto, dp, fsdp, tp, dp,tp, ep nor an existing plan file "
                             "(`adaptdist train` and `compile` also take pp, a pipeline)")
        if p.suffix == ".json":
            from .plan import Plan

            return Plan.load(p)  # a saved plan (e.g. programs/plan.json), checked against the graph
        from .safe_load import load_yaml_file

        doc = load_yaml_file(p, "plan file", UsageError)  # bounded size and depth, no duplicate keys
        if not isinstance(doc, dict):
            raise UsageError(f"plan file {text!r}: needs a mapping with 'schema_version: 2'")
        version = doc.get("schema_version")
        if version == 1:
            return _parse_v1(doc, text, p.name)
        if version != 2:
            raise UsageError(f"plan file {text!r}: 'schema_version' is {version!r}; this adaptdist reads 1 and 2: "
                             "start the file with 'schema_version: 2' (fields mesh, batch_axis, params with one "
                             "placement per axis) or 'schema_version: 1' (mesh_axis, shard_batch, params)")
        unknown = set(doc) - {"schema_version", "mesh", "batch_axis", "params"}
        if unknown:
            raise UsageError(f"plan file {text!r}: unknown field(s) {sorted(unknown)}; the fields are "
                             "schema_version, mesh, batch_axis, params")
        axes = doc.get("mesh")
        if not isinstance(axes, list) or not axes or not all(isinstance(a, str) for a in axes):
            raise UsageError(f"plan file {text!r}: field 'mesh' must list the axis names, e.g. [dp, tp]")
        _check_axis_names(axes, f"plan file {text!r}: field 'mesh'")
        params = doc.get("params") or {}
        if not isinstance(params, dict):
            raise UsageError(f"plan file {text!r}: field 'params' must map globs to placement lists like [R, S(0)]")
        out = []
        for g, pls in params.items():
            if isinstance(pls, str) and len(axes) == 1:
                pls = [pls]
            if not isinstance(g, str) or not isinstance(pls, list) or not all(isinstance(x, str) for x in pls):
                raise UsageError(f"plan file {text!r}: params[{g!r}] must be a list with one placement per mesh "
                                 f"axis {axes}, like [R, S(0)]")
            out.append((g, tuple(pls)))
        batch = doc.get("batch_axis")
        if batch is not None and not isinstance(batch, str):
            raise UsageError(f"plan file {text!r}: 'batch_axis' must be a mesh axis name or null")
        try:
            return ManualPlan(p.name, tuple(axes), batch, tuple(out))
        except UsageError as e:
            raise UsageError(f"plan file {text!r}: {e}") from None


def fsdp_dim(shape: tuple[int, ...], n: int) -> int | None:
    """The dim FSDP shards a parameter of ``shape`` on over ``n`` ranks: 0 when it has at least ``n`` rows
    (torch.chunk gives every rank some), else the largest dim that has (the lowest on a tie), else None
    (keep it replicated: some rank would hold an empty shard)."""
    if shape and shape[0] >= n:
        return 0
    ok = [d for d in range(len(shape)) if shape[d] >= n]
    return max(ok, key=lambda d: (shape[d], -d)) if ok else None


def _tp_plan(model_module, model: Any = None) -> dict:
    tp = getattr(model_module, "TP_PLAN", None)
    if tp is None and model is not None:
        from .hf_tp_plan import hf_tp_plan

        tp = hf_tp_plan(model) or None  # a transformers model's own plan (model._tp_plan)
    if tp is None:
        raise UsageError("--plan tp uses the model file's TP_PLAN = {glob: placement} (or, for a Hugging Face "
                         f"model, the plan it carries){'' if model is None else f'; {type(model).__name__} carries none'}"
                         " and this model file defines none: add one, e.g. {'blocks.*.fc.weight': 'S(0)', "
                         "'blocks.*.fc_out.weight': 'S(1)'}, or pass --plan FILE.yaml")
    if not isinstance(tp, dict):
        raise UsageError(f"the model file's TP_PLAN is a {type(tp).__name__}; it must be a dict "
                         "{glob: placement}, e.g. {'fc1.weight': 'S(0)', 'fc2.weight': 'S(1)'}")
    return tp


def _ep_plan(model_module) -> dict:
    ep = getattr(model_module, "EP_PLAN", None)
    if ep is None:
        raise UsageError("--plan ep shards the experts named by the model file's EP_PLAN = {glob: 'S(dim)'} (the "
                         "expert dim of stacked [E, ...] expert weights, e.g. {'moe.w_in': 'S(0)'}); this model file "
                         "defines none: add one, or pass --plan FILE.yaml with a mesh axis ep")
    if not isinstance(ep, dict):
        raise UsageError(f"the model file's EP_PLAN is a {type(ep).__name__}; it must be a dict {{glob: placement}}, "
                         "e.g. {'moe.w_in': 'S(0)', 'moe.w_out': 'S(0)'}")
    return ep


def _check_axis_names(axes: list[str], where: str) -> None:
    """The mesh's own rules on axis names (identifiers, each once), checked where the file is still known.

    Raises:
        UsageError: names ``where`` (the file and field).
    """
    try:
        Mesh(tuple((a, 1) for a in axes))
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None


def _parse_v1(doc: dict, text: str, name: str) -> ManualPlan:
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
    _check_axis_names([axis], f"plan file {text!r}: field 'mesh_axis'")
    try:
        return ManualPlan(name, (axis,), axis if shard_batch else None, tuple((g, (v,)) for g, v in params.items()))
    except UsageError as e:
        raise UsageError(f"plan file {text!r}: {e}") from None
