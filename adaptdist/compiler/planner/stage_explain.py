"""Why a node of a chosen pipeline plan got its placement: ``adaptdist explain NODE`` where the plan has stages.

In a pipeline plan a node is placed by the intra-stage ILP of the stage that holds it (:mod:`.stages`: the stage's
layer range on its sub-mesh), not by the whole graph's ILP. :func:`explain_in_stage` finds that stage (its layer
range, sub-mesh and ranks; for interleaved 1F1B the model chunk), re-solves its intra-stage ILP as the stage coster
did (:meth:`.stages.StageCoster.solve_on`, same sub-graph, mesh and memory rule) and explains the node there
(:func:`.explain.explain_axes`: every strategy on each stage-mesh axis, its compute, resharding and peak bytes, and
why the chosen one won). The stage-level choice (schedule, microbatches, the other schedules' times) is the stage
plan's (:func:`.stages.stage_plan_lines`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import UsageError
from .explain import AxisExplanation, explain_axes, find_node


@dataclass(frozen=True)
class StageExplanation:
    """Where a node sits in a pipeline plan and why it is placed so.

    Attributes:
        node: the planning-graph node; name: as asked (a parameter name or the node). layer: its layer's name. stage: the :class:`~.stages.StageChoice` holding
            it. chunk: interleaved 1F1B: the model chunk (index in pipeline order), else None.
        layer_range: ``(first, end)`` layer indices of the range whose intra-stage ILP placed it (the chunk's for
            interleaved). layer_names: those layers.
        mesh: the stage's sub-mesh ``{axis: size}``; batch_axis its batch axis.
        axes: one :class:`~.explain.AxisExplanation` per stage-mesh axis (empty: no intra-stage decision).
        step_s, compute_s, communication_s: the re-solved stage ILP's prediction for the whole batch on the stage,
            seconds (None where no ILP ran). why_no_ilp: why there is no intra-stage decision ('' where there is).
    """

    node: str
    name: str
    layer: str
    stage: Any
    chunk: int | None
    layer_range: tuple[int, int]
    layer_names: tuple[str, ...]
    mesh: dict
    batch_axis: str | None
    axes: list[AxisExplanation] = field(default_factory=list)
    step_s: float | None = None
    compute_s: float | None = None
    communication_s: dict = field(default_factory=dict)
    why_no_ilp: str = ""

    def lines(self) -> list[str]:
        """The stage that holds the node, as lines (the per-axis tables are the caller's)."""
        st = self.stage
        mesh = ",".join(f"{a}={n}" for a, n in self.mesh.items()) or "one rank"
        from .stages import layer_range_text

        names = layer_range_text(self.layer_names)  # as `adaptdist plan` names the stage's layers
        where = f"model chunk {self.chunk} of " if self.chunk is not None else ""
        label = self.node if self.name == self.node else f"{self.name} ({self.node})"
        out = [f"{label} is in layer {self.layer}, held by {where}stage {st.index}: layers {names}, ranks {list(st.ranks)}, sub-mesh {mesh}"
               + (f", batch split over {self.batch_axis}" if self.batch_axis and self.mesh.get(self.batch_axis, 1) > 1
                  else "")]
        if self.why_no_ilp:
            out.append(f"its placement inside the stage: {self.why_no_ilp}")
        else:
            comm = ", ".join(f"{a} {1e3 * t:.3f} ms" for a, t in self.communication_s.items()) or "none"
            out.append(f"its placement is the stage's intra-stage ILP decision (layers {names} on "
                       f"{mesh}, re-solved here as the stage coster solved it): stage step {1e3 * self.step_s:.3f} ms "
                       f"for the whole batch (compute {1e3 * self.compute_s:.3f} ms, communication {comm})")
        return out


def explain_in_stage(captured: Any, cluster: Any, choice: Any, name: str, *, optimizer: str = "adamw",
                     pg: Any = None, time_limit_s: float | None = None) -> StageExplanation:
    """Which stage of ``choice`` (a :class:`~.stages.PipelineChoice`) holds ``name`` (a node or parameter name)
    and why its intra-stage ILP placed it so (module docstring).

    Raises:
        UsageError: ``name`` is not a node or parameter of the graph (with close matches), or it belongs to no
            layer of the pipeline (a value the stages do not cut by).
    """
    from .graph import build_planning_graph
    from .layers import build_layers
    from .stages import ILP_TIME_LIMIT_S, StageCoster, SubCluster, sub_planning_graph

    pg = pg or build_planning_graph(captured, cluster)
    node = find_node(pg, name)
    lg = build_layers(pg)
    li = lg.layer_of.get(node)
    if li is None:
        fqn = pg.nodes[node].fqn
        li = next((L.index for L in lg.layers if fqn and fqn in L.param_fqns), None)
    if li is None:
        raise UsageError(f"{name!r} ({node}) belongs to no layer of the pipeline's layer chain "
                         f"({', '.join(lg.names[:6])}{' ...' if len(lg.names) > 6 else ''}); name a parameter or an "
                         "op of a layer")
    layer = lg.layers[li].name
    chunk = None
    if choice.chunks:
        chunk = next(j for j, c in enumerate(choice.chunks) if layer in c)
        stage = choice.stages[chunk % choice.num_stages]
        names = tuple(choice.chunks[chunk])
    else:
        stage = next(s for s in choice.stages if layer in s.layers)
        names = tuple(stage.layers)
    index = {n: i for i, n in enumerate(lg.names)}
    first, end = index[names[0]], index[names[-1]] + 1
    mesh = {a: n for a, n in stage.mesh.items()}
    base = dict(node=node, name=name, layer=layer, stage=stage, chunk=chunk, layer_range=(first, end), layer_names=names,
                mesh=mesh, batch_axis=stage.batch_axis)
    if len(stage.ranks) == 1:
        return StageExplanation(**base, why_no_ilp=f"the stage is one rank ({stage.ranks[0]}): every op and "
                                "parameter of it runs whole there, no intra-stage decision")
    if stage.source != "ilp":
        return StageExplanation(**base, why_no_ilp=f"the stage was costed {stage.source} (data parallel: "
                                "parameters replicated over its ranks, the batch split, gradients all-reduced), "
                                "not by an intra-stage ILP")
    from ...mesh import Mesh
    from .search import MeshCandidate

    sc = StageCoster(lg, cluster, optimizer, "ilp", time_limit_s or ILP_TIME_LIMIT_S)
    sub = sub_planning_graph(lg, first, end, sc._times(tuple(stage.ranks)))
    c = MeshCandidate(Mesh(tuple(mesh.items())), stage.batch_axis)
    solved = sc.solve_on(sub, c, SubCluster(cluster, stage.ranks))
    if solved is None:
        return StageExplanation(**base, why_no_ilp="re-solving the stage's ILP found no plan (it was costed by "
                                "one when the pipeline was planned: a time limit may differ)")
    ev, sols, _ = solved
    if node not in sub.nodes:
        return StageExplanation(**base, why_no_ilp=f"{node} is not in the stage's sub-graph")
    return StageExplanation(**base, axes=explain_axes(sols, node), step_s=ev.step_s, compute_s=ev.compute_s,
                            communication_s=dict(ev.communication_s))
