"""The ``adaptdist`` torch.compile backend.

``torch.compile(model, backend="adaptdist")`` (registered through the ``torch_dynamo_backends`` entry
point, so no import is needed) or ``torch.compile(model, backend=adaptdist.backend(cluster=..., plan=...,
constraints=...))``, in a script started by torchrun: each captured graph is

1. captured for all ranks at once (:mod:`.dynamo_capture`: the DDP input contract, each rank passing
   its own inputs),
2. checked to be the same graph on every rank (a rank whose graph differs is refused on every rank,
   naming it: nobody is left waiting in a collective),
3. planned once, on rank 0, and the plan broadcast (or lowered from the given manual plan),
4. lowered into every rank's program (the same passes as ``adaptdist train``), split into forward and
   backward (:mod:`.partition`), and run by :class:`~adaptdist.runtime.compiled_step.CompiledStep`.

Without an initialized process group the world is one rank (the program equals eager). A graph break
splits the forward into several graphs; each is planned alone, its boundary tensors split over the
ranks as the input contract says, and a warning names the break.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx

from .. import _torch_compat as compat
from ..errors import AdaptdistError, PlanMismatchError, UsageError
from ..mesh import Mesh
from ..plan import Plan, graph_fingerprint
from ..runtime.compiled_step import CompiledStep, RankIO, ShardLayout
from .dynamo_capture import GraphInput, capture_all_ranks, classify_inputs
from .partition import split_forward_backward

log = logging.getLogger(__name__)


class GraphBreakWarning(UserWarning):
    """The compiled forward was split into several graphs (Dynamo graph breaks)."""


@dataclass
class AdaptdistBackend:
    """A configured backend: ``torch.compile(model, backend=AdaptdistBackend(...))``.

    Attributes:
        cluster: an :class:`~adaptdist.cluster.Cluster`, a cluster file path, or None (the local machine
            with the world size's ranks).
        plan: ``"auto"`` (the planner), ``"dp"``, ``"fsdp"``, ``"dp,tp"``/``"tp"`` as a
            :class:`~adaptdist.annotations.ManualPlan` (``ManualPlan.parse("tp", model_module)``), a plan
            file path (YAML annotations or a saved ``plan.json``), or a :class:`~adaptdist.plan.Plan`.
        constraints: the planner's pins and forbidden axes (:class:`~adaptdist.compiler.planner.Constraints`
            or a mapping with ``pins``/``forbid``).
        mesh: a fixed mesh (``"dp=2,tp=2"``) for ``auto`` or a manual plan.
        optimizer: sizes optimizer state in the planner's memory model (``adamw``, ``sgd``, ...).
        compiled: the graphs compiled so far (one per Dynamo graph: several after graph breaks).
    """

    cluster: Any = None
    plan: Any = "auto"
    constraints: Any = None
    mesh: str | None = None
    optimizer: str = "adamw"
    compiled: list[CompiledStep] = field(default_factory=list, init=False, repr=False)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> CompiledStep:
        step = compile_graph(gm, example_inputs, self)
        self.compiled.append(step)
        return step


def backend(cluster: Any = None, plan: Any = "auto", constraints: Any = None, mesh: str | None = None,
            optimizer: str = "adamw") -> AdaptdistBackend:
    """A configured ``adaptdist`` backend for ``torch.compile`` (see :class:`AdaptdistBackend`)."""
    return AdaptdistBackend(cluster=cluster, plan=plan, constraints=constraints, mesh=mesh, optimizer=optimizer)


def adaptdist_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> CompiledStep:
    """``backend="adaptdist"``: the automatic plan on the local cluster of the world size."""
    return compile_graph(gm, example_inputs, AdaptdistBackend())


# --- control messages between ranks (gloo, CPU tensors) --------------------------------------------

def _control_group() -> Any:
    """The group control messages travel in: the world if it runs gloo, else a new gloo group of all ranks
    (messages are CPU tensors). A collective: every rank calls it."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def _all_gather_text(text: str, group: Any) -> list[str]:
    """Every rank's ``text`` (a collective: every rank calls it)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    n = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    parts = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return [bytes(p[:int(s.item())].tolist()).decode() for p, s in zip(parts, sizes)]


def _agree(what: str, value_or_error: str, rank: int, group: Any) -> list[str]:
    """Exchange one line per rank; if any rank reports ``error: ...``, raise it on every rank."""
    texts = _all_gather_text(value_or_error, group)
    failed = [(r, t) for r, t in enumerate(texts) if t.startswith("error: ")]
    if failed:
        r, t = failed[0]
        raise AdaptdistError(f"{what} failed on rank {r}: {t.removeprefix('error: ')}"
                             + ("" if r == rank else " (this rank stopped with it, so no rank waits)"))
    return texts


# --- the compile -----------------------------------------------------------------------------------

def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: AdaptdistBackend
                  ) -> CompiledStep:
    """Compile one Dynamo graph for this rank (module docstring).

    Raises:
        CaptureError: the graph cannot be captured for all ranks (names the construct).
        PlanMismatchError: ranks captured different graphs (names the ranks and their fingerprints).
        PlanInfeasibleError, UsageError, UnsupportedOpError: from the planner or the lowering, raised
            on every rank.
    """
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    _warn_graph_breaks(gm)
    inputs = classify_inputs(gm, example_inputs)
    captured, tangent_outputs, error = None, [], ""
    control = _control_group() if distributed else None
    try:
        captured, tangent_outputs = capture_all_ranks(gm, inputs, world)
    except AdaptdistError as e:
        error = f"error: {e}"
        if not distributed:
            raise
    if distributed:
        fps = _agree("capturing the compiled graph", error or graph_fingerprint(captured.gm), rank, control)
        if len(set(fps)) > 1:
            groups: dict[str, list[int]] = {}
            for r, fp in enumerate(fps):
                groups.setdefault(fp, []).append(r)
            raise PlanMismatchError(
                "the ranks compiled different graphs (" + "; ".join(f"ranks {rs}: graph {fp[:12]}"
                                                                    for fp, rs in groups.items())
                + "); every rank must run the same model on inputs of the same shapes and dtypes")
    plan = _plan(captured, inputs, config, world, rank, control)
    from .data_parallel import lower_plan

    programs = lower_plan(captured, plan, world, mesh=config.mesh if not isinstance(plan, Plan) else None)
    program = programs[rank]
    io = _rank_io(programs, rank, world)
    step_layouts = _layouts(program, programs, inputs)
    # parameters are given their shards at the first call; Dynamo must not re-trace for their new sizes
    compat.drop_tensor_guards({inputs[k].source for k in step_layouts if inputs[k].kind == "param"})
    groups = {}
    if distributed:
        from ..runtime.worker import register_mesh_groups

        register_mesh_groups(program, dist.get_backend())
        groups = {name: compat.resolve_process_group(name) for name in program.group_names.values()}
    split = split_forward_backward(program.graph_module, ("out:",))
    step = _compiled_step(split, program, step_layouts, inputs, tangent_outputs, io, world, rank)
    step.process_groups = groups
    return step


def _plan(captured: Any, inputs: list[GraphInput], config: AdaptdistBackend, world: int, rank: int,
          control: Any) -> Any:
    """The plan every rank lowers: a manual plan as given; ``auto``: rank 0's planner result, broadcast;
    for a graph whose parameters an earlier graph already sharded, that graph's mesh and placements."""
    from ..annotations import ManualPlan

    earlier = [i.layout for i in inputs if i.layout is not None]
    if earlier:
        return _plan_of_sharded(captured, earlier)
    spec = config.plan
    if isinstance(spec, (Plan, ManualPlan)):
        return spec
    if not isinstance(spec, str):
        raise UsageError(f"plan= must be 'auto', a preset, a file path, a ManualPlan or a Plan; got {type(spec).__name__}")
    if spec != "auto":
        if spec.replace(" ", "") in ("tp", "dp,tp"):
            raise UsageError(f"plan={spec!r} needs the model's tensor-parallel globs: pass "
                             f"plan=ManualPlan.parse({spec!r}, your_model_module) (a module with TP_PLAN) or a plan file")
        return ManualPlan.parse(spec)
    distributed = dist.is_available() and dist.is_initialized()
    text = ""
    if rank == 0:
        try:
            text = _auto_plan(captured, config, world).to_json()
        except AdaptdistError as e:
            if not distributed:
                raise
            text = f"error: {e}"
    if distributed:
        text = _agree("planning", text, rank, control)[0]
    plan = Plan.from_json(text, "the automatic plan")
    log.info("adaptdist: plan %s on mesh %s", plan.name, dict(plan.mesh))
    return plan


