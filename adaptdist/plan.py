"""Plan: the chosen layout of a training step, as data.

A Plan is a decision: the mesh, which axis splits the batch, each parameter's placement and (from
the automatic planner) every node's strategy, with a fingerprint of the graph it was made for. What
the lowering then did with it -- parameter placements it completed, every node's placement, the
reshard points and their collectives, and where it departed from the planner's node strategies --
is a :class:`LoweringRecord` attached to the plan the programs carry (``Plan.lowered``), kept apart
from the decision. In memory everything is typed (:class:`~adaptdist.placement.Placement`,
:class:`~adaptdist.strategy.Strategy`); text exists only at the JSON boundary (``plan.json``:
written beside the rank programs, readable by people, loadable to train the same model again with
``adaptdist train --plan plan.json``; every field is type-checked on load). A plan applied to
another graph is refused, naming both fingerprints.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.fx

from . import graph_meta as gmeta
from .device_assignment import DeviceAssignment
from .errors import PlanMismatchError, UsageError
from .mesh import Mesh
from .placement import Partial, Placement, Replicate, Shard, parse_placement
from .strategy import Strategy

SCHEMA_VERSION = 3
"""3: the pipeline decision (``pipeline``); 2: the decision and the lowering's record apart (``lowered``); 1 (record
and decision mixed) and 2 (no pipeline) still load."""


def graph_fingerprint(gm: torch.fx.GraphModule) -> str:
    """sha256 of the graph's structure: ops, argument wiring, shapes and dtypes (not values)."""
    h = hashlib.sha256()
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def arg(a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            return f"%{index[a]}"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(arg(x) for x in a) + "]"
        return repr(a)

    for n in gm.graph.nodes:
        v = n.meta.get("val")
        sig = f"{list(v.shape)}{v.dtype}" if isinstance(v, torch.Tensor) else ""
        h.update(f"{n.op}|{n.target if n.op != 'placeholder' else gmeta.get_fqn(n) or 'batch'}|"
                 f"{arg(n.args)}|{arg(sorted(n.kwargs.items()))}|{sig}\n".encode())
    return h.hexdigest()


_PLACEMENTS = (Shard, Replicate, Partial)

NodePlacement = Placement | tuple[Placement | None, ...]
"""A node's placement on one axis: one Placement, or one per output of a multi-output op (None: not produced)."""


def _is_node_placement(p: Any) -> bool:
    return isinstance(p, _PLACEMENTS) or (isinstance(p, tuple) and all(x is None or isinstance(x, _PLACEMENTS)
                                                                       for x in p))


def _placements(value: Any, n: int, what: str, multi: bool = False) -> tuple[Placement, ...]:
    """``value`` as a tuple of ``n`` placements (in memory: Placement objects only; ``multi``: or tuples of them)."""
    t = tuple(value)
    ok = _is_node_placement if multi else (lambda p: isinstance(p, _PLACEMENTS))
    if len(t) != n or not all(ok(p) for p in t):
        raise UsageError(f"plan: {what} must be {n} placement(s) (Shard/Replicate/Partial), got {value!r}")
    return t


def _parse_node_placement(text: str) -> NodePlacement:
    """``S(0)`` or, for a multi-output op, ``(P(sum), None)``.

    Raises:
        ValueError: not a placement (from :func:`parse_placement`).
    """
    t = text.strip()
    if t.startswith("(") and t.endswith(")"):
        inner = t[1:-1].strip().rstrip(",")
        return tuple(None if x.strip() == "None" else parse_placement(x) for x in inner.split(", ") if x.strip())
    return parse_placement(t)


@dataclass(frozen=True)
class Redistribution:
    """One reshard point of a lowered mesh axis: ``source``'s value turned from ``src`` into ``dst`` for
    ``consumer`` (``output`` for a gradient's all_reduce), by ``collective`` (a ``_c10d_functional`` op
    name, or ``local`` for a slice)."""

    consumer: str
    source: str
    src: Placement
    dst: Placement
    collective: str

    def as_list(self) -> list[str]:
        return [self.consumer, self.source, repr(self.src), repr(self.dst), self.collective]


@dataclass(frozen=True)
class Departure:
    """Where the lowering did not follow the planner's node strategies: the node, the mesh axis (``""``
    when unknown) and the reason, one line."""

    node: str
    axis: str
    reason: str

    def line(self) -> str:
        where = f"node {self.node!r}" + (f" on mesh axis {self.axis!r}" if self.axis else "")
        return f"{where}: {self.reason}"


@dataclass(frozen=True)
class LoweringRecord:
    """What the lowering did with a plan (see the module docstring).

    Attributes:
        param_placements: fqn -> placement per mesh axis as lowered (completion included; parameters
            absent are replicated).
        node_placements: node name -> its placement per mesh axis, as each axis's lowering annotated it
            (``R`` on axes lowered before the node existed).
        redistributions: mesh axis -> its reshard points, in graph order.
        departures: where the planner's node strategies were not followed (empty: followed, or none given).
    """

    param_placements: Mapping[str, tuple[Placement, ...]] = field(default_factory=dict)
    node_placements: Mapping[str, tuple[NodePlacement, ...]] = field(default_factory=dict)
    redistributions: Mapping[str, tuple[Redistribution, ...]] = field(default_factory=dict)
    departures: tuple[Departure, ...] = ()

    def to_doc(self) -> dict:
        return {
            "param_placements": {f: [repr(p) for p in pls] for f, pls in self.param_placements.items()},
            "node_placements": {n: [repr(p) for p in pls] for n, pls in self.node_placements.items()},
            "redistributions": {a: [r.as_list() for r in rs] for a, rs in self.redistributions.items()},
            "departures": [[d.node, d.axis, d.reason] for d in self.departures],
        }


@dataclass(frozen=True)
class Difference:
    """A parameter or node whose lowered placement differs from the planner's decision (``planned`` None:
    the decision left it open, e.g. a manual plan's unannotated parameter that completion placed)."""

    kind: str  # "param" or "node"
    name: str
    planned: tuple[Placement, ...] | None
    lowered: tuple[Placement, ...]

    def line(self) -> str:
        planned = "open" if self.planned is None else " ".join(map(repr, self.planned))
        return f"{self.kind} {self.name}: planned {planned}, lowered {' '.join(map(repr, self.lowered))}"


# --- pipeline parallelism (issue 15, pp-core): the stage decision -------------------------------------------

PIPELINE_AXIS = "pp"
"""The mesh axis of a pipeline plan's stages (``--mesh pp=2,dp=2``: 2 stage groups of 2 ranks)."""

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb")
"""Pipeline schedules a plan may name (``zb``: zero-bubble ZB-H1)."""


def _times(value: Any, what: str) -> dict[str, float]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                                 and not isinstance(v, bool) for k, v in value.items()):
        raise UsageError(f"plan: {what} must map names to seconds (numbers), got {value!r}")
    return {k: float(v) for k, v in value.items()}


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage of a plan.

    Attributes:
        layers: the layers it holds, in model order: module paths as
            :func:`adaptdist.compiler.pipeline_lowering.pipeline_layers` names them (``"tok_emb"``,
            ``"blocks.0"``, ``"ln_f"``, ...).
        mesh: its sub-mesh, axis -> size (``{"dp": 2}``; ``{}``: one rank).
        ranks: the global ranks running it, in sub-mesh rank order; ``()``: the default layout (stage
            group ``g`` = ranks ``g * n .. g * n + n - 1`` of a mesh ``pp`` first).
        predicted_s: the planner's per-microbatch times, seconds (``forward``, ``backward``, ``weight``...).
    """

    layers: tuple[str, ...]
    mesh: Mapping[str, int] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()
    predicted_s: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (not isinstance(self.layers, tuple) or not self.layers
                or not all(isinstance(x, str) and x for x in self.layers)):
            raise UsageError(f"plan: a pipeline stage's layers must be a non-empty tuple of layer names, got "
                             f"{self.layers!r}")
        if not isinstance(self.mesh, Mapping) or not all(isinstance(a, str) and isinstance(n, int) and
                                                         not isinstance(n, bool) and n >= 1
                                                         for a, n in self.mesh.items()):
            raise UsageError(f"plan: a pipeline stage's mesh must map axis names to sizes >= 1, got {self.mesh!r}")
        if not isinstance(self.ranks, tuple) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                                                        for r in self.ranks):
            raise UsageError(f"plan: a pipeline stage's ranks must be a tuple of ranks >= 0, got {self.ranks!r}")
        size = math.prod(self.mesh.values())
        if self.ranks and len(self.ranks) != size:
            raise UsageError(f"plan: a pipeline stage on mesh {dict(self.mesh)} ({size} ranks) lists "
                             f"{len(self.ranks)} ranks {list(self.ranks)}")
        _times(self.predicted_s, "a pipeline stage's predicted_s")

    def to_doc(self) -> dict:
        return {"layers": list(self.layers), "mesh": [[a, n] for a, n in self.mesh.items()],
                "ranks": list(self.ranks), "predicted_s": dict(self.predicted_s)}


@dataclass(frozen=True)
class PipelineSpec:
    """The pipeline decision of a plan: stages (layer ranges and sub-meshes), microbatches and schedule.

    Attributes:
        stages: the stages in pipeline order (stage 0 takes the batch, the last computes the loss).
        microbatches: microbatches per step (each pipeline replica's rows split evenly into them).
        schedule: one of :data:`SCHEDULES`.
        stages_per_rank: stages each rank group holds (``> 1`` only for ``interleaved-1f1b``: stage ``s``
            runs on group ``s % (len(stages) // stages_per_rank)``).
        predicted_s: the planner's predictions, seconds (``step``, ``bubble``...), for reports.

    Raises:
        UsageError: a field of the wrong type or value (names it and the numbers).
    """

    stages: tuple[StageSpec, ...]
    microbatches: int
    schedule: str = "gpipe"
    stages_per_rank: int = 1
    predicted_s: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.stages, tuple) or not self.stages or not all(isinstance(s, StageSpec)
                                                                             for s in self.stages):
            raise UsageError(f"plan: pipeline stages must be a non-empty tuple of StageSpec, got {self.stages!r}")
        if not isinstance(self.microbatches, int) or isinstance(self.microbatches, bool) or self.microbatches < 1:
            raise UsageError(f"plan: pipeline microbatches must be an integer >= 1, got {self.microbatches!r}")
        if self.schedule not in SCHEDULES:
            raise UsageError(f"plan: pipeline schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        v = self.stages_per_rank
        if not isinstance(v, int) or isinstance(v, bool) or v < 1 or len(self.stages) % v:
            raise UsageError(f"plan: pipeline stages_per_rank {v!r} must be an integer >= 1 dividing the "
                             f"{len(self.stages)} stages")
        if v > 1 and self.schedule != "interleaved-1f1b":
            raise UsageError(f"plan: pipeline stages_per_rank {v} needs schedule 'interleaved-1f1b', not "
                             f"{self.schedule!r}")
        seen: dict[str, int] = {}
        for i, st in enumerate(self.stages):
            for layer in st.layers:
                if layer in seen:
                    raise UsageError(f"plan: layer {layer!r} is in pipeline stages {seen[layer]} and {i}")
                seen[layer] = i
        _times(self.predicted_s, "pipeline predicted_s")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_groups(self) -> int:
        """Rank groups (the ``pp`` axis size): stages / stages_per_rank."""
        return len(self.stages) // self.stages_per_rank

    def to_doc(self) -> dict:
        return {"stages": [s.to_doc() for s in self.stages], "microbatches": self.microbatches,
                "schedule": self.schedule, "stages_per_rank": self.stages_per_rank,
                "predicted_s": dict(self.predicted_s)}

    @staticmethod
    def from_doc(doc: Any, source: str = "<plan>") -> "PipelineSpec":
        """Parse :meth:`to_doc`'s form.

        Raises:
            UsageError: a field missing or malformed (names the file and the field).
        """
        where = f"plan {source!r}: field 'pipeline'"
        if not isinstance(doc, dict):
            raise UsageError(f"{where} must be an object")
        for key in ("stages", "microbatches"):
            if key not in doc:
                raise UsageError(f"{where} lacks {key!r}")
        if not isinstance(doc["stages"], list):
            raise UsageError(f"{where}.stages must be a list of stages")
        stages = []
        for i, st in enumerate(doc["stages"]):
            if not isinstance(st, dict) or not isinstance(st.get("layers"), list):
                raise UsageError(f"{where}.stages[{i}] must be an object with a list 'layers'")
            mesh = st.get("mesh", [])
            if not isinstance(mesh, list) or not all(isinstance(m, list) and len(m) == 2 for m in mesh):
                raise UsageError(f"{where}.stages[{i}].mesh must be [[axis, size], ...], got {mesh!r}")
            ranks = st.get("ranks", [])
            if not isinstance(ranks, list):
                raise UsageError(f"{where}.stages[{i}].ranks must be a list of ranks, got {ranks!r}")
            try:
                stages.append(StageSpec(tuple(st["layers"]), {a: n for a, n in mesh}, tuple(ranks),
                                        st.get("predicted_s", {})))
            except (UsageError, TypeError) as e:
                raise UsageError(f"{where}.stages[{i}]: {e}") from None
        try:
            return PipelineSpec(tuple(stages), doc["microbatches"], doc.get("schedule", "gpipe"),
                                doc.get("stages_per_rank", 1), doc.get("predicted_s", {}))
        except UsageError as e:
            raise UsageError(f"{where}: {e}") from None


@dataclass(frozen=True)
class Plan:
    """A layout of one training step on a mesh: the decision (see the module docstring).

    Attributes:
        mesh: axis name -> size, e.g. ``{"dp": 2}``.
        batch_axis: the axis that splits the batch on dim 0, or None.
        param_placements: fqn -> one placement per axis, e.g. ``{"fc1.weight": (Shard(0),)}``; parameters
            absent are left to the lowering (a manual plan's: completed; an automatic plan lists every
            sharded one, the rest are replicated).
        graph_fingerprint: :func:`graph_fingerprint` of the joint graph the plan was made for.
        node_placements: node name -> the planner's output placement per mesh axis (automatic plans).
        name: where the plan came from (a preset, a file, or ``auto``: the planner).
        node_strategies: node name -> its strategy per mesh axis (None on an axis of size 1), as the
            planner chose them; the lowering follows them where the op's rule agrees, and does not
            complete parameter placements of such a plan (the planner decided every one).
        lowered: what the lowering did with this plan (None on a plan not lowered yet).
        pipeline: the pipeline decision (:class:`PipelineSpec`), or None: no pipeline. A pipeline plan's
            mesh has the axis ``pp`` first (its size: the stage groups), then the stages' sub-mesh axes;
            ``param_placements`` give the ``pp`` column as ``R``.
        devices: the batch rows of each batch-axis coordinate and the device of each rank
            (:class:`~adaptdist.device_assignment.DeviceAssignment`; None: torch.chunk's split, rank r on
            device r).

    Raises:
        UsageError: a field of the wrong type or length (names it).
    """

    mesh: Mapping[str, int]
    batch_axis: str | None
    param_placements: Mapping[str, tuple[Placement, ...]]
    graph_fingerprint: str
    node_placements: Mapping[str, tuple[Placement, ...]] = field(default_factory=dict)
    name: str = ""
    schema_version: int = SCHEMA_VERSION
    node_strategies: Mapping[str, tuple[Strategy | None, ...]] = field(default_factory=dict)
    lowered: LoweringRecord | None = None
    pipeline: PipelineSpec | None = None
    devices: DeviceAssignment | None = None

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise UsageError(f"plan schema_version {self.schema_version} is not {SCHEMA_VERSION}")
        if not isinstance(self.mesh, Mapping) or not all(isinstance(a, str) and isinstance(n, int) and n >= 1
                                                         for a, n in self.mesh.items()):
            raise UsageError(f"plan: mesh must map axis names to sizes >= 1, got {self.mesh!r}")
        if self.batch_axis is not None and self.batch_axis not in self.mesh:
            raise UsageError(f"plan: batch_axis {self.batch_axis!r} is not a mesh axis of {dict(self.mesh)}")
        n = len(self.mesh)
        for f, pls in self.param_placements.items():
            _placements(pls, n, f"param_placements[{f!r}]")
        for node, pls in self.node_placements.items():
            _placements(pls, n, f"node_placements[{node!r}]", multi=True)
        for node, sts in self.node_strategies.items():
            if len(sts) != n or not all(s is None or isinstance(s, Strategy) for s in sts):
                raise UsageError(f"plan: node_strategies[{node!r}] must be {n} Strategy (or None), got {sts!r}")
        if self.lowered is not None and not isinstance(self.lowered, LoweringRecord):
            raise UsageError(f"plan: lowered must be a LoweringRecord, got {type(self.lowered).__name__}")
        if self.pipeline is not None and not isinstance(self.pipeline, PipelineSpec):
            raise UsageError(f"plan: pipeline must be a PipelineSpec, got {type(self.pipeline).__name__}")
        if self.pipeline is not None:
            groups = self.mesh.get(PIPELINE_AXIS)
            if groups != self.pipeline.num_groups:
                raise UsageError(f"plan: a pipeline of {self.pipeline.num_stages} stage(s) on "
                                 f"{self.pipeline.num_groups} rank group(s) needs mesh axis {PIPELINE_AXIS!r} of size "
                                 f"{self.pipeline.num_groups}, the mesh is {dict(self.mesh)}")
            if self.batch_axis == PIPELINE_AXIS:
                raise UsageError(f"plan: the pipeline axis {PIPELINE_AXIS!r} cannot split the batch")
        elif PIPELINE_AXIS in self.mesh and self.mesh[PIPELINE_AXIS] > 1:
            raise UsageError(f"plan: mesh axis {PIPELINE_AXIS!r} of size {self.mesh[PIPELINE_AXIS]} needs a pipeline "
                             "decision (Plan.pipeline)")
        _check_devices(self)

    @property
    def mesh_spec(self) -> Mesh:
        return Mesh(tuple((a, int(n)) for a, n in self.mesh.items()))

    @property
    def world_size(self) -> int:
        """The ranks the plan runs on: its mesh's size, or for a pipeline whose stage groups run on sub-meshes of
        different sizes (``mesh`` then holds the largest), the sum of the groups' sizes."""
        if self.pipeline is not None:
            sizes = [math.prod(st.mesh.values()) for st in self.pipeline.stages[:self.pipeline.num_groups]]
            if len(set(sizes)) > 1:
                return sum(sizes)
        return self.mesh_spec.world_size

    def axis_placements(self) -> dict[str, dict[str, Placement]]:
        """mesh axis name -> {fqn: Placement} of the decision (placements given as replicated are kept:
        the lowering does not complete them)."""
        return {a: {f: pls[i] for f, pls in self.param_placements.items()} for i, a in enumerate(self.mesh)}

    def axis_hints(self) -> dict[str, dict[str, Strategy]]:
        """mesh axis name -> {node name: Strategy} from :attr:`node_strategies` (empty for manual plans)."""
        out: dict[str, dict[str, Strategy]] = {a: {} for a in self.mesh}
        for node, sts in self.node_strategies.items():
            for a, s in zip(self.mesh, sts):
                if s is not None:  # None on an axis of size 1: nothing to follow there
                    out[a][node] = s
        return out

    def differences(self) -> list[Difference]:
        """Where :attr:`lowered` differs from the decision: parameters (on axes of size > 1) whose lowered
        placement is not the planned one or was left open, and nodes whose lowered placement is not the
        planner's (automatic plans). Empty when not lowered."""
        if self.lowered is None:
            return []
        big = [i for i, a in enumerate(self.mesh) if self.mesh[a] > 1]
        out = []
        rep = (Replicate(),) * len(self.mesh)
        for f in sorted(set(self.param_placements) | set(self.lowered.param_placements)):
            low = self.lowered.param_placements.get(f, rep)
            planned = self.param_placements.get(f)
            if planned is None and self.node_strategies:
                planned = rep  # an automatic plan lists its sharded parameters: the rest are decided replicated
            if planned is None:
                if any(not isinstance(low[i], Replicate) for i in big):
                    out.append(Difference("param", f, None, low))
            elif any(planned[i] != low[i] for i in big):
                out.append(Difference("param", f, planned, low))
        for node, planned in self.node_placements.items():
            low = self.lowered.node_placements.get(node)
            if low is not None and any(planned[i] != low[i] for i in big):
                out.append(Difference("node", node, planned, low))
        return out

    def check_graph(self, gm: torch.fx.GraphModule, source: str = "the plan") -> None:
        """Raise :class:`PlanMismatchError` unless ``gm`` is the graph this plan was made for."""
        got = graph_fingerprint(gm)
        if got != self.graph_fingerprint:
            raise PlanMismatchError(
                f"{source} was made for a graph with fingerprint {self.graph_fingerprint[:16]}…, but this model, batch "
                f"and loss give {got[:16]}… (a different model, batch size, sequence length or torch version); "
                "make a new plan for this model"
            )

    def to_json(self) -> str:
        """The plan as indented, key-sorted JSON text: the decision at the top level, the lowering's record
        under ``lowered`` with ``differences`` (one line each) where it departs from the decision."""
        doc = {
            "schema_version": self.schema_version, "name": self.name, "mesh": [[a, n] for a, n in self.mesh.items()],
            "batch_axis": self.batch_axis, "graph_fingerprint": self.graph_fingerprint,
            "param_placements": {f: [repr(p) for p in pls] for f, pls in self.param_placements.items()},
            "node_placements": {n: [repr(p) for p in pls] for n, pls in self.node_placements.items()},
            "node_strategies": {n: [s.text() if s is not None else "" for s in sts]
                                for n, sts in self.node_strategies.items()},
        }
        if self.pipeline is not None:
            doc["pipeline"] = self.pipeline.to_doc()
        if self.lowered is not None:
            doc["lowered"] = dict(self.lowered.to_doc(), differences=[d.line() for d in self.differences()])
        if self.devices is not None:
            doc["devices"] = self.devices.to_doc()
        return json.dumps(doc, indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str, source: str = "<plan>") -> "Plan":
        """Parse a plan (schema 3, 2: no pipeline, or 1: its node placements and reshard points become the
        lowering record).

        Raises:
            UsageError: not JSON, or a field is missing or malformed (names the file and the field).
        """
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise UsageError(f"plan {source!r} is not JSON: {e or 'nested too deeply'}") from None
        from .plan_checks import check_plan_doc

        check_plan_doc(doc, source)  # bounded size and depth; every field's type (adaptdist/plan_checks.py)
        if not isinstance(doc, dict):
            raise UsageError(f"plan {source!r} is not a JSON object")
        for key in ("schema_version", "mesh", "batch_axis", "graph_fingerprint", "param_placements"):
            if key not in doc:
                raise UsageError(f"plan {source!r} lacks the field {key!r}")
        version = doc["schema_version"]
        if version not in (1, 2, SCHEMA_VERSION):
            raise UsageError(f"plan {source!r}: schema_version {version!r} is not 1, 2 or {SCHEMA_VERSION} (a plan "
                             "written by a newer adaptdist? make the plan again with this one)")
        if version < 3 and doc.get("pipeline") is not None:
            raise UsageError(f"plan {source!r}: schema_version {version} has no field 'pipeline' (pipelines came with "
                             f"schema_version 3)")
        mesh = doc["mesh"]
        if isinstance(mesh, list):  # [[axis, size], ...] keeps the axis order through sort_keys
            if not all(isinstance(m, list) and len(m) == 2 for m in mesh):
                raise UsageError(f"plan {source!r}: field 'mesh' must be [[axis, size], ...]")
            mesh = {a: n for a, n in mesh}
        if not isinstance(mesh, dict) or not all(isinstance(a, str) and isinstance(n, int) and not isinstance(n, bool)
                                                 and n >= 1 for a, n in mesh.items()):
            raise UsageError(f"plan {source!r}: field 'mesh' must be [[axis name, size >= 1], ...], got {doc['mesh']!r}")
        n = len(mesh)
        if doc["batch_axis"] is not None and doc["batch_axis"] not in mesh:
            raise UsageError(f"plan {source!r}: field 'batch_axis' is {doc['batch_axis']!r}, not a mesh axis "
                             f"of {list(mesh)}")
        if not isinstance(doc["graph_fingerprint"], str):
            raise UsageError(f"plan {source!r}: field 'graph_fingerprint' must be a string")
        name = doc.get("name", Path(source).name)
        if not isinstance(name, str):
            raise UsageError(f"plan {source!r}: field 'name' must be a string")

        def placements(field_name: str, value: Any, parse: Any = parse_placement) -> dict[str, tuple[Placement, ...]]:
            if not isinstance(value, dict):
                raise UsageError(f"plan {source!r}: field {field_name!r} must map names to placement lists")
            out = {}
            for k, texts in value.items():
                if not isinstance(texts, list) or len(texts) != n or not all(isinstance(t, str) for t in texts):
                    raise UsageError(f"plan {source!r}: field {field_name}[{k!r}] must be {n} placement text(s) "
                                     f"(one per mesh axis), got {texts!r}")
                try:
                    out[k] = tuple(parse(t) for t in texts)
                except ValueError as e:
                    raise UsageError(f"plan {source!r}: field {field_name}[{k!r}]: {e}") from None
            return out

        def strategies(value: Any) -> dict[str, tuple[Strategy | None, ...]]:
            if not isinstance(value, dict):
                raise UsageError(f"plan {source!r}: field 'node_strategies' must map node names to strategy lists")
            out = {}
            for k, texts in value.items():
                if not isinstance(texts, list) or len(texts) != n or not all(isinstance(t, str) for t in texts):
                    raise UsageError(f"plan {source!r}: field node_strategies[{k!r}] must be {n} strategy text(s), "
                                     f"got {texts!r}")
                try:
                    out[k] = tuple(Strategy.parse(t) if t else None for t in texts)
                except ValueError as e:
                    raise UsageError(f"plan {source!r}: field node_strategies[{k!r}]: {e}") from None
            return out

        def redistributions(field_name: str, value: Any) -> dict[str, tuple[Redistribution, ...]]:
            if not isinstance(value, dict) or not all(a in mesh for a in value):
                raise UsageError(f"plan {source!r}: field {field_name!r} must map mesh axes to reshard points")
            out = {}
            for a, rows in value.items():
                got = []
                for row in rows if isinstance(rows, list) else [None]:
                    if not isinstance(row, list) or len(row) not in (4, 5) or not all(isinstance(x, str) for x in row):
                        raise UsageError(f"plan {source!r}: field {field_name}[{a!r}] holds {row!r}; each reshard point "
                                         "is [consumer, source, from, to, collective]")
                    try:
                        src, dst = parse_placement(row[2]), parse_placement(row[3])
                    except ValueError as e:
                        raise UsageError(f"plan {source!r}: field {field_name}[{a!r}]: {e}") from None
                    by = row[4] if len(row) == 5 else _collective_of(src, dst)
                    got.append(Redistribution(row[0], row[1], src, dst, by))
                out[a] = tuple(got)
            return out

        def departures(value: Any) -> tuple[Departure, ...]:
            if not isinstance(value, list) or not all(isinstance(d, list) and len(d) == 3 and
                                                      all(isinstance(x, str) for x in d) for d in value):
                raise UsageError(f"plan {source!r}: field 'lowered.departures' must be [[node, axis, reason], ...]")
            return tuple(Departure(*d) for d in value)

        if version == 1:  # the lowering's record sat at the top level, mixed with the decision
            record = LoweringRecord(placements("param_placements", doc["param_placements"]),
                                    placements("node_placements", doc.get("node_placements", {}), _parse_node_placement),
                                    redistributions("redistributions", doc.get("redistributions", {})))
            return Plan(mesh=mesh, batch_axis=doc["batch_axis"], param_placements=record.param_placements,
                        graph_fingerprint=doc["graph_fingerprint"], name=name,
                        node_strategies=strategies(doc.get("node_strategies", {})), lowered=record)
        pipeline = PipelineSpec.from_doc(doc["pipeline"], source) if doc.get("pipeline") is not None else None
        lowered = None
        if doc.get("lowered") is not None:
            low = doc["lowered"]
            if not isinstance(low, dict):
                raise UsageError(f"plan {source!r}: field 'lowered' must be an object")
            lowered = LoweringRecord(placements("lowered.param_placements", low.get("param_placements", {})),
                                     placements("lowered.node_placements", low.get("node_placements", {}),
                                                _parse_node_placement),
                                     redistributions("lowered.redistributions", low.get("redistributions", {})),
                                     departures(low.get("departures", [])))
        return Plan(mesh=mesh, batch_axis=doc["batch_axis"],
                    param_placements=placements("param_placements", doc["param_placements"]),
                    graph_fingerprint=doc["graph_fingerprint"],
                    node_placements=placements("node_placements", doc.get("node_placements", {}), _parse_node_placement),
                    name=name, node_strategies=strategies(doc.get("node_strategies", {})), lowered=lowered,
                    pipeline=pipeline,
                    devices=None if doc.get("devices") is None else DeviceAssignment.from_doc(doc["devices"], source))

    @staticmethod
    def load(path: str | Path) -> "Plan":
        """Read a plan file.

        Raises:
            UsageError: the file does not exist or is not a valid plan (names the file and the field).
        """
        from .safe_load import read_text

        plan = Plan.from_json(read_text(path, "plan file", UsageError), str(path))  # size-bounded, UTF-8
        object.__setattr__(plan, "_source", str(path))  # not a field: later errors name the file (plan_checks)
        return plan


def _check_devices(plan: Plan) -> None:
    """A plan's :attr:`Plan.devices` fits its mesh: one row count per batch-axis coordinate, one device per rank."""
    d = plan.devices
    if d is None:
        return
    if not isinstance(d, DeviceAssignment):
        raise UsageError(f"plan: devices must be a DeviceAssignment, got {type(d).__name__}")
    if d.batch_rows is not None:
        want = plan.mesh.get(plan.batch_axis, 0) if plan.batch_axis is not None else 0
        if len(d.batch_rows) != want:
            raise UsageError(f"plan: devices.batch_rows {list(d.batch_rows)} must give one row count per coordinate of "
                             f"the batch axis {plan.batch_axis!r} ({want}) of mesh {dict(plan.mesh)}")
    if d.rank_to_device is not None and len(d.rank_to_device) != plan.world_size:
        raise UsageError(f"plan: devices.rank_to_device {list(d.rank_to_device)} must name one device per rank of mesh "
                         f"{dict(plan.mesh)}")


def _collective_of(src: Placement, dst: Placement) -> str:
    """The functional op of a transition (old plans' reshard points without one)."""
    from .redistribute import FUNCTIONAL_OP, transition_collective

    kind = transition_collective(src, dst)
    return FUNCTIONAL_OP[kind] if kind is not None else "local"
