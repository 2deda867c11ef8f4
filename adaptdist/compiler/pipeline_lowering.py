"""Pipeline lowering: a captured joint graph and a pipeline :class:`~adaptdist.plan.Plan` -> one
:class:`~adaptdist.stage_program.PipelineRankProgram` per rank.

Three steps (PIPELINE.md):

1. Intra-stage SPMD and microbatches, by the ordinary lowering. The whole joint graph is lowered by
   :func:`~adaptdist.compiler.lowering._lower_mesh` on the stage sub-mesh's model-parallel axes (``tp``...)
   plus one virtual batch axis ``mb`` of ``dp * M`` coordinates (``dp`` replicas x ``M`` microbatches), so
   every mean-like reduction is already a per-microbatch sum over a global count
   (:mod:`~adaptdist.passes.globalize_reductions`). The collectives over ``mb`` are then rewritten: a
   gradient's or the loss's all_reduce becomes the identity (the runtime adds the microbatches'
   contributions, then all-reduces over the data-parallel peers); a forward reduction of a value that
   depends only on batch tensors (the valid-token count of a cross-entropy with ``ignore_index``) becomes an
   output of the PROLOGUE, evaluated once per step on the replica's whole batch and fed to every forward as a
   "normalizer" input; any other reduction over microbatches (one of activations or parameters, e.g.
   synchronized BatchNorm statistics) is refused naming the node. So the loss is the global sum over the
   global valid-token count, never a mean of means. Gradient buckets are off (one collective per gradient)
   so that no collective mixes two stages' values.
2. Stage cut. Layers are module paths of the parameters (:func:`pipeline_layers`); each stage's layers
   bind their parameters to it. A forward node's stage is the largest among its bound parameters and
   non-free inputs; a backward node's is its bound parameters' stage or else the stage of the forward
   values it consumes (the last stage using them), bounded by the stages its incoming gradients come from.
   Nodes computed only from batch tensors, normalizers, tied (multi-stage) parameters and constants are
   "free": recomputed by every program that needs them (cheap views, the embedding lookup of a tied table).
   Values crossing stages are sent between adjacent stages (relayed through intermediate ones); the backward
   of a stage is split into its input-gradient part (what the previous stage needs) and its weight-gradient
   part (everything else: the zero-bubble ``W``).
3. Tied weights: a parameter used by several stages (GPT's token embedding and output head) is held by
   each; the addition of the stages' gradient contributions is cut out of the graph, each stage returns its
   own, and ``grad_groups`` names all holders so the runtime's all-reduce sums them (copies stay equal).

4. Stages on sub-meshes of different data-parallel sizes (``--stage-ranks 2,1``): the step is lowered once per
   size (``mb`` of ``dp_s * M`` coordinates), each stage's programs cut from its own size's lowering (the two
   lowerings cut the graph at the same values, checked by name). The batch is cut into ``M`` contiguous
   microbatches first and each over a stage's replicas (``PipelineRankProgram.microbatch_stride``), so every stage
   sees microbatch ``m`` as the same rows; at a boundary each tensor is resharded by
   :mod:`adaptdist.stage_routes` (rows cut/concatenated along the dim where the two local shapes differ by the
   sizes' ratio, replicated values copied, partial sums added: gradients of replicated values, and forward values
   partial over the batch rows such as a loss term reduced on an earlier stage, by their placement on ``mb``).

Not done: stages of different sizes with model-parallel axes inside or interleaved (refused naming the meshes),
FSDP inside a stage (refused naming the parameters), mutated buffers (BatchNorm running statistics) in a pipeline.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch
import torch.fx

from .. import _torch_compat as compat
from .. import graph_meta as gmeta
from ..errors import InternalError, PipelineError, UsageError
from ..lowering_options import LoweringOptions
from ..mesh import Mesh
from ..placement import Partial, Replicate
from ..plan import PIPELINE_AXIS, SCHEDULES, PipelineSpec, Plan, StageSpec, graph_fingerprint
from ..stage_program import PipelineRankProgram, PrologueProgram, StageProgram, TensorSpec
from ..stage_routes import COPY, SUM, StageRoutes, boundary_routes
from .capture import CapturedGraph

if TYPE_CHECKING:
    from ..annotations import ManualPlan

aten = torch.ops.aten
MB_AXIS = "mb"
_MB_GROUP = Mesh.group_name(MB_AXIS)
_NORMALIZER = "adaptdist.pp_normalizer"


# ----------------------------------------------------------------------------------------------- layers and plans

def layer_of(fqn: str) -> str:
    """The layer a parameter or buffer belongs to: its module path through the first numeric component
    (``blocks.0.attn.q.weight`` -> ``blocks.0``), else its module path (``tok_emb.weight`` -> ``tok_emb``,
    ``model.norm.weight`` -> ``model.norm``; a top-level tensor ``scale`` -> ``scale``)."""
    parts = fqn.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or fqn


def shared_tensors(captured: CapturedGraph) -> set[str]:
    """State tensors no stage owns: tied weights (GPT's token embedding, also its output head) and tensors of the
    model itself, not of a submodule (a rotary table ``rope_cos``, a ``cls_token``) when it has submodules. Each
    stage using one holds it; a parameter's gradient contributions are summed over its holders."""
    out = set(captured.tied.values())
    fqns = captured.input_fqns
    if any("." in f for f in fqns):
        out |= {f for f in fqns if "." not in f}
    return out


def pipeline_layers(captured: CapturedGraph) -> list[str]:
    """The layers of a captured step in forward order (by first use of their tensors in the graph), the
    units of a pipeline plan's stage ranges. A tied alias (GPT's ``head.weight``, the token embedding's) is
    not a layer of its own: its ops go with the stage of their inputs; neither are the model's own tensors
    (:func:`shared_tensors`)."""
    tied_targets = set(captured.tied.values())
    has_submodules = any("." in f for f in captured.input_fqns)
    # a tied target of a submodule is its layer's (GPT's token embedding); one of the model itself is not a layer
    shared = {f for f in shared_tensors(captured) if f not in tied_targets or (has_submodules and "." not in f)}
    out: list[str] = []
    for n in captured.gm.graph.nodes:
        if n.op == "placeholder":
            continue
        for i in n.all_input_nodes:
            if i.op == "placeholder" and gmeta.get_role(i) in ("param", "buffer") and gmeta.get_fqn(i) not in shared:
                layer = layer_of(gmeta.get_fqn(i))
                if layer not in out:
                    out.append(layer)
    for f in captured.input_fqns:  # unused tensors last
        if f not in shared and layer_of(f) not in out:
            out.append(layer_of(f))
    return out


def split_layers(layers: list[str], num_stages: int) -> list[tuple[str, ...]]:
    """``layers`` cut into ``num_stages`` contiguous ranges of (nearly) equal length, earlier ones longer.

    Raises:
        PipelineError: more stages than layers (names both numbers and the layers).
    """
    if num_stages < 1:
        raise PipelineError(f"a pipeline needs at least 1 stage, got {num_stages}")
    if num_stages > len(layers):
        raise PipelineError(f"a pipeline of {num_stages} stages needs at least {num_stages} layers; the model has "
                            f"{len(layers)} ({', '.join(layers)}); use at most {len(layers)} stage{'s' if len(layers) != 1 else ''}")
    base, extra = divmod(len(layers), num_stages)
    out, i = [], 0
    for s in range(num_stages):
        k = base + (s < extra)
        out.append(tuple(layers[i:i + k]))
        i += k
    return out


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """What ``--plan pp`` / ``--mesh pp=N,...`` ask for: ``stages`` (None: the mesh's ``pp`` size, or every
    rank without a mesh), ``microbatches`` (None: one per stage), ``schedule`` (one of
    :data:`~adaptdist.plan.SCHEDULES`), ``stages_per_rank`` (interleaved: virtual stages per rank group),
    ``stage_ranks`` (``--stage-ranks 2,1``: the number of ranks of each stage, data parallel inside a stage; None:
    equal sub-meshes)."""

    stages: int | None = None
    microbatches: int | None = None
    schedule: str = "gpipe"
    stages_per_rank: int = 1
    stage_ranks: tuple[int, ...] | None = None


def check_schedule(schedule: str, num_stages: int, microbatches: int, stages_per_rank: int = 1,
                   rows: int | None = None) -> None:
    """Raise :class:`PipelineError` unless ``schedule`` can run ``microbatches`` on ``num_stages`` stages:
    GPipe takes any count; 1F1B and ZB-H1 need at least one microbatch per stage group; interleaved 1F1B a
    multiple of the number of rank groups. ``rows`` (each data-parallel replica's batch rows, where known): the
    suggested count also splits them evenly."""
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    groups = num_stages // max(stages_per_rank, 1)

    def suggest(step: int) -> str:  # the smallest count >= groups, a multiple of step, splitting the rows
        ok = [m for m in range(groups, (rows or 0) + 1) if m % step == 0 and rows % m == 0] if rows else []
        if ok:
            return f"use --microbatches {ok[0]}"
        if rows:
            return (f"no such count splits the {rows} batch rows per replica evenly: use a batch size with a multiple "
                    f"of {groups * step // math.gcd(groups, step)} rows per replica, or fewer pipeline ranks")
        return f"use --microbatches {groups * max(1, -(-microbatches // groups)) if step > 1 else groups} or more"
    if schedule in ("1f1b", "zb") and microbatches < groups:
        raise PipelineError(f"schedule {schedule!r} needs at least as many microbatches as pipeline stages: "
                            f"{microbatches} microbatches < {groups} stages; {suggest(1)}, or --schedule gpipe")
    if schedule == "interleaved-1f1b" and (microbatches < groups or microbatches % groups):
        raise PipelineError(f"schedule 'interleaved-1f1b' needs a multiple of the {groups} rank groups as "
                            f"microbatches, got {microbatches}; {suggest(groups)}")


def check_microbatches(batch_rows: int, replicas: int, microbatches: int) -> int:
    """Rows per microbatch when ``batch_rows`` split over ``replicas`` data-parallel replicas of ``microbatches``
    equal microbatches each.

    Raises:
        PipelineError: fewer rows than microbatches, or rows that do not split evenly (names the numbers).
    """
    B, dp, M = batch_rows, replicas, microbatches
    if dp * M > B:
        raise PipelineError(f"{M} microbatches x {dp} data-parallel replica(s) = {dp * M} microbatches of at least one "
                            f"row, but the batch has {B} rows; use at most {max(B // dp, 1)} microbatches")
    if B % (dp * M):
        raise PipelineError(f"the batch of {B} rows does not split into {dp} replica(s) x {M} microbatches of equal "
                            f"size ({B} is not a multiple of {dp * M}); choose --microbatches dividing {B // dp}"
                            if B % dp == 0 else
                            f"the batch of {B} rows does not split evenly over {dp} data-parallel replicas")
    return B // (dp * M)


def resolve_pipeline_plan(plan: "ManualPlan | None", captured: CapturedGraph, world_size: int, mesh: str | None,
                          pipeline: PipelineOptions, *, resolve_plan: Callable) -> Plan:
    """The pipeline :class:`~adaptdist.plan.Plan` for ``--plan pp`` (``plan`` None) or a manual intra-stage
    plan (``plan``: its mesh axes are the stage sub-mesh, e.g. ``dp`` or ``tp``) with ``--mesh pp=2,dp=2``
    (``mesh`` None: one pipeline of ``pipeline.stages or world_size`` stage groups). Layers are split evenly
    (:func:`split_layers`). ``resolve_plan`` is :func:`adaptdist.compiler.lowering.resolve_plan` (which calls
    this: the door is there).

    Raises:
        PipelineError: more stages than layers, a mesh whose ``pp`` size differs from ``pipeline.stages``, a
            schedule that cannot use the microbatch count.
        UsageError: a mesh that does not match ``world_size``.
    """
    from ..annotations import ManualPlan

    v = pipeline.stages_per_rank
    if pipeline.stage_ranks is not None:
        return _stage_ranks_plan(plan, captured, world_size, mesh, pipeline)
    if mesh:
        m = Mesh.parse(mesh)
        if PIPELINE_AXIS not in m.names:
            raise PipelineError(f"--mesh {mesh} has no axis {PIPELINE_AXIS!r} for the pipeline stages; e.g. "
                                f"--mesh {PIPELINE_AXIS}=2,{mesh}")
        if m.names[0] != PIPELINE_AXIS:
            raise PipelineError(f"--mesh {mesh}: put the pipeline axis first ({PIPELINE_AXIS}=... ,then the stage's axes)")
        groups = m.size(PIPELINE_AXIS)
        intra_axes = [(a, n) for a, n in m.axes if a != PIPELINE_AXIS]
    else:
        groups = (pipeline.stages or world_size) // v
        intra_axes = []
    needed = groups * math.prod(n for _, n in intra_axes)
    if needed != world_size:
        raise UsageError(f"a pipeline of {groups} stage group(s) x sub-mesh {dict(intra_axes) or '1 rank'} needs "
                         f"{needed} ranks, this job has {world_size}")
    num_stages = groups * v
    if pipeline.stages is not None and pipeline.stages != num_stages:
        raise PipelineError(f"{pipeline.stages} pipeline stages asked, but the mesh gives {groups} stage group(s) x "
                            f"{v} stage(s) per group = {num_stages}")
    microbatches = pipeline.microbatches or num_stages
    dp_rows = captured.batch_size // math.prod(n for a, n in intra_axes if a == "dp")
    check_schedule(pipeline.schedule, num_stages, microbatches, v, rows=dp_rows)
    stage_layers = split_layers(pipeline_layers(captured), num_stages)
    if intra_axes:
        intra_mesh = ",".join(f"{a}={n}" for a, n in intra_axes)
        inner = plan if plan is not None else ManualPlan.parse(",".join(a for a, _ in intra_axes))
        intra = resolve_plan(inner, captured, world_size // groups, intra_mesh)
        sub = dict(intra.mesh)
        pls = {f: (Replicate(),) + tuple(p) for f, p in intra.param_placements.items()}
        batch_axis, name = intra.batch_axis, f"pp+{intra.name}"
    else:
        if plan is not None and plan.name != PIPELINE_AXIS:
            raise PipelineError(f"plan {plan.name!r} inside the pipeline needs its axes in --mesh, e.g. "
                                f"--mesh {PIPELINE_AXIS}={groups},{plan.mesh_axes[0]}=2")
        sub, pls, batch_axis, name = {}, {}, None, PIPELINE_AXIS
    check_microbatches(captured.batch_size, sub.get(batch_axis, 1) if batch_axis else 1, microbatches)
    spec = PipelineSpec(tuple(StageSpec(layers, dict(sub)) for layers in stage_layers), microbatches,
                        pipeline.schedule, v)
    return Plan(mesh={PIPELINE_AXIS: groups, **sub}, batch_axis=batch_axis, param_placements=pls,
                graph_fingerprint=graph_fingerprint(captured.gm), name=name, pipeline=spec)


def _stage_ranks_plan(plan: "ManualPlan | None", captured: CapturedGraph, world_size: int, mesh: str | None,
                      pipeline: PipelineOptions) -> Plan:
    """The plan of ``--stage-ranks n0,n1,...``: stage ``g`` on ``n_g`` ranks (``{"dp": n_g}``, ``{}`` for one), the
    layers split evenly, parameters replicated; the plan's mesh is ``pp=len, dp=max(n_g)`` (the largest sub-mesh).

    Raises:
        UsageError: sizes that do not add up to ``world_size``, a size < 1, with a ``--mesh`` of other axes or a
            plan other than dp inside the stages.
        PipelineError: as :func:`resolve_pipeline_plan` (layers, schedule, microbatches per stage).
    """
    sizes = tuple(pipeline.stage_ranks or ())
    text = ",".join(map(str, sizes))
    if not sizes or any(n < 1 for n in sizes):
        raise UsageError(f"--stage-ranks {text}: every stage needs at least 1 rank")
    if sum(sizes) != world_size:
        raise UsageError(f"--stage-ranks {text} adds up to {sum(sizes)} ranks, this job has {world_size}; give sizes "
                         f"that add up to {world_size}")
    if mesh and any(part.split("=")[0].strip() != PIPELINE_AXIS for part in mesh.split(",") if part.strip()):
        raise UsageError(f"--stage-ranks {text} gives each stage its own data-parallel sub-mesh; drop --mesh {mesh} "
                         "(or use --mesh without --stage-ranks for equal sub-meshes)")
    if mesh and Mesh.parse(mesh).size(PIPELINE_AXIS) != len(sizes):
        raise UsageError(f"--stage-ranks {text} gives {len(sizes)} stages, --mesh {mesh} another number")
    if plan is not None and plan.name not in (PIPELINE_AXIS, "dp"):
        raise UsageError(f"--stage-ranks runs data parallelism inside each stage; plan {plan.name!r} cannot go with it "
                         "(use --plan pp)")
    if pipeline.stages_per_rank > 1:
        raise PipelineError("--stage-ranks with an interleaved schedule is not supported; use --schedule 1f1b or gpipe")
    if pipeline.stages is not None and pipeline.stages != len(sizes):
        raise PipelineError(f"{pipeline.stages} pipeline stages asked, but --stage-ranks {text} gives {len(sizes)}")
    num_stages = len(sizes)
    microbatches = pipeline.microbatches or num_stages
    check_schedule(pipeline.schedule, num_stages, microbatches, 1, rows=captured.batch_size // max(sizes))
    for n in sizes:
        check_microbatches(captured.batch_size, n, microbatches)
    stage_layers = split_layers(pipeline_layers(captured), num_stages)
    meshes = [{"dp": n} if n > 1 else {} for n in sizes]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    spec = PipelineSpec(tuple(StageSpec(layers, m, tuple(range(a, a + n)))
                              for layers, m, a, n in zip(stage_layers, meshes, starts, sizes)), microbatches,
                        pipeline.schedule, 1)
    top = max(sizes)
    fqns = [gmeta.get_fqn(p) for p in captured.gm.graph.find_nodes(op="placeholder") if gmeta.get_role(p) != "batch"]
    return Plan(mesh={PIPELINE_AXIS: num_stages, "dp": top}, batch_axis="dp",
                param_placements={f: (Replicate(), Replicate()) for f in fqns},
                graph_fingerprint=graph_fingerprint(captured.gm), name="pp+dp", pipeline=spec)


def mesh_preset(mesh: str | None, model_module: Any, model: Any = None) -> Any:
    """The inner plan of ``--plan pp`` (or ``auto``) on ``--mesh pp=...,tp=...``: the preset the mesh's other axes
    name, with the model file's ``TP_PLAN`` (else ``model``'s own Hugging Face plan) for a ``tp`` axis and its
    ``EP_PLAN`` for an ``ep`` axis; None where those axes need no model file (``dp`` alone, or no other axis: the
    lowering's own preset), or where neither gives them: the inter-stage planner then places the parameters as
    each stage's ILP chose (:func:`adaptdist.compiler.planner.stages.pipeline_plan`).

    Raises:
        UsageError: as :meth:`ManualPlan.parse` (a model file without ``TP_PLAN`` for a tp axis).
    """
    axes = {part.split("=")[0].strip() for part in (mesh or "").split(",") if "=" in part} - {PIPELINE_AXIS}
    if "tp" not in axes and "ep" not in axes:
        return None
    from ..annotations import ManualPlan

    if "tp" in axes and getattr(model_module, "TP_PLAN", None) is None:
        from ..hf_tp_plan import hf_tp_plan

        if model is None or not hf_tp_plan(model):
            return None
    if "ep" in axes and getattr(model_module, "EP_PLAN", None) is None:
        return None
    key = "dp,tp" if axes == {"dp", "tp"} else ",".join(sorted(axes))
    return ManualPlan.parse(key, model_module, model)


# ------------------------------------------------------------------------------------------------------ lowering

def lower_pipeline(captured: CapturedGraph, plan: Plan, options: LoweringOptions,
                   state: dict[str, torch.Tensor] | None = None, *, lower_mesh: Callable
                   ) -> dict[int, PipelineRankProgram]:
    """Lower a captured step under a pipeline ``plan`` (the module docstring); returns every rank's program.
    ``lower_mesh`` is :func:`adaptdist.compiler.lowering._lower_mesh` (:func:`~adaptdist.compiler.lowering.lower`
    calls this: the door is there).

    Raises:
        PipelineError: more stages than layers, stage layer ranges that do not cover the model's layers in
            order, microbatches that do not split each replica's rows evenly (or more microbatch rows than the
            batch has), a schedule that cannot use the count, stages on different sub-meshes, a reduction over
            microbatches of activations (names the node), a model that updates buffers.
        UnsupportedOpError: an op cannot run with the intra-stage placements (as :func:`lower`).
    """
    spec = plan.pipeline
    assert spec is not None
    S, G, M = spec.num_stages, spec.num_groups, spec.microbatches
    layers = pipeline_layers(captured)
    if S > len(layers):
        raise PipelineError(f"a pipeline of {S} stages needs at least {S} layers; the model has {len(layers)} "
                            f"({', '.join(layers)}); use at most {len(layers)} stage{'s' if len(layers) != 1 else ''}")
    given = [layer for st in spec.stages for layer in st.layers]
    if given != layers:
        unknown = [x for x in given if x not in layers]
        missing = [x for x in layers if x not in given]
        raise PipelineError(
            "the pipeline's stage layer ranges must cover the model's layers in order: "
            + (f"unknown layer(s) {unknown}; " if unknown else "")
            + (f"missing layer(s) {missing}; " if missing else "")
            + f"the model's layers are {layers}, the plan's stages hold {[list(s.layers) for s in spec.stages]}")
    intra = {a: n for a, n in plan.mesh.items() if a != PIPELINE_AXIS}
    batch_axis = plan.batch_axis
    group_mesh = [dict(spec.stages[g].mesh) for g in range(G)]
    for i, st in enumerate(spec.stages):
        if dict(st.mesh) != group_mesh[i % G]:
            raise PipelineError(f"pipeline stage {i} runs on sub-mesh {dict(st.mesh) or '{} (1 rank)'} but stage "
                                f"{i % G} of its rank group on {group_mesh[i % G] or '{} (1 rank)'}: the stages of "
                                "one rank group share its sub-mesh")
    uniform = all(m == intra for m in group_mesh)
    model_axes = [(a, n) for a, n in intra.items() if a != batch_axis]
    if not uniform:
        want = [(a, n) for a, n in model_axes if n > 1]
        for g, m in enumerate(group_mesh):
            other = [(a, n) for a, n in m.items() if a != batch_axis and n > 1]
            if other != want:
                raise PipelineError(
                    f"pipeline stage {g} runs on sub-mesh {m or '{} (1 rank)'} but the plan's stage mesh is "
                    f"{intra or '{} (1 rank)'}: stages on sub-meshes of different sizes may differ only in their "
                    f"data-parallel size (the plan's batch axis, {batch_axis or 'none here'}), their other axes "
                    f"({dict(want) or 'none'}) alike; give every stage the same sub-mesh, or --stage-ranks for "
                    "data-parallel stages of different sizes")
        if spec.stages_per_rank > 1:
            raise PipelineError(f"interleaved stages ({spec.stages_per_rank} per rank group) on sub-meshes of "
                                f"different sizes {[m or {} for m in group_mesh]} are not supported; use --schedule "
                                "1f1b or gpipe, or equal sub-meshes")
    if captured.mutated_buffer_fqns:
        raise PipelineError(f"{captured.model_name} updates buffers in its step ({', '.join(captured.mutated_buffer_fqns)}"
                            ", e.g. BatchNorm running statistics): not supported in a pipeline yet; use a plan without pp "
                            "or GroupNorm/LayerNorm")
    check_schedule(spec.schedule, S, M, spec.stages_per_rank)
    dps = [m.get(batch_axis, 1) if batch_axis is not None else 1 for m in group_mesh]
    group_rows = [check_microbatches(captured.batch_size, d, M) for d in dps]

    # 1. intra-stage SPMD + microbatch axis, by the ordinary lowering (once per data-parallel size)
    if batch_axis is not None and max(dps) > 1:
        k = list(plan.mesh).index(batch_axis)
        sharded = sorted(f for f, pls in plan.param_placements.items() if not isinstance(pls[k], Replicate))
        if sharded:
            raise PipelineError(f"parameters sharded over the batch axis {batch_axis!r} inside a pipeline stage (FSDP: "
                                f"{', '.join(sharded[:3])}{'...' if len(sharded) > 3 else ''}) are not supported yet; "
                                f"replicate them on {batch_axis!r} (--plan dp) or shard them over a tp axis")
    keep = [list(plan.mesh).index(a) for a, _ in model_axes]
    vopts = dataclasses.replace(options, grad_bucket_bytes=1, gather_bucket_bytes=1)
    vprogs_of: dict[int, dict] = {}
    vm_of: dict[int, Mesh] = {}
    for dp in sorted(set(dps)):
        vmesh = dict(model_axes) | {MB_AXIS: dp * M}
        vplan = Plan(mesh=vmesh, batch_axis=MB_AXIS,
                     param_placements={f: tuple(pls[k] for k in keep) + (Replicate(),)
                                       for f, pls in plan.param_placements.items()},
                     graph_fingerprint=plan.graph_fingerprint, name=plan.name)
        vprogs_of[dp] = lower_mesh(captured, vplan, vopts, follow_strategies=False, state=state)
        vm_of[dp] = Mesh(tuple(vmesh.items()))

    # rank layout: group g's ranks; local index j <-> the group's sub-mesh coordinates
    gmeshes = [Mesh(tuple(m.items())) if m else None for m in group_mesh]
    n_of = [gm.world_size if gm else 1 for gm in gmeshes]
    group_ranks: list[tuple[int, ...]] = []
    off = 0
    for g in range(G):
        given_ranks = spec.stages[g].ranks
        group_ranks.append(tuple(given_ranks) if given_ranks else tuple(range(off, off + n_of[g])))
        off += n_of[g]
    for s in range(S):
        if spec.stages[s].ranks and tuple(spec.stages[s].ranks) != group_ranks[s % G]:
            raise PipelineError(f"pipeline stage {s} lists ranks {list(spec.stages[s].ranks)}, but its rank group "
                                f"{s % G} is {list(group_ranks[s % G])}")
    world = sum(n_of)
    if sorted(r for gr in group_ranks for r in gr) != list(range(world)):
        raise PipelineError(f"the pipeline's stage ranks {[list(g) for g in group_ranks]} must use every rank "
                            f"0..{world - 1} once")

    def coords_of(g: int, j: int) -> dict[str, int]:
        return dict(zip(gmeshes[g].names, gmeshes[g].coords(j))) if gmeshes[g] else {}

    def model_key(c: Mapping[str, int]) -> tuple:
        return tuple(c.get(a, 0) for a, _ in model_axes)

    def replicas(grp: int, key: tuple) -> tuple[int, ...]:  # group grp's ranks at model coordinates key, by dp index
        js = [jj for jj in range(n_of[grp]) if model_key(coords_of(grp, jj)) == key]
        js.sort(key=lambda jj: coords_of(grp, jj).get(batch_axis, 0) if batch_axis else 0)
        return tuple(group_ranks[grp][jj] for jj in js)

    stage_of_layer = {layer: s for s, st in enumerate(spec.stages) for layer in st.layers}
    built: dict[tuple, _Built] = {}

    def built_for(g: int, key: tuple) -> _Built:
        dp, rows = dps[g], group_rows[g]
        if (dp, key) not in built:
            vm, vprogs = vm_of[dp], vprogs_of[dp]
            vr = vm.rank(key + (0,))
            if M > 1 and vprogs[vr].graph_module.code != vprogs[vm.rank(key + (1,))].graph_module.code:
                raise PipelineError(_program_difference(vprogs[vr].graph_module,
                                                        vprogs[vm.rank(key + (1,))].graph_module))
            built[(dp, key)] = _build(vprogs[vr], captured, stage_of_layer, S, M, rows)
        return built[(dp, key)]

    # boundary routes where adjacent stages have different data-parallel sizes
    routes: dict[tuple[int, int], dict[str, list]] = {}  # (rank, stage) -> kind -> routes per tensor
    if not uniform:
        keys = sorted({model_key(coords_of(0, j)) for j in range(n_of[0])})
        for s in range(S - 1):
            ga, gb = s % G, (s + 1) % G
            for key in keys:
                a, b = built_for(ga, key).stages[s], built_for(gb, key).stages[s + 1]
                ra, rb = replicas(ga, key), replicas(gb, key)
                where = f"pipeline boundary between stage {s} ({len(ra)} replica(s)) and stage {s + 1} ({len(rb)})"
                _check_boundary(a, b, where)
                snd, rcv = boundary_routes("forward", _io_names(a.forward, len(a.send_specs), a.is_last),
                                           [x.shape for x in a.send_specs], [x.shape for x in b.recv_specs], ra, rb,
                                           where, built_for(ga, key).send_combines[s])
                gsnd, grcv = boundary_routes("backward", [f"grad {i}" for i in range(len(b.grad_out_specs))],
                                             [x.shape for x in b.grad_out_specs], [x.shape for x in a.grad_in_specs],
                                             rb, ra, where, built_for(gb, key).grad_out_combines[s + 1])
                for i, r in enumerate(ra):
                    routes.setdefault((r, s), {})["send"] = snd[i]
                    routes[(r, s)]["grad_in"] = grcv[i]
                for i, r in enumerate(rb):
                    routes.setdefault((r, s + 1), {})["recv"] = rcv[i]
                    routes[(r, s + 1)]["grad_out"] = gsnd[i]

    programs: dict[int, PipelineRankProgram] = {}
    for g in range(G):
        intra_g, rows = group_mesh[g], group_rows[g]
        for j in range(n_of[g]):
            c = coords_of(g, j)
            d = c.get(batch_axis, 0) if batch_axis else 0
            key = model_key(c)
            b = built_for(g, key)
            rank = group_ranks[g][j]

            def peer(stage: int) -> int | None:
                return group_ranks[stage % G][j] if 0 <= stage < S else None

            stages = []
            for s in range(g, S, G):
                p = b.stages[s]
                if uniform:
                    stages.append(dataclasses.replace(p, recv_from=peer(s - 1), send_to=peer(s + 1), coords=dict(c),
                                                      submesh=dict(intra_g)))
                    continue
                rt = routes.get((rank, s), {})
                sr = StageRoutes(send=tuple(rt.get("send", ())), recv=tuple(rt.get("recv", ())),
                                 grad_in=tuple(rt.get("grad_in", ())), grad_out=tuple(rt.get("grad_out", ())))
                stages.append(dataclasses.replace(
                    p, recv_from=replicas((s - 1) % G, key)[0] if s > 0 else None,
                    send_to=replicas((s + 1) % G, key)[0] if s + 1 < S else None, coords=dict(c),
                    submesh=dict(intra_g), routes=sr))
            mine = {s for s in range(g, S, G)}
            grad_groups = {f: tuple(sorted({r for h in b.holders[f] for r in replicas(h % G, key)}))
                           for f in b.param_fqns if b.holders[f] & mine}
            groups = {}
            for a, _ in model_axes:
                if gmeshes[g] is not None and a in gmeshes[g].names:
                    groups[Mesh.group_name(a)] = tuple(group_ranks[g][x] for x in gmeshes[g].group(a, j))
            # the state its stages read, and the state they hold without reading it (a parameter the loss does not
            # reach, a frozen tensor no op uses): kept, updated by nothing, saved in checkpoints
            names = sorted({f for p in stages for f in p.state_names}
                           | {f for f, hs in b.holders.items() if hs & mine and f in b.order}, key=b.order.index)
            vm = vm_of[dps[g]]
            placements = {f: tuple("R" if a == batch_axis else pl[vm.index(a)] for a in intra_g)
                          for f, pl in b.state_placements.items() if f in names}
            layout = dict(microbatch_rows=rows, batch_slice=(d * M * rows, M * rows)) if uniform else dict(
                microbatch_rows=rows, batch_slice=(d * rows, M * rows), microbatch_stride=rows * dps[g])
            programs[rank] = PipelineRankProgram(
                rank=rank, world_size=world, stages=tuple(stages), prologue=b.prologue, num_microbatches=M,
                schedule=spec.schedule, stage_ranks={s: group_ranks[s % G] for s in range(S)},
                batch_group=replicas(g, key), grad_groups=grad_groups, groups=groups,
                state={f: b.state[f] for f in names if f in b.state},
                param_fqns=tuple(f for f in b.param_fqns if f in names),
                global_shapes={f: tuple(v) for f, v in b.global_shapes.items() if f in names},
                state_placements={f: p for f, p in placements.items() if any(x != "R" for x in p)},
                loss_rank=(S - 1) % G == g, plan=plan,
                stacked={f: tuple(ms) for f, ms in captured.stacked.items()}, **layout)
    return _use_shm(dict(sorted(programs.items())), plan, options)


def _use_shm(programs: dict[int, PipelineRankProgram], plan: Plan, options: LoweringOptions
             ) -> dict[int, PipelineRankProgram]:
    """Put each rank's groups whose ranks share a host on adaptdist's shared-memory kernels (``--comm auto|shm``,
    :func:`~adaptdist.comm_transport.shm_usable`): the intra-stage axes' groups (``groups``: the stage programs'
    collectives become ``torch.ops.adaptdist.shm_*`` on ``adaptdist:<axis>[ranks]``, in copies of the stage
    modules, which ranks of other groups share) and the runtime's reductions (``batch_group``: the data-parallel
    peers, ``adaptdist:<batch axis>[ranks]``; a tied weight's ``grad_groups``: ``adaptdist:grads[ranks]``); every
    such group is listed in ``shm_groups``. Sends and receives between stages stay on gloo. Under ``auto``, where
    /dev/shm cannot hold every such group's slots, all stay on gloo (one warning,
    :func:`~adaptdist.comm_transport.shm_space_fits`).

    Raises:
        ShmUnavailableError: ``options.comm == "shm"`` without the kernels.
    """
    from ..comm_transport import mesh_rank_hosts, on_one_host, shm_usable
    from ..mesh import shm_group_name
    from ..passes.use_shm_collectives import use_shm_collectives

    hosts = mesh_rank_hosts(plan, options.hosts)
    if not programs or not shm_usable(options.comm, hosts, what="comm='shm' (--comm shm)"):
        return programs

    def shared(ranks) -> tuple[int, ...] | None:
        key = tuple(sorted(ranks))
        return key if len(key) > 1 and on_one_host(hosts, key) else None

    def renamed(gm: torch.nn.Module, names: dict[str, str]) -> torch.nn.Module:
        if not names or not isinstance(gm, torch.fx.GraphModule):
            return gm
        copy = torch.fx.GraphModule(gm, _copy_graph(gm.graph))
        copy, changed = use_shm_collectives(copy, names)
        return copy if changed else gm

    out = {}
    for r, prog in programs.items():
        shm: dict[str, tuple[int, ...]] = {}
        names: dict[str, str] = {}
        for name, ranks in prog.groups.items():  # ascending ranks: the runtime's gloo group's order
            key = shared(ranks)
            if key is not None:
                names[name] = shm_group_name(name, key)
                shm[names[name]] = key
        batch = tuple(sorted(prog.batch_group))
        for key in sorted({k for k in [shared(prog.batch_group), *map(shared, prog.grad_groups.values())] if k}):
            base = Mesh.group_name(plan.batch_axis) if key == batch and plan.batch_axis else "adaptdist:grads"
            shm[shm_group_name(base, key)] = key
        stages = tuple(dataclasses.replace(st, forward=renamed(st.forward, names),
                                           backward_input=renamed(st.backward_input, names),
                                           backward_weight=renamed(st.backward_weight, names))
                       for st in prog.stages)
        out[r] = dataclasses.replace(prog, stages=stages, shm_groups=shm, comm=options.comm)
    if options.comm == "auto":  # a /dev/shm too small for every group's slots: all on gloo, with one warning
        from ..comm_transport import shm_space_fits

        groups = {n: key for prog in out.values() for n, key in prog.shm_groups.items()}
        if groups and not shm_space_fits([len(k) for k in groups.values()], f"the pipeline's {len(groups)} groups",
                                         options.shm_space):
            return programs
    return out


def _io_names(gm: torch.fx.GraphModule, n: int, skip_first: bool = False) -> list[str]:
    """Names of the first ``n`` outputs of ``gm`` (after the loss when ``skip_first``)."""
    out = list(gm.graph.output_node().args[0])
    out = out[1:] if skip_first else out
    return [getattr(v, "name", str(v)) for v in out[:n]]


def _check_boundary(a: StageProgram, b: StageProgram, where: str) -> None:
    """Stage ``a``'s sends are stage ``b``'s receives (from two lowerings of the same graph on different
    data-parallel sizes: the same values, in the same order, only their batch rows differ)."""
    sent = _io_names(a.forward, len(a.send_specs), a.is_last)
    phs = [n.name for n in b.forward.graph.find_nodes(op="placeholder")]
    got = phs[len(b.state_names):len(b.state_names) + len(b.recv_specs)]
    if (len(a.send_specs) != len(b.recv_specs) or len(b.grad_out_specs) != len(a.grad_in_specs)
            or [re.sub(r"\W", "_", x) for x in sent] != got
            or any(x.dtype != y.dtype for x, y in zip(a.send_specs, b.recv_specs))
            or any(x.dtype != y.dtype for x, y in zip(b.grad_out_specs, a.grad_in_specs))):
        raise PipelineError(f"{where}: the stages' programs do not cut the graph at the same values (sent {sent}, "
                            f"received {got}): the two data-parallel sizes lowered the step differently; give both "
                            "stages the same sub-mesh")


def _program_difference(gm0: torch.fx.GraphModule, gm1: torch.fx.GraphModule) -> str:
    """The message for microbatch programs that differ: the first node whose code differs, both versions; where it
    is a cut of the microbatch's rows out of a value over the whole batch, what builds such a value and what to
    write instead."""
    a, b = gm0.code.splitlines(), gm1.code.splitlines()
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    x = a[i].strip() if i < len(a) else "(nothing)"
    y = b[i].strip() if i < len(b) else "(nothing)"
    name = x.split(" = ")[0] if " = " in x else "?"
    rng = "; ops drawing random numbers per row (--rng global) make such a difference: use --rng per-rank" \
        if any(t in x for t in ("rand", "bernoulli", "dropout")) else ""
    where = _user_source(gm0, name)
    head = (f"the step's program differs between microbatches 0 and 1 at node {name!r}"
            f"{' ' + where if where else ''}: microbatch 0 runs `{x.split(';')[0]}`, microbatch 1 runs "
            f"`{y.split(';')[0]}`")
    whole = _whole_batch_source(gm0, name)
    if whole is not None and not rng:
        return (f"{head}: each microbatch cuts its own rows out of {whole}, a value the step computes over the whole "
                "batch (e.g. the backward of indexing rows with torch.arange(batch), `out[torch.arange(B), target]`, "
                "or an index_put/scatter into a batch-sized tensor), and pipeline microbatches run one program. "
                "Compute it per row instead (torch.gather(out, 1, target[:, None]), F.cross_entropy / F.nll_loss), "
                "or use a plan without pp (--plan dp, tp, fsdp)")
    return (f"{head} (a value that depends on the microbatch's rows, not only on its data){rng}; pipeline "
            "microbatches run one program: use a plan without pp (--plan dp, tp, fsdp)")


def _user_source(gm: torch.fx.GraphModule, name: str, limit: int = 4) -> str:
    """Where in user code node ``name`` of ``gm`` came from (:func:`graph_meta.source_of`): its own capture
    record, else that of the nearest node within ``limit`` edges that has one (inputs before users: what it
    computes from), since a lowering pass's node (a shifted index, a slice) has none; '' when none is found."""
    node = next((n for n in gm.graph.nodes if n.name == name), None)
    seen, frontier = set(), [node] if node is not None else []
    for _ in range(limit + 1):
        for n in frontier:
            found = gmeta.source_of(n)
            if found:
                return found
        seen.update(frontier)
        frontier = [m for n in frontier for m in [*n.all_input_nodes, *n.users] if m not in seen]
    return ""


def _where_near(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    """`` in the loss function (loss.py:7: `...`)``: :func:`_user_source` of ``node``, for a message naming it."""
    where = _user_source(gm, node.name)
    return " " + where if where else ""


def _whole_batch_source(gm: torch.fx.GraphModule, name: str) -> str | None:
    """When node ``name`` of ``gm`` is a rank slice of the batch dim (dim 0: each microbatch's rows of a value
    every microbatch holds whole), the op that made that value (``index_put``); else None."""
    node = next((n for n in gm.graph.nodes if n.name == name), None)
    if node is None or gmeta.get_rank_slice(node) != 0 or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    src = node.args[0]
    op = getattr(src.target, "__name__", str(src.target)).split(".")[0]
    return f"`{src.name}` ({op})"


@dataclasses.dataclass
class _Built:
    stages: list[StageProgram]
    prologue: PrologueProgram | None
    holders: dict[str, set[int]]
    param_fqns: list[str]
    order: list[str]
    state: dict[str, torch.Tensor]
    state_placements: dict[str, list[str]]
    global_shapes: dict[str, list[int]]
    # per stage: how each sent value / each gradient sent back combines over the batch replicas (_mb_combine)
    send_combines: list[tuple[str | None, ...]] = dataclasses.field(default_factory=list)
    grad_out_combines: list[tuple[str | None, ...]] = dataclasses.field(default_factory=list)


def _mb_combine(v: torch.fx.Node) -> str | None:
    """How the values of ``v`` on a stage's batch replicas combine, from its placement on the microbatch axis (the
    virtual mesh's last): ``SUM`` for a partial sum (a forward loss term reduced over the replica's rows), ``COPY``
    for a replicated value, None otherwise (split over the rows, or no placement recorded)."""
    pls = gmeta.get_placements(v)
    if not isinstance(pls, tuple) or not pls:
        return None
    last = pls[-1]
    if isinstance(last, Partial) and last.op == "sum":
        return SUM
    return COPY if isinstance(last, Replicate) else None


def _is(n: Any, kind: str) -> bool:
    return isinstance(n, torch.fx.Node) and n.op == "call_function" and compat.functional_collective_kind(n.target) == kind


def _build(vprog, captured: CapturedGraph, stage_of_layer: dict[str, int], S: int, M: int, rows: int) -> _Built:
    """One intra-stage coordinate's stage programs and prologue, from its microbatch-0 virtual program."""
    gm = torch.fx.GraphModule(vprog.graph_module, _copy_graph(vprog.graph_module.graph))  # a copy we edit
    graph = gm.graph
    out_node = graph.output_node()
    roles = gmeta.get_output_roles(out_node)
    outs = list(out_node.args[0])
    loss_val = outs[roles.index("loss")]
    placeholders = list(graph.find_nodes(op="placeholder"))
    batch_phs = [p for p in placeholders if gmeta.get_role(p) == "batch"]

    # forward set: ancestors of the loss (and getitems of forward tuples)
    def ancestors(roots: Iterable) -> set:
        seen: set = set()
        stack = [r for r in roots if isinstance(r, torch.fx.Node)]
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(n.all_input_nodes)
        return seen

    # 1b. the microbatch axis's collectives: identity (gradients, loss) or prologue (batch-only reductions)
    out_users = {o: roles[i] for i, o in enumerate(outs) if isinstance(o, torch.fx.Node)}
    normalizers: list[tuple[torch.fx.Node, Any, str]] = []  # (placeholder, what to compute, reduce op)
    last_ph = placeholders[-1]
    for n in list(graph.nodes):
        if n.op != "call_function" or not compat.is_functional_collective(n.target):
            continue
        if str(n.args[-1]) != _MB_GROUP:
            continue
        kind = compat.functional_collective_kind(n.target)
        waits = [u for u in n.users if _is(u, "wait")]
        res = waits[0] if len(waits) == 1 and len(n.users) == 1 else n
        x = n.args[0]
        if kind == "all_reduce" and str(n.args[1]) == "sum" and _only_to_outputs(res, out_node, out_users):
            res.replace_all_uses_with(x)  # the runtime adds the microbatches' terms
            graph.erase_node(res)
            if res is not n:
                graph.erase_node(n)
            continue
        how = _batch_only(x) if kind == "all_reduce" else None
        if kind == "all_reduce" and how is None:
            users = sorted({f"{u.name} ({u.target})" for u in res.users})
            raise PipelineError(
                f"the step needs the {n.args[1]} over the whole batch of node {x.name!r} ({x.target}, "
                f"{gmeta.shape_str(x)}){_where_near(gm, x)}, computed from parameters or activations (all_reduce at "
                f"{n.name!r}, used by "
                f"{', '.join(users[:3]) or 'the outputs'}{'...' if len(users) > 3 else ''}): a pipeline runs each "
                "microbatch's forward and backward apart, so that total is not known in time. This happens where "
                "the loss is not a sum or mean of per-sample terms (a function of the batch mean such as its square, "
                "a batch-level statistic, synchronized BatchNorm); use a loss that is, or a plan without pp")
        if how is not None:
            op = str(n.args[1])
            with graph.inserting_after(last_ph):
                ph = graph.placeholder(f"normalizer_{len(normalizers)}")
            ph.meta["val"] = x.meta.get("val")
            ph.meta[_NORMALIZER] = len(normalizers)
            last_ph = ph
            res.replace_all_uses_with(ph)
            graph.erase_node(res)
            if res is not n:
                graph.erase_node(n)
            normalizers.append((ph, how, op))
            continue
        raise PipelineError(f"the step's {kind} at node {n.name!r} over the batch (of {x.name!r}"
                            f"{_where_near(gm, x)}) cannot be split into pipeline microbatches; use a plan without pp")
    prologue = _prologue(gm, batch_phs, normalizers, M, rows) if normalizers else None  # before the count is dead
    graph.eliminate_dead_code()
    gm.recompile()
    outs = list(out_node.args[0])
    loss_val = outs[roles.index("loss")]
    grad_vals = {r.removeprefix("grad:"): outs[i] for i, r in enumerate(roles) if r.startswith("grad:")}

    # 2. stage assignment
    tied = shared_tensors(captured) if S > 1 else set()
    pstage: dict[torch.fx.Node, int] = {}
    for p in placeholders:
        if gmeta.get_role(p) in ("param", "buffer"):
            f = gmeta.get_fqn(p)
            if f not in tied:
                pstage[p] = stage_of_layer.get(layer_of(f), 0)
    fw = ancestors([loss_val])
    for n in graph.nodes:  # getitems of forward tuples are forward (mean/rstd of a layer norm)
        if n.op == "call_function" and n.target is _getitem and n.args[0] in fw:
            fw.add(n)
    st: dict[torch.fx.Node, int] = {}
    deferred: list = []
    ph_bound = {gmeta.get_fqn(p): s for p, s in pstage.items()}
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    for n in body:
        if n not in fw:
            continue
        srcs = [pstage[i] for i in n.all_input_nodes if i in pstage] + [st[i] for i in n.all_input_nodes if i in st]
        if srcs:
            st[n] = max(srcs)
    lastuse = {v: s for v, s in st.items()}
    for n in body:
        if n in fw and n in st:
            for i in n.all_input_nodes:
                if i in st:
                    lastuse[i] = max(lastuse[i], st[n])
    for n in body:
        if n in fw:
            continue
        ins = n.all_input_nodes
        bound = [pstage[i] for i in ins if i in pstage]
        fw_in = [i for i in ins if i in st and i in fw]
        bw_in = [i for i in ins if i in st and i not in fw]
        if not (bound or fw_in or bw_in):
            continue  # free
        lo = max((st[i] for i in fw_in), default=0)
        hi = min((st[i] for i in bw_in), default=S - 1)
        if bound:
            want = max(bound)
        elif n.target is _getitem:
            want = st[ins[0]]
        elif fw_in:
            want = max(lastuse[i] for i in fw_in)
        else:
            want = hi
        want = min(max(want, lo), hi)
        if lo > hi or (bound and want != max(bound)):
            raise PipelineError(f"node {n.name!r} ({n.target}) of the backward needs values of stage {lo} and gradients "
                                f"of stage {hi}{f' and parameters of stage {max(bound)}' if bound else ''}: the layers' "
                                "order in the graph does not match the stages; choose other stage boundaries")
        st[n] = want
        if not bound and not fw_in and len(bw_in) == 1 and n.target is not _getitem:
            deferred.append(n)
    # a node that only transforms gradients (a view, a transpose, a bias's sum) runs where its users run, so that
    # one gradient crosses the cut, not each of its views; a parameter's gradient where the parameter is
    grad_of = {v: r.removeprefix("grad:") for v, r in zip(outs, roles) if r.startswith("grad:")}
    cut_adds: set = set()
    leaf_of: dict = {}  # a tied parameter's gradient term -> the parameter
    for v, f in grad_of.items():
        if f in tied and S > 1:
            leaves, adds = _add_tree(v, st)
            cut_adds |= adds
            leaf_of.update({leaf: f for leaf in leaves})
    fw_readers: dict[str, set[int]] = {}  # tied parameter -> stages whose forward reads it
    for n in body:
        if n in fw and n in st:
            for v in _free_inputs(n, st):
                if v.op == "placeholder" and gmeta.get_fqn(v) in tied:
                    fw_readers.setdefault(gmeta.get_fqn(v), set()).add(st[n])
    for n in reversed(deferred):
        cands = [st[u] for u in n.users if u in st and u not in cut_adds]
        if n in grad_of and ph_bound.get(grad_of[n]) is not None:
            cands.append(ph_bound[grad_of[n]])
        if n in leaf_of:  # computed where the stage holding the parameter below it is
            cands += [max(h for h in fw_readers.get(leaf_of[n], {0}) if h <= st[n])] \
                if any(h <= st[n] for h in fw_readers.get(leaf_of[n], {0})) else []
        if cands:
            st[n] = min(st[n], max(cands))
    for n in cut_adds:  # the runtime adds the stages' contributions
        st.pop(n, None)

    def free(n) -> bool:
        return isinstance(n, torch.fx.Node) and n.op not in ("placeholder", "output") and n not in st

    # 3. what each stage's programs read from outside
    def externals(nodes: set, roots: Iterable = ()) -> list:
        ext: set = set()
        seen: set = set()

        def visit(v):
            if not isinstance(v, torch.fx.Node) or v in nodes or v in seen:
                return
            seen.add(v)
            if v.op == "placeholder" or v in st:
                ext.add(v)
            elif v.op != "get_attr":
                for i in v.all_input_nodes:
                    visit(i)
        for n in nodes:
            for i in n.all_input_nodes:
                visit(i)
        for r in roots:
            visit(r)
        return [n for n in graph.nodes if n in ext]

    f_nodes = [{n for n in body if st.get(n) == s and n in fw} for s in range(S)]
    bw_nodes = [{n for n in body if st.get(n) == s and n not in fw} for s in range(S)]

    # holders of each state tensor (stages whose programs read it), then each parameter's gradient contributions
    holders: dict[str, set[int]] = {gmeta.get_fqn(p): set() for p in placeholders if gmeta.get_role(p) != "batch"
                                    and p.meta.get(_NORMALIZER) is None}
    for s in range(S):
        for v in externals(f_nodes[s] | bw_nodes[s]):
            if v.op == "placeholder" and gmeta.get_fqn(v) in holders:
                holders[gmeta.get_fqn(v)].add(s)
    for f, hs in holders.items():
        if not hs:
            hs.add(stage_of_layer.get(layer_of(f), 0))
    ph_of = {gmeta.get_fqn(p): p for p in placeholders if gmeta.get_role(p) in ("param", "buffer")}
    contrib: list[dict[str, list]] = [dict() for _ in range(S)]  # stage -> fqn -> leaf values (summed)
    for f, g in grad_vals.items():
        hs = sorted(holders[f])
        leaves = _add_leaves(g, st) if len(hs) > 1 else [g]
        for leaf in leaves:
            ls = st.get(leaf)
            if ls is None:
                h = hs[0]
            else:
                below = [h for h in hs if h <= ls]
                if not below:
                    raise PipelineError(f"the gradient of {f!r} is computed on stage {ls} ({leaf.name!r}) but the "
                                        f"parameter is held by stage(s) {hs} only; choose other stage boundaries")
                h = below[-1]
            contrib[h].setdefault(f, []).append(leaf)
        for h in hs:
            contrib[h].setdefault(f, [])

    recv: list[set] = [set() for _ in range(S)]   # forward values received by stage s
    gin: list[set] = [set() for _ in range(S)]    # backward values received by stage s (from s + 1)
    saved_ext: list[list] = [[] for _ in range(S)]
    f_ext: list[list] = [[] for _ in range(S)]
    for s in range(S):
        f_roots = [loss_val] if s == S - 1 else []
        f_ext[s] = externals(f_nodes[s], f_roots)
        for v in f_ext[s]:
            if v in st:
                if v not in fw or st[v] > s:
                    raise InternalError(f"pipeline cut: forward of stage {s} reads {v.name!r} of stage {st[v]}")
                for u in range(st[v] + 1, s + 1):
                    recv[u].add(v)
        w_roots = [leaf for leaves in contrib[s].values() for leaf in leaves]
        w_roots += [ph_of[f] for f, leaves in contrib[s].items() if not leaves]
        saved_ext[s] = externals(bw_nodes[s], w_roots)
        for v in saved_ext[s]:
            if v not in st:
                continue
            if v in fw:
                if st[v] > s:
                    raise PipelineError(f"the backward of stage {s} needs {v.name!r} ({v.target}), a forward value of "
                                        f"stage {st[v]}; choose other stage boundaries")
                for u in range(st[v] + 1, s + 1):
                    recv[u].add(v)
            else:
                if st[v] < s:
                    raise InternalError(f"pipeline cut: backward of stage {s} reads {v.name!r} of stage {st[v]}")
                for u in range(s, st[v]):
                    gin[u].add(v)
    index = {n: i for i, n in enumerate(graph.nodes)}

    def ordered(vals: Iterable) -> list:
        return sorted(set(vals), key=index.__getitem__)

    state_names_all = [gmeta.get_fqn(p) for p in placeholders if gmeta.get_role(p) in ("param", "buffer")]
    norm_phs = [ph for ph, _, _ in normalizers]
    stages: list[StageProgram] = []
    send_combines: list[tuple[str | None, ...]] = []
    grad_out_combines: list[tuple[str | None, ...]] = []
    for s in range(S):
        recv_s = ordered(recv[s])
        send_s = ordered(recv[s + 1]) if s + 1 < S else []
        saved_s = ordered(v for v in saved_ext[s] if v.op == "placeholder" or v in fw)
        gin_s = ordered(gin[s])
        gout_s = ordered(gin[s - 1]) if s > 0 else []
        send_combines.append(tuple(_mb_combine(v) for v in send_s))
        grad_out_combines.append(tuple(_mb_combine(v) for v in gout_s))
        # state this stage reads
        reads = [v for v in f_ext[s] + saved_s if v.op == "placeholder" and gmeta.get_fqn(v) in holders]
        state_phs = ordered(reads)
        f_inputs = state_phs + recv_s + batch_phs + norm_phs
        f_outputs = ([loss_val] if s == S - 1 else []) + send_s + saved_s
        forward = _extract(gm, f_inputs, f_outputs, f_nodes[s], st, f"stage {s} forward")
        # backward: input-gradient part = what the previous stage needs
        b_set = _ancestors_within([v for v in gout_s if st.get(v) == s], bw_nodes[s], st)
        for n in list(bw_nodes[s]):  # a getitem goes with its tuple
            if n.target is _getitem and n.args[0] in b_set:
                b_set.add(n)
        w_set = bw_nodes[s] - b_set
        w_roots = [leaf for leaves in contrib[s].values() for leaf in leaves]
        w_roots += [ph_of[f] for f, leaves in contrib[s].items() if not leaves]
        saved_w = externals(w_set, w_roots)
        b_inputs = saved_s + gin_s
        backward_input = _extract(gm, b_inputs, gout_s + saved_w, b_set, st, f"stage {s} backward_input")
        grad_fqns = [f for f in grad_vals if f in contrib[s]]
        w_outputs = [("sum", contrib[s][f], ph_of[f]) for f in grad_fqns]
        backward_weight = _extract(gm, saved_w, w_outputs, w_set, st, f"stage {s} backward_weight")
        stages.append(StageProgram(
            stage=s, num_stages=S, forward=forward, backward_input=backward_input, backward_weight=backward_weight,
            state_names=tuple(gmeta.get_fqn(p) for p in state_phs), grad_fqns=tuple(grad_fqns),
            recv_specs=_specs(recv_s), send_specs=_specs(send_s), grad_in_specs=_specs(gin_s),
            grad_out_specs=_specs(gout_s), recv_from=None, send_to=None, num_saved=len(saved_s),
            num_saved_w=len(saved_w),
            layers=tuple(layer for layer, t in stage_of_layer.items() if t == s)))
    return _Built(stages, prologue, holders, list(captured.param_fqns), state_names_all, dict(vprog.state),
                  dict(vprog.state_placements), dict(vprog.global_shapes), send_combines, grad_out_combines)


_getitem = operator.getitem


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph()
    env: dict = {}
    for n in graph.nodes:
        if n.op == "output":
            out = new.output(torch.fx.node.map_arg(n.args[0], env.__getitem__))
            out.meta = dict(n.meta)
        else:
            env[n] = new.node_copy(n, env.__getitem__)
    return new


_SHAPE_ONLY = (aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default)


def _only_to_outputs(res: torch.fx.Node, out_node: torch.fx.Node, out_users: dict) -> bool:
    """Whether ``res`` (a sum over microbatches) only reaches the loss / gradient outputs, through sums over
    other groups (linear: they commute with the runtime's sum) or ops that read only its shape."""
    if not res.users:
        return False
    for u in res.users:
        if u is out_node:
            if not out_users.get(res, "").startswith(("grad:", "loss")):
                return False
        elif u.op == "call_function" and u.target in _SHAPE_ONLY:
            continue
        elif _is(u, "all_reduce") and str(u.args[1]) == "sum":
            waits = list(u.users)
            if not (len(waits) == 1 and _is(waits[0], "wait") and _only_to_outputs(waits[0], out_node, out_users)):
                return False
        else:
            return False
    return True


def _batch_only(x: torch.fx.Node):
    """What computes ``x`` from batch tensors only: ``("node", x)`` when ``x`` depends on nothing else, the
    valid-token count ``("nll_total_weight", nll)`` of an ``nll_loss_forward``'s total weight (which the graph
    wires through the log-probabilities; with constant class weights, their sum over the valid targets); None
    otherwise."""
    def only_batch(v) -> bool:
        seen, stack = set(), [v]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder" and gmeta.get_role(n) != "batch":
                return False
            stack.extend(n.all_input_nodes)
        return True

    if only_batch(x):
        return ("node", x)
    if x.target is _getitem and x.args[1] == 1 and isinstance(x.args[0], torch.fx.Node) and \
            x.args[0].target is aten.nll_loss_forward.default:
        nll = x.args[0]
        weight = nll.args[2] if len(nll.args) > 2 else nll.kwargs.get("weight")
        if (weight is None or only_batch(weight)) and only_batch(nll.args[1]):  # class weights: a constant
            return ("nll_total_weight", nll)
    return None


# how the prologue combines the microbatches' values of a normalizer all-reduced with this op (else: added)
_PROLOGUE_COMBINE = {"max": aten.maximum.default, "min": aten.minimum.default}


def _prologue(gm: torch.fx.GraphModule, batch_phs: list, normalizers: list, M: int, rows: int) -> PrologueProgram:
    """``prologue(*local_batch)``: each normalizer's value summed (or max-ed, min-ed: an all/any of the labels, such
    as ``F.one_hot``'s check) over the M microbatches."""
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(f"batch_{i}") for i in range(len(batch_phs))]
    totals = [None] * len(normalizers)
    for m in range(M):
        env = {p: graph.call_function(aten.slice.Tensor, (inp, 0, m * rows, (m + 1) * rows))
               for p, inp in zip(batch_phs, inputs)}
        for k, (ph, (how, node), op) in enumerate(normalizers):
            if how == "node":
                val = _copy_into(graph, node, env)
            else:
                target = _copy_into(graph, node.args[1], env)
                ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
                mask = graph.call_function(aten.ne.Scalar, (target, ignore))
                weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
                if weight is None:
                    count = graph.call_function(aten.sum.default, (mask,))
                else:  # the sum of the valid targets' class weights (F.cross_entropy(weight=...)'s normalizer)
                    w = _copy_into(graph, weight, env)
                    safe = graph.call_function(aten.where.ScalarOther, (mask, target, 0))
                    picked = graph.call_function(aten.index.Tensor, (w, [safe]))
                    count = graph.call_function(aten.sum.default, (graph.call_function(aten.mul.Tensor,
                                                                                       (picked, mask)),))
                val = graph.call_function(aten._to_copy.default, (count,), {"dtype": ph.meta["val"].dtype})
            if totals[k] is None:
                totals[k] = val
            else:
                totals[k] = graph.call_function(_PROLOGUE_COMBINE.get(op, aten.add.Tensor), (totals[k], val))
    graph.output(tuple(totals))
    ops = tuple(op for _, _, op in normalizers)
    for op in ops:
        if op not in ("sum", *_PROLOGUE_COMBINE):
            raise PipelineError(f"a normalizer reduced with {op!r} over the batch is not supported in a pipeline")
    return PrologueProgram(torch.fx.GraphModule(gm, graph), ops,
                           tuple(node.name for _, (_, node), _ in normalizers))


def _copy_into(graph: torch.fx.Graph, root: torch.fx.Node, env: dict) -> torch.fx.Node:
    order = []
    seen = set()

    def visit(n):
        if n in env or n in seen:
            return
        seen.add(n)
        if n.op == "placeholder":
            raise InternalError(f"pipeline prologue: {root.name!r} reads {n.name!r}, not a batch tensor")
        for i in n.all_input_nodes:
            visit(i)
        order.append(n)
    visit(root)
    for n in order:
        env[n] = graph.node_copy(n, env.__getitem__)
    return env[root]


def _add_leaves(g: torch.fx.Node, st: dict) -> list:
    """The terms of a tied parameter's gradient: ``g`` split at additions of two stages' contributions."""
    return _add_tree(g, st)[0]


def _add_tree(g: torch.fx.Node, st: dict) -> tuple[list, set]:
    """(leaves, the additions cut out) of :func:`_add_leaves`."""
    if (isinstance(g, torch.fx.Node) and g.op == "call_function" and g.target is aten.add.Tensor and len(g.args) == 2
            and not g.kwargs and all(isinstance(a, torch.fx.Node) for a in g.args)):
        (a, ia), (b, ib) = _add_tree(g.args[0], st), _add_tree(g.args[1], st)
        if {st.get(x) for x in a} != {st.get(x) for x in b} or len({st.get(x) for x in a + b}) > 1:
            return a + b, ia | ib | {g}
    return [g], set()


def _free_inputs(n: torch.fx.Node, staged: dict) -> set:
    """The placeholders and staged nodes ``n`` reads, through free (not ``staged``) nodes."""
    out: set = set()
    seen: set = set()
    stack = list(n.all_input_nodes)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v.op == "placeholder" or v in staged:
            out.add(v)
        elif v.op == "call_function":
            stack.extend(v.all_input_nodes)
    return out


def _ancestors_within(roots: list, allowed: set, staged: dict) -> set:
    """The nodes of ``allowed`` that ``roots`` need, through ``allowed`` and free (not ``staged``) nodes."""
    out: set = set()
    seen: set = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in allowed:
            out.add(n)
        if n in allowed or (n not in staged and n.op == "call_function"):
            stack.extend(n.all_input_nodes)
    return out


def _specs(vals: list) -> tuple[TensorSpec, ...]:
    out = []
    for v in vals:
        val = v.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise InternalError(f"pipeline cut: value {v.name!r} crossing stages is not a tensor ({type(val).__name__})")
        out.append(TensorSpec(tuple(int(x) for x in val.shape), val.dtype))
    return tuple(out)


def _extract(gm: torch.fx.GraphModule, inputs: list, outputs: list, allowed: set, staged: dict,
             what: str) -> torch.fx.GraphModule:
    """A GraphModule computing ``outputs`` (nodes, or ``("sum", nodes, like)``: their sum, zeros like ``like`` if
    none) of ``gm`` from ``inputs``, copying only nodes of ``allowed`` and free nodes, in ``gm``'s order."""
    graph = torch.fx.Graph()
    env: dict = {}
    used = set()
    for i, v in enumerate(inputs):
        if v in env:
            continue
        name = re.sub(r"\W", "_", v.name)
        env[v] = graph.placeholder(name)
        env[v].meta = dict(v.meta)
    need: set = set()

    def visit(n):
        if not isinstance(n, torch.fx.Node) or n in env or n in need:
            return
        if n.op == "placeholder":
            raise InternalError(f"pipeline cut: {what} needs {n.name!r} ({gmeta.get_fqn(n) or 'input'}) but does not "
                                "take it")
        if n in staged and n not in allowed:
            raise InternalError(f"pipeline cut: {what} would recompute {n.name!r} ({n.target}) of another program")
        need.add(n)
        for i in n.all_input_nodes:
            visit(i)
    roots = []
    for o in outputs:
        if isinstance(o, tuple):
            roots.extend(o[1])
            if not o[1]:
                roots.append(o[2])
        else:
            roots.append(o)
    for r in roots:
        visit(r)
    for n in gm.graph.nodes:
        if n in need:
            env[n] = graph.node_copy(n, env.__getitem__)
            used.add(n)
    results = []
    for o in outputs:
        if isinstance(o, tuple):
            _, terms, like = o
            if not terms:
                results.append(graph.call_function(aten.zeros_like.default, (env[like],)))
                continue
            acc = env[terms[0]]
            for t in terms[1:]:
                acc = graph.call_function(aten.add.Tensor, (acc, env[t]))
            results.append(acc)
        else:
            results.append(env[o])
    graph.output(tuple(results))
    out = torch.fx.GraphModule(gm, graph)
    out.graph.lint()
    return out