def _plan_of_sharded(captured: Any, layouts: list[ShardLayout]) -> Plan:
    """A plan keeping the layout of parameters sharded by an earlier compiled graph (the same code at
    another input shape, or a parameter used on both sides of a graph break): its mesh, batch axis and
    parameter placements; other parameters replicated.

    Raises:
        UsageError: the layouts come from plans on different meshes.
    """
    first = Plan.from_json(layouts[0].plan_json, "the plan of an earlier compiled graph")
    for layout in layouts[1:]:
        other = Plan.from_json(layout.plan_json, "the plan of an earlier compiled graph")
        if dict(other.mesh) != dict(first.mesh) or other.batch_axis != first.batch_axis:
            raise UsageError(f"parameters of this graph were sharded by plans on different meshes ({dict(first.mesh)} "
                             f"and {dict(other.mesh)}, parameter {layout.fqn}); compile the model with one backend")
    placements = {l.fqn: [l.placements[a] for a in first.mesh] for l in layouts}
    return Plan(mesh=dict(first.mesh), batch_axis=first.batch_axis, param_placements=placements,
                graph_fingerprint=graph_fingerprint(captured.gm), name=f"{first.name} (parameters already sharded)")


def _auto_plan(captured: Any, config: AdaptdistBackend, world: int) -> Plan:
    from ..cluster import Cluster
    from .planner import Constraints, plan_auto

    cluster = config.cluster
    if cluster is None:
        cluster = Cluster.local(world)
    elif isinstance(cluster, (str, Path)):
        cluster = Cluster.from_yaml(cluster)
    if cluster.world_size != world:
        raise UsageError(f"the cluster has {cluster.world_size} ranks but this job has {world}; pass a cluster of "
                         f"{world} devices (or none: the local machine)")
    constraints = config.constraints
    if isinstance(constraints, Mapping):
        constraints = Constraints(pins=constraints.get("pins", {}), forbid=constraints.get("forbid", {}))
    mesh = Mesh.parse(config.mesh) if config.mesh else None
    return plan_auto(captured, cluster, mesh=mesh, constraints=constraints, optimizer=config.optimizer).plan


