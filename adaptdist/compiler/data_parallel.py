"""The data-parallel lowering pipeline: captured joint graph -> one RankProgram per rank."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.fx
import torch.nn as nn

from .. import graph_meta as gmeta
from ..passes.bucket_grad_allreduce import bucket_grad_allreduce
from ..passes.bucket_param_allgather import bucket_param_allgather
from ..passes.combine_partial_sums import combine_partial_sums
from ..passes.bucket_grad_reduce_scatter import bucket_grad_reduce_scatter
from ..passes.decompose_addmm import decompose_addmm
from ..passes.complete_placements import complete_param_placements
from ..passes.context import PassContext
from ..passes.globalize_reductions import globalize_reductions
from ..passes.insert_redistributes import insert_redistributes
from ..passes.localize_shapes import copy_graph_module, localize_shapes
from ..passes.propagate_placements import propagate_placements
from ..passes.regather_in_backward import regather_in_backward
from ..passes.relax_views import relax_views
from ..passes.vocab_parallel_embedding import vocab_parallel_embedding
from ..passes.vocab_parallel_loss import vocab_parallel_loss
from ..mesh import Mesh
from ..placement import Placement, Replicate, Shard, chunk_interval
from ..errors import AdaptdistError, InternalError, UnsupportedOpError, UsageError
from ..plan import Plan, graph_fingerprint
from ..program import RankProgram
from .capture import CapturedGraph, capture
from .codegen import make_rank_program
from .consistency import check_against_plan, check_collectives

log = logging.getLogger("adaptdist.compiler")

Pass = Callable[[torch.fx.GraphModule, PassContext], tuple[torch.fx.GraphModule, bool]]

DP_PASSES: tuple[Pass, ...] = (
    decompose_addmm,
    propagate_placements,
    combine_partial_sums,
    globalize_reductions,
    propagate_placements,
    insert_redistributes,
    vocab_parallel_embedding,
    vocab_parallel_loss,
    regather_in_backward,
    bucket_param_allgather,
    bucket_grad_reduce_scatter,
    bucket_grad_allreduce,
    relax_views,
)


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext, passes=DP_PASSES, dump_dir: str | None = None
               ) -> torch.fx.GraphModule:
    """Run ``passes`` in order, logging each one's time; with ``dump_dir``, write the graph after each."""
    for i, p in enumerate(passes):
        t0 = time.perf_counter()
        try:
            gm, changed = p(gm, ctx)
        except AdaptdistError:
            raise
        except Exception as e:
            log.debug("pass %s failed", p.__name__, exc_info=True)
            raise InternalError(
                f"internal error in pass {p.__name__}: {type(e).__name__}: {str(e).splitlines()[0]}. This is a bug "
                "in adaptdist, not in your model: please report it (run with -v for the traceback); "
                "--plan dp may avoid it"
            ) from e
        log.debug("pass %s: %.1f ms, changed=%s", p.__name__, 1e3 * (time.perf_counter() - t0), changed)
        if dump_dir:
            d = Path(dump_dir)
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{i:02d}_{p.__name__}.txt").write_text(str(gm.graph))
    return gm


def lower(captured: CapturedGraph, world_size: int, *, mesh_axis: str = "dp", shard_batch: bool = True,
          param_placements: Mapping[str, Placement] | None = None, bucket_bytes: int = 25 * 2**20,
          state: dict[str, torch.Tensor] | None = None, dump_dir: str | None = None,
          plan_name: str = "", replicate_fallback: bool = False) -> dict[int, RankProgram]:
    """Lower a captured step onto a 1-D mesh of ``world_size`` ranks: :func:`lower_mesh` with one axis."""
    return lower_mesh(captured, Mesh.one_axis(mesh_axis, world_size), batch_axis=mesh_axis if shard_batch else None,
                      axis_placements={mesh_axis: dict(param_placements or {})}, bucket_bytes=bucket_bytes,
                      state=state, dump_dir=dump_dir, plan_name=plan_name, replicate_fallback=replicate_fallback)


def lowering_order(mesh: Mesh, batch_axis: str | None) -> list[str]:
    """Axes in the order they are lowered: model-parallel axes first (mesh order), the batch axis last,
    so data-parallel gradient buckets are built from already-local (model-parallel) shards. A tensor dim
    sharded on several axes is chunked in this order (outer first)."""
    return [a for a in mesh.names if a != batch_axis] + ([batch_axis] if batch_axis in mesh.names else [])


