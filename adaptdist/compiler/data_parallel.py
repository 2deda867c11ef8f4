"""The data-parallel lowering pipeline: captured joint graph -> one RankProgram per rank."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.fx
import torch.nn as nn

from .. import graph_meta as gmeta
from ..passes.bucket_grad_allreduce import bucket_grad_allreduce
from ..passes.bucket_param_allgather import bucket_param_allgather
from ..passes.combine_partial_sums import combine_partial_sums
from ..passes.bucket_grad_reduce_scatter import bucket_grad_reduce_scatter
from ..passes.decompose_addmm import decompose_addmm
from ..passes.context import PassContext
from ..passes.globalize_reductions import globalize_reductions
from ..passes.insert_redistributes import insert_redistributes
from ..passes.localize_shapes import copy_graph_module, localize_shapes
from ..passes.propagate_placements import propagate_placements
from ..passes.regather_in_backward import regather_in_backward
from ..passes.relax_views import relax_views
from ..placement import Placement, Shard, chunk_interval
from ..errors import AdaptdistError, InternalError, UsageError
from ..plan import Plan, graph_fingerprint
from ..program import RankProgram
from .capture import CapturedGraph, capture
from .codegen import make_rank_program
from .consistency import check_collectives

log = logging.getLogger("adaptdist.compiler")

Pass = Callable[[torch.fx.GraphModule, PassContext], tuple[torch.fx.GraphModule, bool]]

DP_PASSES: tuple[Pass, ...] = (
    decompose_addmm,
    propagate_placements,
    combine_partial_sums,
    globalize_reductions,
    propagate_placements,
    insert_redistributes,
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
    """Lower a captured step onto a 1-D mesh of ``world_size`` ranks.

    Batch inputs are split on dim 0 (torch.chunk semantics) when ``shard_batch``;
    parameters take ``param_placements`` (by fqn; absent ones are replicated). Each
    rank's program means exactly what the single-process step means on the whole
    global batch, and each rank's state holds its own shard of every parameter.

    Raises:
        UnsupportedOpError: an op cannot run with these placements (e.g. training-mode
            BatchNorm over a split batch).
    """
    ctx = PassContext(world_size=world_size, batch_size=captured.batch_size, mesh_axis=mesh_axis,
                      bucket_bytes=bucket_bytes, shard_batch=shard_batch, param_placements=dict(param_placements or {}),
                      replicate_fallback=replicate_fallback)
    if world_size > 1 and shard_batch and not ctx.shards_batch:
        log.warning("a global batch of %d sample cannot be split over %d ranks: every rank computes the whole "
                    "step (correct, but no faster than one rank)", captured.batch_size, world_size)
    gm = run_passes(copy_graph_module(captured.gm), ctx, dump_dir=dump_dir)
    plan = Plan(
        mesh={mesh_axis: world_size}, batch_axis=mesh_axis if shard_batch else None,
        param_placements={f: [repr(p)] for f, p in ctx.param_placements.items()},
        graph_fingerprint=graph_fingerprint(captured.gm), name=plan_name,
        node_placements={n.name: repr(gmeta.get_placements(n)[0]) for n in gm.graph.nodes
                         if n.op != "output" and gmeta.get_placements(n) is not None},
    )
    input_fqns = captured.input_fqns
    global_shapes = {gmeta.get_fqn(ph): list(ph.meta["val"].shape)
                     for ph in captured.gm.graph.find_nodes(op="placeholder") if gmeta.get_role(ph) != "batch"}
    programs = {}
    for r in range(world_size):
        local, _ = localize_shapes(gm, ctx, r)
        programs[r] = make_rank_program(
            local, ctx, r, input_fqns, captured.param_fqns, captured.num_batch_inputs,
            _local_state(state or {}, ctx, r), captured.tied, global_shapes
        )
        programs[r].plan = plan
    check_collectives(programs)
    return programs


def _local_state(state: dict[str, torch.Tensor], ctx: PassContext, rank: int) -> dict[str, torch.Tensor]:
    """Each rank's own shard of every sharded parameter (torch.chunk semantics)."""
    out = {}
    for f, t in state.items():
        p = ctx.param_placements.get(f) if ctx.world_size > 1 else None
        if isinstance(p, Shard):
            s, e = chunk_interval(t.shape[p.dim], ctx.world_size, rank)
            t = t.narrow(p.dim, s, e - s).clone()
        out[f] = t
    return out


def lower_data_parallel(captured: CapturedGraph, world_size: int, bucket_bytes: int = 25 * 2**20,
                        state: dict[str, torch.Tensor] | None = None, dump_dir: str | None = None
                        ) -> dict[int, RankProgram]:
    """Data parallelism: the batch split over ``world_size`` ranks, parameters replicated. See :func:`lower`."""
    return lower(captured, world_size, bucket_bytes=bucket_bytes, state=state, dump_dir=dump_dir)


def compile_program(model: nn.Module, batch: tuple, loss_fn: Callable, world_size: int, plan=None,
                    bucket_bytes: int = 25 * 2**20, dump_dir: str | None = None,
                    replicate_fallback: bool = False) -> dict[int, RankProgram]:
    """Capture ``model``'s training step and lower it onto ``world_size`` ranks under ``plan``.

    ``plan`` is an :class:`~adaptdist.annotations.ManualPlan` (default: data parallel). Each
    program holds its rank's shard of the model's current parameters and buffers.

    Raises:
        CaptureError, UnsupportedOpError, UsageError: see :func:`capture`, :func:`lower` and
            :func:`~adaptdist.annotations.resolve_param_placements`.
    """
    t0 = time.perf_counter()
    captured = capture(model, batch, loss_fn)
    log.info("captured %s: %d nodes in %.2f s", captured.model_name, len(captured.gm.graph.nodes),
             time.perf_counter() - t0)
    named = dict(model.named_parameters())
    named.update(dict(model.named_buffers()))
    state = {f: named[f].detach() for f in captured.input_fqns}
    if plan is None:
        return lower(captured, world_size, bucket_bytes=bucket_bytes, state=state, dump_dir=dump_dir, plan_name="dp",
                     replicate_fallback=replicate_fallback)
    if isinstance(plan, Plan):
        plan.check_graph(captured.gm, f"plan {plan.name!r}")
        (axis, size), = plan.mesh.items()
        if size != world_size:
            raise UsageError(f"plan {plan.name!r} is for {size} ranks on mesh axis {axis!r}, this job has {world_size}")
        return lower(captured, world_size, mesh_axis=axis, shard_batch=plan.batch_axis is not None,
                     param_placements=plan.placements_on_axis(0), bucket_bytes=bucket_bytes, state=state,
                     dump_dir=dump_dir, plan_name=plan.name, replicate_fallback=replicate_fallback)
    placements = plan.placements({f: tuple(t.shape) for f, t in state.items()}, set(captured.param_fqns))
    return lower(captured, world_size, mesh_axis=plan.mesh_axis, shard_batch=plan.shard_batch,
                 param_placements=placements, bucket_bytes=bucket_bytes, state=state, dump_dir=dump_dir,
                 plan_name=plan.name, replicate_fallback=replicate_fallback)


def compile_data_parallel(model: nn.Module, batch: tuple, loss_fn: Callable, world_size: int,
                          bucket_bytes: int = 25 * 2**20, dump_dir: str | None = None) -> dict[int, RankProgram]:
    """Data parallelism: :func:`compile_program` with the batch split and parameters replicated."""
    return compile_program(model, batch, loss_fn, world_size, None, bucket_bytes, dump_dir)
