"""The lowering: a captured joint graph and a :class:`~adaptdist.plan.Plan` -> one RankProgram per rank.

One way in: :func:`lower` (``captured``, a ``Plan``, :class:`~adaptdist.lowering_options.LoweringOptions`).
A manual plan (:class:`~adaptdist.annotations.ManualPlan`) becomes a ``Plan`` first
(:func:`resolve_plan`); :func:`compile_model` captures a model's step and does both, for callers that
start from the model.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx
import torch.nn as nn

from .. import graph_meta as gmeta
from ..passes.complete_placements import complete_param_placements
from ..passes.context import PassContext
from ..passes.global_rng import mark_random_ops
from ..passes.infra import check_disabled, copy_graph_module, run_pipeline
from ..passes.localize_shapes import localize_shapes
from ..passes.pipeline import PASSES, check_skippable
from ..lowering_options import LoweringOptions, advice_fitting
from ..mesh import Mesh, lowering_order
from ..placement import Placement, Replicate, Shard, chunk_interval, parse_placement
from ..errors import UnsupportedOpError, UsageError
from ..plan import Departure, LoweringRecord, Plan, Redistribution, graph_fingerprint
from ..program import RankProgram
from .capture import CapturedGraph, capture
from .codegen import make_rank_program
from .consistency import check_against_plan, check_collectives

if TYPE_CHECKING:
    from ..annotations import ManualPlan
    from ..stage_program import PipelineRankProgram
    from .pipeline_lowering import PipelineOptions

log = logging.getLogger("adaptdist.compiler")


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext, options: LoweringOptions, passes=PASSES,
               dump_dir: str | None = None, plan_name: str = "") -> torch.fx.GraphModule:
    """:func:`~adaptdist.passes.infra.run_pipeline` of ``passes`` (default: the lowering's
    :data:`~adaptdist.passes.pipeline.PASSES`) over ``gm``."""
    return run_pipeline(gm, ctx, passes, options, dump_dir=dump_dir, plan_name=plan_name)


def _lower_mesh(captured: CapturedGraph, plan: Plan, options: LoweringOptions, *, follow_strategies: bool,
                state: dict[str, torch.Tensor] | None = None, timings: dict[str, float] | None = None,
                departures: tuple[Departure, ...] = ()) -> dict[int, RankProgram]:
    """Lower a captured step onto ``plan``'s N-D mesh; returns one RankProgram per rank, each carrying
    ``plan`` with the :class:`~adaptdist.plan.LoweringRecord` of this lowering (and ``departures``).

    Batch inputs are split on dim 0 (torch.chunk semantics) over the batch axis (None:
    replicated); parameter ``f`` takes placement ``plan.param_placements[f]`` on each
    axis (absent: completed, or replicated). The mesh is lowered one axis at a time (see
    :func:`lowering_order`): the whole pass pipeline runs for that axis and every
    coordinate along it gets its localized graph, which the next axis lowers in turn,
    treating the collectives already there as ordinary (linear) ops. Axes of size 1 are
    skipped: they change nothing. With ``follow_strategies``, the plan's node strategies (an automatic
    plan's) are followed where the rules agree, and parameters are then taken as given (no completion). Each
    rank's program means exactly what the
    single-process step means on the whole global batch, and its state holds its own
    shard of every parameter. ``timings`` (if given) receives the seconds spent in ``lowering``
    (passes, localization, checks) and ``codegen`` (each rank's code and state).

    Raises:
        UnsupportedOpError: an op cannot run with these placements (e.g. an op with no sharding
            rule over a split batch).
        CollectiveMismatchError: ranks of one group would issue different collectives.
    """
    t_start = time.perf_counter()
    codegen_s = 0.0
    mesh, batch_axis = plan.mesh_spec, plan.batch_axis
    axis_placements = plan.axis_placements()
    axis_hints = plan.axis_hints() if follow_strategies else None
    plan_name = plan.name
    order = lowering_order(mesh, batch_axis)
    axis_placements = {a: dict(pl) for a, pl in axis_placements.items()}  # completion adds to these
    graphs: dict[tuple[int, ...], torch.fx.GraphModule] = {(): copy_graph_module(captured.gm)}
    if options.rng == "global":  # random ops draw what one process draws (passes/global_rng.py)
        mark_random_ops(graphs[()])
    ctxs: dict[str, PassContext] = {}
    node_placements: dict[str, list[Placement]] = {}
    redistributions: dict[str, list[Redistribution]] = {}
    for axis in order:
        ctx = PassContext(axis_size=mesh.size(axis), batch_size=captured.batch_size, mesh_axis=axis,
                          bucket_bytes=options.grad_bucket_bytes, gather_bucket_bytes=options.gather_bucket_bytes,
                          shard_batch=axis == batch_axis, param_placements=dict(axis_placements.get(axis, {})),
                          replicate_fallback=options.replicate_fallback, batch_norm=options.batch_norm,
                          node_hints=dict((axis_hints or {}).get(axis, {})),
                          rng=options.rng, batch_rows=_batch_rows(plan, axis, captured.batch_size))
        ctxs[axis] = ctx
        if ctx.axis_size == 1:
            graphs = {key + (0,): gm for key, gm in graphs.items()}
            axis_placements[axis] = {}
            continue
        completed = ({f: p for f, p in ctx.param_placements.items() if not isinstance(p, Replicate)} if axis_hints
                     else complete_param_placements(next(iter(graphs.values())), ctx))
        axis_placements[axis] = completed
        ctx = dataclasses.replace(ctx, param_placements=completed)
        ctxs[axis] = ctx
        if axis == batch_axis and not ctx.shards_batch:
            log.warning("a global batch of %d sample cannot be split over %d ranks: every rank computes the whole "
                        "step (correct, but no faster than one rank)", captured.batch_size, ctx.axis_size)
        lowered = {}
        try:
            for key, gm in graphs.items():
                sub_dump = str(Path(options.dump_dir) / f"{axis}{''.join(map(str, key))}") if options.dump_dir else None
                lowered[key] = run_passes(gm, ctx, options, dump_dir=sub_dump, plan_name=plan_name)
        except UnsupportedOpError as e:
            e.axis = axis  # for the departure record (lower)
            raise
        first = next(iter(lowered.values()))
        k = mesh.index(axis)
        for n in first.graph.nodes:
            if n.op != "output" and gmeta.get_placements(n) is not None:
                node_placements.setdefault(n.name, [Replicate()] * len(mesh.names))[k] = gmeta.get_placements(n)[0]
        for n in first.graph.nodes:
            for src, frm, to, _, by in gmeta.get_resharded(n, ctx.group_name):
                redistributions.setdefault(axis, []).append(
                    Redistribution(n.name, src, parse_placement(frm), parse_placement(to), by))
        try:
            graphs = {key + (i,): localize_shapes(gm, ctx, i)[0] for key, gm in lowered.items()
                      for i in range(ctx.axis_size)}
        except UnsupportedOpError as e:
            e.axis = axis
            raise
    record = LoweringRecord(
        param_placements={f: tuple(axis_placements.get(a, {}).get(f, Replicate()) for a in mesh.names)
                          for f in sorted({f for pl in axis_placements.values() for f in pl})},
        node_placements={n: tuple(p) for n, p in node_placements.items()},
        redistributions={a: tuple(rs) for a, rs in redistributions.items()},
        departures=tuple(departures),
    )
    plan = dataclasses.replace(plan, lowered=record)
    if axis_hints:
        _log_hints(plan)
    global_shapes = {gmeta.get_fqn(ph): list(ph.meta["val"].shape)
                     for ph in captured.gm.graph.find_nodes(op="placeholder") if gmeta.get_role(ph) != "batch"}
    state_placements = {f: [repr(axis_placements.get(a, {}).get(f, Replicate())) if mesh.size(a) > 1 else "R"
                            for a in mesh.names]
                        for f in global_shapes}
    state_placements = {f: p for f, p in state_placements.items() if any(x != "R" for x in p)}
    programs = {}
    for key, local in graphs.items():
        coords = dict(zip(order, key))
        rank = mesh.rank(tuple(coords[a] for a in mesh.names))
        if batch_axis is not None and mesh.size(batch_axis) > 1:
            bctx = ctxs[batch_axis]
            i = coords[batch_axis]
            batch_slice = (bctx.shard_offsets()[i], bctx.shard_sizes()[i])
        else:
            batch_slice = (0, captured.batch_size)
        t_gen = time.perf_counter()
        programs[rank] = make_rank_program(
            local, mesh, rank, batch_slice, captured.batch_size, captured.input_fqns, captured.param_fqns,
            captured.num_batch_inputs, _local_state(state or {}, [ctxs[a] for a in order], key), captured.tied,
            global_shapes, state_placements,
        )
        programs[rank].plan = plan
        programs[rank].stacked = {f: list(ms) for f, ms in captured.stacked.items()}
        programs[rank].notes = list(captured.notes)
        codegen_s += time.perf_counter() - t_gen
    programs = dict(sorted(programs.items()))
    check_collectives(programs)
    check_against_plan(programs, plan)
    if timings is not None:
        timings["lowering"] = timings.get("lowering", 0.0) + time.perf_counter() - t_start - codegen_s
        timings["codegen"] = timings.get("codegen", 0.0) + codegen_s
    return programs


def _batch_rows(plan: Plan, axis: str, batch_size: int) -> tuple[int, ...] | None:
    """The plan's uneven rows per coordinate of ``axis`` when it is the batch axis (None: torch.chunk's split).

    Raises:
        UsageError: the rows do not add up to the captured batch size.
    """
    rows = plan.devices.batch_rows if plan.devices is not None else None
    if rows is None or axis != plan.batch_axis or plan.mesh.get(axis, 1) < 2 or batch_size < 2:
        return None
    if sum(rows) != batch_size:
        raise UsageError(f"plan {plan.name!r}: devices.batch_rows {list(rows)} add up to {sum(rows)} rows, but the "
                         f"batch has {batch_size}; make the plan again for this batch size")
    return tuple(rows)


def _log_hints(plan: Plan) -> None:
    """Log how many of the planner's output placements the lowering reproduced."""
    total = same = 0
    lowered = plan.lowered.node_placements
    for n, sts in plan.node_strategies.items():
        if n not in lowered:
            continue
        for k, s in enumerate(sts):
            if s is not None and s.outputs and plan.mesh_spec.sizes[k] > 1:
                total += 1
                same += lowered[n][k] == s.outputs[0]
    log.info("planner strategies followed: %d of %d node placements as planned", same, total)