def lower_mesh(captured: CapturedGraph, mesh: Mesh, *, batch_axis: str | None,
               axis_placements: Mapping[str, Mapping[str, Placement]], bucket_bytes: int = 25 * 2**20,
               state: dict[str, torch.Tensor] | None = None, dump_dir: str | None = None,
               plan_name: str = "", replicate_fallback: bool = False,
               axis_hints: Mapping[str, Mapping[str, Any]] | None = None,
               timings: dict[str, float] | None = None) -> dict[int, RankProgram]:
    """Lower a captured step onto an N-D ``mesh``; returns one RankProgram per rank.

    Batch inputs are split on dim 0 (torch.chunk semantics) over ``batch_axis`` (None:
    replicated); parameter ``f`` takes placement ``axis_placements[axis][f]`` on each
    axis (absent: replicated). The mesh is lowered one axis at a time (see
    :func:`lowering_order`): the whole pass pipeline runs for that axis and every
    coordinate along it gets its localized graph, which the next axis lowers in turn,
    treating the collectives already there as ordinary (linear) ops. Axes of size 1 are
    skipped: they change nothing. ``axis_hints`` (an automatic plan's node strategies per axis) are
    followed where the rules agree, and parameters are then taken as given (no completion). Each
    rank's program means exactly what the
    single-process step means on the whole global batch, and its state holds its own
    shard of every parameter. ``timings`` (if given) receives the seconds spent in ``lowering``
    (passes, localization, checks) and ``codegen`` (each rank's code and state).

    Raises:
        UnsupportedOpError: an op cannot run with these placements (e.g. training-mode
            BatchNorm over a split batch).
        CollectiveMismatchError: ranks of one group would issue different collectives.
    """
    t_start = time.perf_counter()
    codegen_s = 0.0
    if batch_axis is not None:
        mesh.index(batch_axis)
    for axis in axis_placements:
        mesh.index(axis)
    order = lowering_order(mesh, batch_axis)
    axis_placements = {a: dict(pl) for a, pl in axis_placements.items()}  # completion adds to these
    graphs: dict[tuple[int, ...], torch.fx.GraphModule] = {(): copy_graph_module(captured.gm)}
    ctxs: dict[str, PassContext] = {}
    node_placements: dict[str, list[str]] = {}
    redistributions: dict[str, list[list[str]]] = {}
    for axis in order:
        ctx = PassContext(world_size=mesh.size(axis), batch_size=captured.batch_size, mesh_axis=axis,
                          bucket_bytes=bucket_bytes, shard_batch=axis == batch_axis,
                          param_placements=dict(axis_placements.get(axis, {})), replicate_fallback=replicate_fallback,
                          node_hints=dict((axis_hints or {}).get(axis, {})))
        ctxs[axis] = ctx
        if ctx.world_size == 1:
            graphs = {key + (0,): gm for key, gm in graphs.items()}
            axis_placements[axis] = {}
            continue
        completed = (dict(ctx.param_placements) if axis_hints else
                     complete_param_placements(next(iter(graphs.values())), ctx))
        axis_placements[axis] = completed
        ctx = dataclasses.replace(ctx, param_placements=completed)
        ctxs[axis] = ctx
        if axis == batch_axis and not ctx.shards_batch:
            log.warning("a global batch of %d sample cannot be split over %d ranks: every rank computes the whole "
                        "step (correct, but no faster than one rank)", captured.batch_size, ctx.world_size)
        lowered = {}
        for key, gm in graphs.items():
            sub_dump = str(Path(dump_dir) / f"{axis}{''.join(map(str, key))}") if dump_dir else None
            lowered[key] = run_passes(gm, ctx, dump_dir=sub_dump)
        first = next(iter(lowered.values()))
        k = mesh.index(axis)
        for n in first.graph.nodes:
            if n.op != "output" and gmeta.get_placements(n) is not None:
                node_placements.setdefault(n.name, ["R"] * len(mesh.names))[k] = repr(gmeta.get_placements(n)[0])
        for n in first.graph.nodes:
            for src, frm, to, _, by in gmeta.get_resharded(n, ctx.group_name):
                redistributions.setdefault(axis, []).append([n.name, src, frm, to, by])
        graphs = {key + (i,): localize_shapes(gm, ctx, i)[0] for key, gm in lowered.items()
                  for i in range(ctx.world_size)}
    plan = Plan(
        mesh=mesh.as_dict(), batch_axis=batch_axis,
        param_placements={f: [repr(axis_placements.get(a, {}).get(f, Replicate())) for a in mesh.names]
                          for f in sorted({f for pl in axis_placements.values() for f in pl})},
        graph_fingerprint=graph_fingerprint(captured.gm), name=plan_name,
        node_placements=node_placements, redistributions=redistributions,
        node_strategies={n: [h.get(n).text() if h.get(n) is not None else "" for h in
                             [(axis_hints or {}).get(a, {}) for a in mesh.names]]
                         for n in sorted({n for h in (axis_hints or {}).values() for n in h})},
    )
    if axis_hints:
        _log_hints(lowered_placements=node_placements, plan=plan, mesh=mesh)
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
        codegen_s += time.perf_counter() - t_gen
    programs = dict(sorted(programs.items()))
    check_collectives(programs)
    check_against_plan(programs, plan)
    if timings is not None:
        timings["lowering"] = timings.get("lowering", 0.0) + time.perf_counter() - t_start - codegen_s
        timings["codegen"] = timings.get("codegen", 0.0) + codegen_s
    return programs


