"""Checkpoint helpers: a rank's local shard as a global DTensor for torch.distributed.checkpoint.

A DTensor chunks a tensor dim sharded over several mesh dims from left to right (torch.chunk
at each level: ``compute_local_shape_and_global_offset`` in ``torch/distributed/tensor/_utils.py``);
adaptdist chunks it over its mesh axes in lowering order (model-parallel axes first, the batch axis
last: :func:`~adaptdist.mesh.lowering_order`). Where the two orders differ for such a
dim (``S(0)`` on both axes of ``dp=2,tp=2`` with ``dp`` the batch axis: rows chunked by ``tp``, then by
``dp``), the tensor is described over a DeviceMesh of the same ranks whose dims are in lowering order
(:func:`ordered_device_mesh`), so every rank's shard gets its own global offset and size, uneven and
empty shards included::

    fc1.weight [7, 12], S(0) on dp and on tp, dp=2,tp=2 (batch axis dp): tp chunks 7 rows as
    [0, 4) | [4, 7), dp each of those as [0, 2) [2, 4) | [4, 6) [6, 7)
    rank (dp=1, tp=0) holds rows [2, 4): a DTensor over mesh (tp, dp) with (Shard(0), Shard(0))
"""

from __future__ import annotations

import torch

from ..errors import InternalError
from ..placement import Shard, parse_placement
from ..program import RankProgram


def shard_order(program: RankProgram) -> list[str]:
    """The program's mesh axes in the order a tensor dim sharded on several of them is chunked
    (lowering order: the batch axis last)."""
    from ..mesh import Mesh, lowering_order

    batch_axis = program.plan.batch_axis if program.plan is not None else None
    return lowering_order(Mesh(tuple(program.mesh.items())), batch_axis)


def _out_of_mesh_order(texts: list[str], program: RankProgram) -> bool:
    """Whether, for state placements ``texts`` (one per mesh axis, mesh order), some tensor dim is
    sharded on two axes of size > 1 that the mesh order and the lowering order take in different orders."""
    names = list(program.mesh)
    sharding: dict[int, list[str]] = {}
    for a, text in zip(names, texts):
        p = parse_placement(text)
        if isinstance(p, Shard) and program.mesh[a] > 1:
            sharding.setdefault(p.dim, []).append(a)  # in mesh order
    order = shard_order(program)
    return any(axes != sorted(axes, key=order.index) for axes in sharding.values())


def needs_ordered_mesh(program: RankProgram) -> bool:
    """Whether some state of ``program`` must be saved over the lowering-order mesh (see the module docstring)."""
    return any(_out_of_mesh_order(texts, program) for texts in program.state_placements.values())


def ordered_device_mesh(device_mesh, program: RankProgram):
    """torch's DeviceMesh over the ranks of ``device_mesh`` (the program's mesh, dims in mesh order) with
    its dims in lowering order, or None when no state needs it (:func:`needs_ordered_mesh`).

    Building it creates the new mesh's process groups: call it on every rank (every rank holds the same
    placements, so all of them decide alike).
    """
    if not needs_ordered_mesh(program):
        return None
    from torch.distributed.device_mesh import DeviceMesh

    names, order = list(program.mesh), shard_order(program)
    ranks = device_mesh.mesh.permute([names.index(a) for a in order])
    return DeviceMesh(device_mesh.device_type, ranks, mesh_dim_names=tuple(order))


def gather_full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of ``t`` (a DTensor from :func:`as_global`, collective over its mesh) as a plain
    tensor on every rank; ``t`` itself when it is not a DTensor. Gathers one mesh axis at a time, innermost
    first (``[S(0), S(0)] -> [S(0), R] -> [R, R]``): DTensor's ``full_tensor()`` of a dim sharded on two axes
    plans both all_gathers in one redistribute and logs (once per process, on rank 0 of a 2-D mesh) that "2
    sequential all_gather operations ... may give inconsistent results between ranks due to different reduction
    orders". That warning is about reductions; an all_gather copies bytes and reduces nothing, so the result was
    exact either way: gathering axis by axis gives the same tensor with the same collectives and no warning
    (torch/distributed/tensor/_redistribute.py, ``_warn_flatten_optimization_not_possible``)."""
    if not hasattr(t, "full_tensor"):
        return t
    from torch.distributed.tensor import Replicate

    placements = list(t.placements)
    for k in reversed(range(len(placements))):
        if not isinstance(placements[k], Replicate):
            placements[k] = Replicate()
            t = t.redistribute(t.device_mesh, placements)
    return t.to_local()


def as_global(t: torch.Tensor, fqn: str, program: RankProgram, device_mesh, ordered_mesh=None) -> torch.Tensor:
    """``t`` (this rank's shard of state ``fqn``) as a DTensor over ``device_mesh`` (torch's
    DeviceMesh for the program's mesh), or ``t`` itself when the state is replicated. Uneven
    (torch.chunk) shards are described by the global shape. A state that shards one dim on two
    axes in an order other than the mesh's is described over ``ordered_mesh`` (the same ranks, dims
    in lowering order: :func:`ordered_device_mesh`), with its placements in that order.

    Raises:
        InternalError: ``fqn`` needs ``ordered_mesh`` and the caller passed none (a bug in the caller).
    """
    texts = program.state_placements.get(fqn)
    if texts is None:
        return t
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as DShard

    by_axis = dict(zip(program.mesh, texts))
    mesh, axes = device_mesh, list(program.mesh)
    if _out_of_mesh_order(texts, program):
        if ordered_mesh is None:
            raise InternalError(f"state {fqn!r} ({texts} on mesh {dict(program.mesh)}) shards one dim on two axes "
                                "in lowering order, not mesh order: pass ordered_device_mesh(device_mesh, program)")
        mesh, axes = ordered_mesh, shard_order(program)
    placements = [parse_placement(by_axis[a]) for a in axes]
    shape = torch.Size(program.global_shapes[fqn])
    stride = torch.empty(shape, device="meta").stride()
    dplacements = [DShard(p.dim) if isinstance(p, Shard) else Replicate() for p in placements]
    return DTensor.from_local(t, mesh, dplacements, run_check=False, shape=shape, stride=stride)