def _local_state(state: dict[str, torch.Tensor], ctxs: list[PassContext], coords: tuple[int, ...]
                 ) -> dict[str, torch.Tensor]:
    """Each rank's own shard of every sharded parameter: torch.chunk along each axis in lowering order."""
    out = {}
    for f, t in state.items():
        for ctx, i in zip(ctxs, coords):
            p = ctx.param_placements.get(f) if ctx.axis_size > 1 else None
            if isinstance(p, Shard):
                s, e = chunk_interval(t.shape[p.dim], ctx.axis_size, i)
                t = t.narrow(p.dim, s, e - s)
        out[f] = t.clone() if t is not state[f] else t
    return out


def resolve_plan(plan: "ManualPlan | Plan | None", captured: CapturedGraph, world_size: int,
                 mesh: str | None = None, *, pipeline: "PipelineOptions | None" = None) -> Plan:
    """The :class:`~adaptdist.plan.Plan` that :func:`lower` takes, for ``plan`` on ``world_size`` ranks.

    A :class:`~adaptdist.annotations.ManualPlan` (None: data parallel) is sized by ``mesh``
    (``"dp=2,tp=2"``; see :meth:`ManualPlan.mesh`) and its globs resolved against the captured
    parameters; its parameter placements are the ones annotated (the lowering completes the rest). A
    ``Plan`` (saved or automatic) is checked against the graph, the world size and ``mesh``. With
    ``pipeline`` (:class:`~adaptdist.compiler.pipeline_lowering.PipelineOptions`: ``--plan pp``,
    ``--mesh pp=2,dp=2``), a manual plan (None: ``pp`` alone, or the mesh's stage axes as a preset) becomes a
    pipeline plan (:func:`~adaptdist.compiler.pipeline_lowering.resolve_pipeline_plan`).

    Raises:
        PlanMismatchError: a saved plan made for another graph.
        UsageError: a plan for another number of ranks, ``mesh`` differing from a saved plan's, or a
            bad ``mesh`` / annotation (see :func:`~adaptdist.annotations.resolve_param_placements`).
    """
    from ..annotations import ManualPlan

    if pipeline is not None and not isinstance(plan, Plan):
        from .pipeline_lowering import resolve_pipeline_plan
        return resolve_pipeline_plan(plan, captured, world_size, mesh, pipeline, resolve_plan=resolve_plan)
    if plan is None:
        plan = ManualPlan.parse("dp")
    if isinstance(plan, Plan):
        plan.check_graph(captured.gm, f"plan {plan.name!r}")
        from ..plan_checks import check_plan_params

        check_plan_params(plan, {gmeta.get_fqn(p): tuple(p.meta["val"].shape)  # an edited plan.json: named, not a
                                 for p in captured.gm.graph.find_nodes(op="placeholder")  # pass's ValueError
                                 if gmeta.get_role(p) != "batch"})
        m = plan.mesh_spec
        if plan.world_size != world_size:
            raise UsageError(f"plan {plan.name!r} is for mesh {m} ({plan.world_size} ranks), this job has {world_size}; "
                             f"run it on {plan.world_size} ranks (--nproc {plan.world_size}, or a cluster of that size; "
                             "without --nproc and --cluster a saved plan brings its mesh)")
        if mesh and Mesh.parse(mesh) != m:
            raise UsageError(f"--mesh {mesh} differs from the mesh {m} of plan {plan.name!r}; drop --mesh")
        return plan
    if not isinstance(plan, ManualPlan):
        raise UsageError(f"a plan is a ManualPlan (ManualPlan.parse('dp')) or a Plan (Plan.load('plan.json')), "
                         f"not {type(plan).__name__}")
    m = plan.mesh(world_size, mesh)
    shapes = {gmeta.get_fqn(p): tuple(p.meta["val"].shape) for p in captured.gm.graph.find_nodes(op="placeholder")
              if gmeta.get_role(p) != "batch"}
    if captured.stacked and "ep" in plan.mesh_axes:
        plan = _ep_for_expert_lists(plan, shapes, captured.stacked)
    axis_pl = plan.axis_placements(shapes, set(captured.param_fqns), {a: m.size(a) for a in m.names})
    fqns = sorted({f for pl in axis_pl.values() for f in pl})
    return Plan(mesh=m.as_dict(), batch_axis=plan.batch_axis,
                param_placements={f: tuple(axis_pl.get(a, {}).get(f, Replicate()) for a in m.names) for f in fqns},
                graph_fingerprint=graph_fingerprint(captured.gm), name=plan.name)