def _log_hints(lowered_placements: Mapping[str, list[str]], plan: Plan, mesh: Mesh) -> None:
    """Log how many of the planner's output placements the lowering reproduced."""
    total = same = 0
    for n, texts in plan.node_strategies.items():
        if n not in lowered_placements:
            continue
        for k, t in enumerate(texts):
            if t and mesh.sizes[k] > 1:
                total += 1
                same += lowered_placements[n][k] == t.partition("->")[2].split(",")[0]
    log.info("planner strategies followed: %d of %d node placements as planned", same, total)


def _local_state(state: dict[str, torch.Tensor], ctxs: list[PassContext], coords: tuple[int, ...]
                 ) -> dict[str, torch.Tensor]:
    """Each rank's own shard of every sharded parameter: torch.chunk along each axis in lowering order."""
    out = {}
    for f, t in state.items():
        for ctx, i in zip(ctxs, coords):
            p = ctx.param_placements.get(f) if ctx.world_size > 1 else None
            if isinstance(p, Shard):
                s, e = chunk_interval(t.shape[p.dim], ctx.world_size, i)
                t = t.narrow(p.dim, s, e - s)
        out[f] = t.clone() if t is not state[f] else t
    return out


def lower_data_parallel(captured: CapturedGraph, world_size: int, bucket_bytes: int = 25 * 2**20,
                        state: dict[str, torch.Tensor] | None = None, dump_dir: str | None = None
                        ) -> dict[int, RankProgram]:
    """Data parallelism: the batch split over ``world_size`` ranks, parameters replicated. See :func:`lower`."""
    return lower(captured, world_size, bucket_bytes=bucket_bytes, state=state, dump_dir=dump_dir)


def compile_program(model: nn.Module, batch: tuple, loss_fn: Callable, world_size: int, plan=None,
                    bucket_bytes: int = 25 * 2**20, dump_dir: str | None = None,
                    replicate_fallback: bool = False, mesh: str | None = None,
                    captured: CapturedGraph | None = None, timings: dict[str, float] | None = None
                    ) -> dict[int, RankProgram]:
    """Capture ``model``'s training step and lower it onto ``world_size`` ranks under ``plan``.

    ``plan`` is an :class:`~adaptdist.annotations.ManualPlan` (default: data parallel) or a saved
    :class:`~adaptdist.plan.Plan`; ``mesh`` (``"dp=2,tp=2"``) sizes a multi-axis plan's axes. Each
    program holds its rank's shard of the model's current parameters and buffers. ``captured``: this
    model's step already captured (the planner's), so it is not captured twice.

    Raises:
        CaptureError, UnsupportedOpError, UsageError: see :func:`capture`, :func:`lower_mesh` and
            :func:`~adaptdist.annotations.resolve_param_placements`.
    """
    t0 = time.perf_counter()
    if captured is None:
        captured = capture(model, batch, loss_fn)
        log.info("captured %s: %d nodes in %.2f s", captured.model_name, len(captured.gm.graph.nodes),
                 time.perf_counter() - t0)
    named = dict(model.named_parameters())
    named.update(dict(model.named_buffers()))
    state = {f: named[f].detach() for f in captured.input_fqns}
    return lower_plan(captured, plan, world_size, mesh=mesh, state=state, bucket_bytes=bucket_bytes,
                      dump_dir=dump_dir, replicate_fallback=replicate_fallback, timings=timings)