def _rank_io(programs: Mapping[int, Any], rank: int, world: int) -> RankIO:
    """Which ranks' inputs this rank's program reads: the rows ``batch_slice`` of the stacked inputs must
    be the inputs of a group of whole ranks, the same group for each of them (true when the batch axis is
    the outermost mesh axis, as the planner and the presets make it)."""
    slices = {r: tuple(p.batch_slice) for r, p in programs.items()}
    for r, (off, size) in slices.items():
        members = range(off, off + size)
        if r not in members or any(slices[m] != (off, size) for m in members):
            raise UsageError(f"rank {r} reads the inputs of ranks {list(members)} under this plan's mesh "
                             f"{programs[r].mesh}; the adaptdist backend needs the batch axis outermost "
                             "(list it first in --mesh / the plan file)")
    groups: dict[tuple[int, int], Any] = {}
    for off, size in sorted(set(slices.values())):
        # every rank creates every group, in the same order (torch's rule for new_group)
        groups[(off, size)] = (dist.new_group(list(range(off, off + size))) if 1 < size < world else
                               dist.group.WORLD if size == world > 1 else None)
    off, size = slices[rank]
    return RankIO(off, size, rank - off, groups[(off, size)])


def _layouts(program: Any, programs: Mapping[int, Any], inputs: list[GraphInput]) -> dict[int, ShardLayout]:
    """The layout of every state input the plan shards, by Dynamo input index (with the plan, so a later
    graph that meets an already sharded parameter keeps its layout)."""
    from .artifacts import shard_layout

    index_of = {i.fqn: k for k, i in enumerate(inputs) if i.kind != "input"}
    if not program.state_placements:
        return {}
    by_rank = {r: shard_layout(p) for r, p in programs.items()}
    plan_json = program.plan.to_json() if program.plan is not None else ""
    return {index_of[f]: ShardLayout(f, tuple(inputs[index_of[f]].global_shape), dict(zip(program.mesh, pls)),
                                     [by_rank[r][f]["ranges"] for r in sorted(by_rank)], plan_json)
            for f, pls in program.state_placements.items() if f in index_of}


def _compiled_step(split: Any, program: Any, layouts: dict[int, ShardLayout], inputs: list[GraphInput],
                   tangent_outputs: list[int], io: RankIO, world: int, rank: int) -> CompiledStep:
    index_of = {i.fqn: k for k, i in enumerate(inputs) if i.kind != "input"}
    state_order = [index_of[f] for f in program.input_fqns]
    input_order = [k for k, i in enumerate(inputs) if i.kind == "input"]
    grad_params = [index_of[f] for f in program.param_fqns]
    roles = [r for r in program.output_roles if r.startswith("grad_in:")]
    differentiable_inputs = [k for k, i in enumerate(input_order) if inputs[i].requires_grad]
    if len(roles) != len(differentiable_inputs):
        raise AdaptdistError(f"the program has {len(roles)} input gradients for {len(differentiable_inputs)} "
                             "inputs that require grad")
    return CompiledStep(split, [i.kind for i in inputs], state_order, input_order, grad_params, layouts, io,
                        world, tangent_outputs, differentiable_inputs, rank, program)


def _warn_graph_breaks(gm: torch.fx.GraphModule) -> None:
    """One warning per new graph break: how many breaks there are so far, why, and where (after the user
    line of the last op of the graph compiled right after the break). Dynamo records a break before it
    compiles the graph that ends there, so that graph's compile is the one that warns."""
    reasons = compat.dynamo_graph_break_reasons()
    total = sum(reasons.values())
    if total <= compat.graph_breaks_reported(total):
        return
    lines = [m.group(1) + ":" + m.group(2) for n in gm.graph.nodes if n.meta.get("stack_trace")
             for m in [list(_FRAME.finditer(n.meta["stack_trace"]))[-1]]]
    where = f"after {lines[-1]}" if lines else "(no source line recorded)"
    why = "; ".join(f"{r} (x{c})" for r, c in reasons.items())
    warnings.warn(
        f"adaptdist: {total} graph break(s) so far, the last {where}: {why}. Each graph between breaks is planned "
        "on its own, its inputs and outputs split over the ranks like the batch (communication at every break). "
        "Remove the break for one plan of the whole step; torch.compile(..., fullgraph=True) makes a break an error.",
        GraphBreakWarning, stacklevel=2)


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