def _ep_for_expert_lists(plan: "ManualPlan", shapes: dict[str, tuple[int, ...]], stacked: dict[str, list[str]]
                         ) -> "ManualPlan":
    """``plan`` with every ModuleList expert's stacked parameter (``stacked``: :mod:`.expert_lists`) placed
    ``S(0)`` (its expert dim) on the ``ep`` mesh axis, after the plan's own globs (which win), and ``R`` on the
    others; a glob of the plan that matches no parameter is dropped (a model file's ``EP_PLAN`` written for the
    stacked form, ``moe.w_in``, while this model's experts are a list)."""
    import fnmatch

    k = plan.mesh_axes.index("ep")
    params = tuple((g, pls) for g, pls in plan.params if any(fnmatch.fnmatchcase(f, g) for f in shapes))
    extra = tuple((f, tuple("S(0)" if i == k else "R" for i in range(len(plan.mesh_axes)))) for f in stacked
                  if not any(fnmatch.fnmatchcase(f, g) for g, _ in params))
    return dataclasses.replace(plan, params=params + extra)


def lower(captured: CapturedGraph, plan: Plan, options: LoweringOptions, *,
          state: dict[str, torch.Tensor] | None = None, timings: dict[str, float] | None = None
          ) -> "dict[int, RankProgram] | dict[int, PipelineRankProgram]":
    """Lower a captured step under ``plan`` (see :func:`resolve_plan` for a manual one) with ``options``.

    ``state`` (full tensors by fqn) is split into each rank's program (absent: programs without state).
    Batch inputs are split on dim 0 (torch.chunk semantics) over the plan's batch axis; parameter ``f``
    takes ``plan.param_placements[f]`` on each axis. The mesh is lowered one axis at a time (see
    :func:`lowering_order`): the whole pass pipeline runs for that axis and every coordinate along it
    gets its localized graph, which the next axis lowers in turn. A plan with the planner's node
    strategies is followed where the rules agree, and its parameter placements are taken as given;
    a plan without them (manual) has its unannotated parameters completed. Each rank's program means
    exactly what the single-process step means on the whole global batch. ``timings`` (if given)
    receives the seconds spent in ``lowering`` and ``codegen``. A pipeline plan (``plan.pipeline``) gives
    one :class:`~adaptdist.stage_program.PipelineRankProgram` per rank instead
    (:func:`~adaptdist.compiler.pipeline_lowering.lower_pipeline`; it raises PipelineError too).

    Raises:
        UnsupportedOpError: an op cannot run with these placements (e.g. an op with no sharding rule over a
            split batch).
        CollectiveMismatchError: ranks of one group would issue different collectives.
        UsageError: ``plan`` is not a Plan, or ``options.disabled_passes`` names no pass of the pipeline or one
            the numbers rely on (see :data:`~adaptdist.passes.pipeline.SKIPPABLE`).
    """
    if not isinstance(plan, Plan):
        raise UsageError(f"lower() takes a Plan (resolve_plan turns a ManualPlan into one), not {type(plan).__name__}")
    if not isinstance(options, LoweringOptions):
        raise UsageError(f"lower() takes LoweringOptions, not {type(options).__name__}")
    check_skippable(options)
    with advice_fitting(options.front_end):
        if plan.pipeline is not None:
            from .pipeline_lowering import lower_pipeline
            plan.check_graph(captured.gm, f"plan {plan.name!r}")
            return lower_pipeline(captured, dataclasses.replace(plan, lowered=None), options, state,
                                  lower_mesh=_lower_mesh)
        return _lower(captured, plan, options, state, timings)