def lower_plan(captured: CapturedGraph, plan: Any, world_size: int, *, mesh: str | None = None,
               state: dict[str, torch.Tensor] | None = None, bucket_bytes: int = 25 * 2**20,
               dump_dir: str | None = None, replicate_fallback: bool = False,
               timings: dict[str, float] | None = None) -> dict[int, RankProgram]:
    """Lower a captured step under ``plan`` (a :class:`~adaptdist.annotations.ManualPlan`, default data
    parallel, or a saved/automatic :class:`~adaptdist.plan.Plan`) onto ``world_size`` ranks; ``mesh``
    (``"dp=2,tp=2"``) sizes a manual plan's axes; ``state`` (full tensors by fqn) is split into each
    rank's program. An automatic plan's node strategies are followed where the rules agree; where their
    combination fails, its parameter placements are lowered with the rules' activation placements.

    Raises:
        UnsupportedOpError, UsageError: see :func:`lower_mesh` and
            :func:`~adaptdist.annotations.resolve_param_placements`; a plan for another graph or size.
    """
    from ..annotations import ManualPlan

    state = state or {}
    plan = plan if plan is not None else ManualPlan.parse("dp")
    if isinstance(plan, Plan):
        plan.check_graph(captured.gm, f"plan {plan.name!r}")
        m = plan.mesh_spec
        if m.world_size != world_size:
            raise UsageError(f"plan {plan.name!r} is for mesh {m} ({m.world_size} ranks), this job has {world_size}; "
                             f"run it on {m.world_size} ranks (--nproc {m.world_size}, or a cluster of that size; without "
                             "--nproc and --cluster a saved plan brings its mesh)")
        if mesh and Mesh.parse(mesh) != m:
            raise UsageError(f"--mesh {mesh} differs from the mesh {m} of plan {plan.name!r}; drop --mesh")
        kwargs = dict(batch_axis=plan.batch_axis, axis_placements=plan.axis_placements(), bucket_bytes=bucket_bytes,
                      state=state, dump_dir=dump_dir, plan_name=plan.name, replicate_fallback=replicate_fallback,
                      timings=timings)
        if not plan.node_strategies:
            return lower_mesh(captured, m, **kwargs)
        try:
            return lower_mesh(captured, m, axis_hints=plan.axis_hints(), **kwargs)
        except UnsupportedOpError as e:
            # the rules accepted each hint alone, but not their combination somewhere: keep the planner's
            # parameter placements and let the rules place the activations
            log.warning("the lowering could not follow the planner's node strategies (%s); lowering the plan's "
                        "parameter placements with the rules' own activation placements instead", e)
            return lower_mesh(captured, m, **kwargs)
    m = plan.mesh(world_size, mesh)
    shapes = {gmeta.get_fqn(p): tuple(p.meta["val"].shape) for p in captured.gm.graph.find_nodes(op="placeholder")
              if gmeta.get_role(p) != "batch"}
    placements = plan.axis_placements(shapes, set(captured.param_fqns), {a: m.size(a) for a in m.names})
    return lower_mesh(captured, m, batch_axis=plan.batch_axis, axis_placements=placements,
                      bucket_bytes=bucket_bytes, state=state, dump_dir=dump_dir, plan_name=plan.name,
                      replicate_fallback=replicate_fallback, timings=timings)


def compile_data_parallel(model: nn.Module, batch: tuple, loss_fn: Callable, world_size: int,
                          bucket_bytes: int = 25 * 2**20, dump_dir: str | None = None) -> dict[int, RankProgram]:
    """Data parallelism: :func:`compile_program` with the batch split and parameters replicated."""
    return compile_program(model, batch, loss_fn, world_size, None, bucket_bytes, dump_dir)
