"""Plan: the chosen layout of a training step, as data.

A Plan records the mesh, which axis splits the batch, each parameter's placement, and
the resulting placement of every node of the joint graph, with a fingerprint of the
graph it was made for. It is JSON with a schema version: written beside the rank
programs (``plan.json``), readable by people, and loadable to train the same model
again (``adaptdist train --plan plan.json``). A plan applied to another graph is
refused, naming both fingerprints. The automatic planner will produce the same object.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.fx

from . import graph_meta as gmeta
from .errors import PlanMismatchError, UsageError
from .mesh import Mesh
from .placement import Placement, parse_placement

SCHEMA_VERSION = 1


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


@dataclass(frozen=True)
class Plan:
    """A layout of one training step on a mesh (see the module docstring).

    Attributes:
        mesh: axis name -> size, e.g. ``{"dp": 2}``.
        batch_axis: the axis that splits the batch on dim 0, or None.
        param_placements: fqn -> placement text per axis, e.g. ``{"fc1.weight": ["S(0)"]}``
            (parameters absent are replicated).
        redistributions: mesh axis -> the reshard points of that axis's lowering, each
            ``[consumer node, input node, from placement, to placement, collective]`` (gradient
            all_reduces have the consumer ``output``; the collective is ``local`` for a slice).
        node_placements: node name -> its placement text per mesh axis, as each axis's lowering
            annotated it (``"R"`` on axes lowered before the node existed); for reading and explain.
        graph_fingerprint: :func:`graph_fingerprint` of the joint graph the plan was made for.
        name: where the plan came from (a preset, a file, or ``auto``: the planner).
        node_strategies: node name -> its strategy text per mesh axis (``"S(0),R->S(0)"``), as the
            planner chose them; the lowering follows them where the op's rule agrees, and does not
            complete parameter placements of such a plan (the planner decided every one).
    """

    mesh: Mapping[str, int]
    batch_axis: str | None
    param_placements: Mapping[str, list[str]]
    graph_fingerprint: str
    node_placements: Mapping[str, list[str]] = field(default_factory=dict)
    redistributions: Mapping[str, list[list[str]]] = field(default_factory=dict)
    name: str = ""
    schema_version: int = SCHEMA_VERSION
    node_strategies: Mapping[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise UsageError(f"plan schema_version {self.schema_version} is not {SCHEMA_VERSION}")
        if self.batch_axis is not None and self.batch_axis not in self.mesh:
            raise UsageError(f"plan: batch_axis {self.batch_axis!r} is not a mesh axis of {dict(self.mesh)}")
        for f, pls in self.param_placements.items():
            if len(pls) != len(self.mesh):
                raise UsageError(f"plan: {f!r} has {len(pls)} placements for a {len(self.mesh)}-axis mesh")

    @property
    def mesh_spec(self) -> Mesh:
        return Mesh(tuple((a, int(n)) for a, n in self.mesh.items()))

    def axis_placements(self) -> dict[str, dict[str, Placement]]:
        """mesh axis name -> {fqn: Placement} (replicated ones left out)."""
        return {a: self.placements_on_axis(i) for i, a in enumerate(self.mesh)}

    def placements_on_axis(self, axis: int = 0) -> dict[str, Placement]:
        """fqn -> Placement on mesh axis ``axis`` (replicated ones left out)."""
        out = {}
        for f, pls in self.param_placements.items():
            p = parse_placement(pls[axis])
            if type(p).__name__ != "Replicate":
                out[f] = p
        return out

    def axis_hints(self) -> dict[str, dict[str, Any]]:
        """mesh axis name -> {node name: Strategy} from :attr:`node_strategies` (empty for manual plans)."""
        from .strategy import Strategy

        out: dict[str, dict[str, Any]] = {a: {} for a in self.mesh}
        for node, texts in self.node_strategies.items():
            for a, t in zip(self.mesh, texts):
                if t:  # "" on an axis of size 1: nothing to follow there
                    out[a][node] = Strategy.parse(t)
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
        """The plan as indented, key-sorted JSON text."""
        return json.dumps({
            "schema_version": self.schema_version, "name": self.name, "mesh": [[a, n] for a, n in self.mesh.items()],
            "batch_axis": self.batch_axis, "graph_fingerprint": self.graph_fingerprint,
            "param_placements": dict(self.param_placements), "node_placements": dict(self.node_placements),
            "redistributions": {a: [list(r) for r in rs] for a, rs in self.redistributions.items()},
            "node_strategies": dict(self.node_strategies),
        }, indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str, source: str = "<plan>") -> "Plan":
        """Parse a plan.

        Raises:
            UsageError: not JSON, or a field is missing or malformed (names the field).
        """
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(f"plan {source!r} is not JSON: {e}") from None
        for key in ("schema_version", "mesh", "batch_axis", "graph_fingerprint", "param_placements"):
            if key not in doc:
                raise UsageError(f"plan {source!r} lacks the field {key!r}")
        mesh = doc["mesh"]
        if isinstance(mesh, list):  # [[axis, size], ...] keeps the axis order through sort_keys
            if not all(isinstance(m, list) and len(m) == 2 for m in mesh):
                raise UsageError(f"plan {source!r}: field 'mesh' must be [[axis, size], ...]")
            mesh = {a: n for a, n in mesh}
        return Plan(mesh=mesh, batch_axis=doc["batch_axis"], param_placements=doc["param_placements"],
                    graph_fingerprint=doc["graph_fingerprint"], node_placements=doc.get("node_placements", {}),
                    redistributions=doc.get("redistributions", {}),
                    name=doc.get("name", Path(source).name), schema_version=doc["schema_version"],
                    node_strategies=doc.get("node_strategies", {}))

    @staticmethod
    def load(path: str | Path) -> "Plan":
        """Read a plan file.

        Raises:
            UsageError: the file does not exist or is not a valid plan (names the field).
        """
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"plan file {str(p)!r} does not exist")
        return Plan.from_json(p.read_text(), str(p))