def _lower(captured: CapturedGraph, plan: Plan, options: LoweringOptions, state: dict[str, torch.Tensor] | None,
           timings: dict[str, float] | None) -> dict[int, RankProgram]:
    check_disabled(options, PASSES)
    plan = dataclasses.replace(plan, lowered=None)
    kwargs = dict(state=state or {}, timings=timings)
    if not plan.node_strategies:
        return _use_transports(_lower_mesh(captured, plan, options, follow_strategies=False, **kwargs), options)
    try:
        programs = _lower_mesh(captured, plan, options, follow_strategies=True, **kwargs)
    except UnsupportedOpError as e:
        # the rules accepted each strategy alone, but not their combination somewhere: keep the planner's
        # parameter placements and let the rules place the activations; one line, recorded in the plan
        d = _departure(e)
        log.warning("plan %r: the lowering departs from the planner's node strategies at %s; it lowers the plan's "
                    "parameter placements with the rules' own activation placements instead", plan.name, d.line())
        programs = _lower_mesh(captured, plan, options, follow_strategies=False, departures=(d,), **kwargs)
    return _use_transports(programs, options)


def _use_transports(programs: dict[int, RankProgram], options: LoweringOptions) -> dict[int, RankProgram]:
    """The lowering's last, per-rank pass: collectives of mesh axes on shared memory
    (:func:`~adaptdist.comm_transport.axis_transports` of ``options.comm`` and ``options.hosts``) become
    ``torch.ops.adaptdist.shm_*`` (``passes/use_shm_collectives.py``); each changed program's source is written
    again. Runs after the consistency checks, which see the functional collectives. Under ``auto`` an axis whose
    groups /dev/shm has no room for stays on gloo (:func:`~adaptdist.comm_transport.fit_shm_space`, one warning).

    Raises:
        ShmUnavailableError: ``options.comm == "shm"`` without the kernels.
    """
    from ..comm_transport import axis_transports, fit_shm_space, mesh_rank_hosts
    from ..mesh import shm_group_name
    from ..passes.use_shm_collectives import use_shm_collectives
    from .codegen import rewrite_source

    for program in programs.values():
        program.comm = options.comm  # auto: the runtime may still put an axis on gloo (register_mesh_groups)
    if not programs or options.comm == "gloo":
        return programs
    plan = next(iter(programs.values())).plan
    mesh = plan.mesh_spec
    transports = axis_transports(mesh, options.comm, mesh_rank_hosts(plan, options.hosts),
                                 what="comm='shm' (--comm shm)" if options.front_end == "cli"
                                 else "adaptdist.backend(comm='shm')")
    if options.comm == "auto":  # a /dev/shm too small for the groups' slots: gloo, with one warning
        transports = fit_shm_space(mesh, transports, options.shm_space)
    axes = [a for a, t in transports.items() if t == "shm"]
    for program in programs.values():
        # named by this rank's group's ranks (mesh rank = global rank: the runtime's DeviceMesh is row-major)
        groups = {mesh.group_name(a): shm_group_name(mesh.group_name(a), mesh.group(a, program.rank))
                  for a in axes}
        gm, changed = use_shm_collectives(program.module, groups)
        if changed:
            program.code = rewrite_source(program.code, gm)
    return programs


