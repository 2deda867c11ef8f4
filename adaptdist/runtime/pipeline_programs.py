"""The parts of a run that differ for pipeline programs: the checkpoint view, full weights, the log line.

Pipeline programs on disk are :mod:`adaptdist.stage_program_io`'s (JSON, generated source and safetensors, nothing
pickled).

Checkpoints: each rank saves its own state under its fqns (:class:`CheckpointView` makes a
:class:`~adaptdist.stage_program.PipelineRankProgram` look like a RankProgram to :mod:`.train_state`, with every
rank's fqns and global shapes gathered once), so a pipeline checkpoint holds every tensor once (a tied weight's
identical copies deduplicated) under the same names as any other plan's and loads under another plan, resharded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..stage_program import PipelineRankProgram


def describe_pipeline(program: PipelineRankProgram) -> str:
    """``plan 'pp' on mesh pp=2 (2 ranks; schedule 1f1b, 4 microbatches)``: one line for logs."""
    plan = program.plan
    mesh = ",".join(f"{a}={n}" for a, n in (plan.mesh.items() if plan is not None else ()))
    name = plan.name if plan is not None else "?"
    return (f"plan {name!r} on mesh {mesh} ({program.world_size} ranks; schedule {program.schedule}, "
            f"{program.num_microbatches} microbatches)")


@dataclass(frozen=True)
class CheckpointView:
    """What :mod:`.train_state` reads of a RankProgram, for a pipeline rank: its own state names as
    ``input_fqns``, every rank's state (as meta tensors of the global shapes) as ``state`` so that
    ``state_shapes`` covers the whole model, no mesh and no placements (each tensor is saved whole, by the ranks that
    hold it). ``all_param_fqns``: every rank's trainable parameters (a checkpoint's optimizer state for a
    parameter another stage trains is not "unknown")."""

    input_fqns: tuple[str, ...]
    state: Mapping[str, torch.Tensor]
    global_shapes: Mapping[str, tuple[int, ...]]
    param_fqns: tuple[str, ...]
    all_param_fqns: tuple[str, ...]
    plan: Any = None
    description: str = ""
    mesh: Mapping[str, int] = field(default_factory=dict)
    state_placements: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    transports: Mapping[str, str] = field(default_factory=dict)  # PipelineRankProgram.transports(), for summary.json


def checkpoint_view(program: PipelineRankProgram) -> CheckpointView:
    """(Collective: one all_gather_object) the :class:`CheckpointView` of this rank's program. State sharded inside a
    stage (tensor parallelism) keeps its placements over the stage's sub-mesh (:func:`stage_device_mesh`)."""
    mine = {f: tuple(program.global_shapes.get(f, tuple(t.shape))) for f, t in program.state.items()}
    dtypes = {f: str(t.dtype) for f, t in program.state.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, dtypes, tuple(program.param_fqns)))
    shapes: dict[str, tuple[int, ...]] = {}
    params: set[str] = set()
    meta: dict[str, torch.Tensor] = {}
    for sh, dt, ps in everyone:
        shapes.update(sh)
        params.update(ps)
        for f, s in sh.items():
            meta[f] = torch.empty(s, dtype=getattr(torch, dt[f].split(".")[-1]), device="meta")
    sharded = bool(program.state_placements)
    return CheckpointView(input_fqns=tuple(sorted(program.state)), state=meta, global_shapes=shapes,
                          param_fqns=tuple(program.param_fqns), all_param_fqns=tuple(sorted(params)),
                          plan=program.plan, mesh=dict(program.stages[0].submesh) if sharded else {},
                          state_placements=dict(program.state_placements))


def stage_device_mesh(program: PipelineRankProgram) -> Any:
    """torch's DeviceMesh over this rank's stage sub-mesh (its ranks, ``stage_ranks`` in sub-mesh order), without
    process groups (enough for torch.distributed.checkpoint to place the shards), or None when no state is sharded
    inside the stage."""
    if not program.state_placements:
        return None
    from .. import _torch_compat as compat

    sub = dict(program.stages[0].submesh)
    ranks = torch.tensor(program.stage_ranks[program.stages[0].stage]).reshape(tuple(sub.values()))
    return compat.device_mesh_without_groups("cpu", ranks, tuple(sub))


def _box(program: PipelineRankProgram, fqn: str, shape: tuple[int, ...]) -> list[list[int]]:
    """``[start, stop)`` per dim of this rank's shard of state ``fqn`` (chunked over the sub-mesh's axes in lowering
    order, as the lowering and ``compiler.artifacts.shard_layout`` do)."""
    from ..mesh import Mesh, lowering_order
    from ..placement import Shard, chunk_interval, parse_placement

    ranges = [[0, n] for n in shape]
    texts = program.state_placements.get(fqn)
    if not texts:
        return ranges
    sub = dict(program.stages[0].submesh)
    coords = dict(program.stages[0].coords)
    by_axis = dict(zip(sub, texts))
    batch_axis = program.plan.batch_axis if program.plan is not None else None
    for a in lowering_order(Mesh(tuple(sub.items())), batch_axis):
        p = parse_placement(by_axis[a])
        if isinstance(p, Shard) and sub[a] > 1:
            lo, hi = ranges[p.dim]
            b, e = chunk_interval(hi - lo, sub[a], coords[a])
            ranges[p.dim] = [lo + b, lo + e]
    return ranges


def norm_owned_params(program: PipelineRankProgram) -> frozenset[str]:
    """(Collective: one all_gather_object over every rank) the parameters whose gradient this rank counts in the
    global gradient norm (:func:`~.grad_clip.shard_owners` over every rank's shards and their boxes)."""
    from .grad_clip import shard_owners

    mine = [(f, _box(program, f, tuple(program.global_shapes.get(f, tuple(program.state[f].shape)))))
            for f in program.param_fqns]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return frozenset(shard_owners(dict(enumerate(everyone)))[program.rank])


def gather_full_weights(program: PipelineRankProgram, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """(Collective) every state tensor of the model, whole, on rank 0 (None elsewhere): each rank's own tensors, or
    shards with their boxes, gathered and put together (a tied weight's copies are identical; the first is kept)."""
    own = {}
    for f, t in state.items():
        shape = tuple(program.global_shapes.get(f, tuple(t.shape)))
        own[f] = (t.detach().contiguous(), shape, _box(program, f, shape))
    parts: list[Any] = [None] * dist.get_world_size() if program.rank == 0 else None
    dist.gather_object(own, parts, dst=0)
    if program.rank != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    filled: dict[str, set] = {}
    for part in parts:
        for f, (t, shape, box) in part.items():
            if tuple(t.shape) == shape:
                full.setdefault(f, t)
                continue
            if f not in full:
                full[f] = torch.empty(shape, dtype=t.dtype)
                filled[f] = set()
            key = tuple(map(tuple, box))
            if key not in filled.get(f, {key}):
                full[f][tuple(slice(lo, hi) for lo, hi in box)] = t
                filled[f].add(key)
    return full