_NODE_IN_MESSAGE = re.compile(r"(?:at node|node) '([^']+)'|While executing %(\w+)")


def _departure(e: Exception) -> Departure:
    """The node and one-line reason of a failure to follow the planner's strategies (``e.axis`` set by
    :func:`_lower_mesh`)."""
    text = str(e)
    m = _NODE_IN_MESSAGE.search(text)
    node = (m.group(1) or m.group(2)) if m else "?"
    reason = next((line.strip() for line in text.splitlines() if line.strip() and
                   not line.strip().startswith("While executing")), type(e).__name__)
    return Departure(node, getattr(e, "axis", ""), reason)


def compile_model(model: nn.Module, batch: tuple, loss_fn: Callable, world_size: int,
                  plan: "ManualPlan | Plan | None" = None, options: LoweringOptions | None = None, *,
                  mesh: str | None = None, captured: CapturedGraph | None = None,
                  timings: dict[str, float] | None = None, pipeline: "PipelineOptions | None" = None,
                  cluster: Any = None, optimizer: str = "adamw", batch_split: str | tuple[int, ...] = "auto"
                  ) -> "dict[int, RankProgram] | dict[int, PipelineRankProgram]":
    """Capture ``model``'s training step (unless ``captured`` is given: the planner's capture of it),
    resolve ``plan`` (:func:`resolve_plan`; None: data parallel) and :func:`lower` it with ``options``
    (None: the defaults) onto ``world_size`` ranks. Each program holds its rank's shard of the model's
    current parameters and buffers. With ``cluster`` (the devices it will run on) the plan is first placed on
    them (:func:`~.device_placement.place_on_devices`: the rank mapping, and with ``batch_split="auto"`` uneven
    batch rows by each device's speed and memory, judged with ``optimizer``'s state; ``"even"``: torch.chunk's;
    a tuple: those rows); the programs' plan then carries it (``Plan.devices``).

    Raises:
        CaptureError, UnsupportedOpError, UsageError: see :func:`capture`, :func:`resolve_plan`, :func:`lower`.
        ShmUnavailableError: ``options.comm == "shm"`` without the kernels, before any capture.
    """
    if options is not None and options.comm == "shm":  # refused before capture and planning, not after them
        from ..kernels import require

        require("comm='shm' (--comm shm)" if options.front_end == "cli" else "comm='shm'")
    t0 = time.perf_counter()
    if captured is None:
        captured = capture(model, batch, loss_fn)
        log.info("captured %s: %d nodes in %.2f s", captured.model_name, len(captured.gm.graph.nodes),
                 time.perf_counter() - t0)
    # every name, tied ones too: a tensor registered twice (two buffers of one tensor) is an input under each name
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    if captured.stacked:  # ModuleList experts, captured stacked (expert_lists.py)
        from .expert_lists import stack_state

        named.update(stack_state(named, captured.stacked))
    state = {f: named[f].detach() for f in captured.input_fqns}
    resolved = resolve_plan(plan, captured, world_size, mesh, pipeline=pipeline)
    options = options if options is not None else LoweringOptions()
    if cluster is not None and resolved.pipeline is None and (resolved.devices is None or batch_split != "auto"):
        from .device_placement import place_on_devices

        return place_on_devices(captured, resolved, cluster, options, lower, state=state, optimizer=optimizer,
                                batch_split=batch_split, timings=timings)[1]
    return lower(captured, resolved, options, state=state, timings=timings)
