"""Checkpoint helpers: a rank's local shard as a global DTensor for torch.distributed.checkpoint."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..placement import Shard, parse_placement
from ..program import RankProgram


def as_global(t: torch.Tensor, fqn: str, program: RankProgram) -> torch.Tensor:
    """``t`` (this rank's shard of state ``fqn``) as a DTensor over the program's 1-D mesh, or ``t``
    itself when the state is replicated. Uneven (torch.chunk) shards are described by the global shape.
    """
    text = program.state_placements.get(fqn)
    if text is None:
        return t
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as DShard

    p = parse_placement(text)
    assert isinstance(p, Shard), text
    (axis,) = program.mesh
    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())), mesh_dim_names=(axis,))
    shape = torch.Size(program.global_shapes[fqn])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t, mesh, [DShard(p.dim)], run_check=False, shape=shape, stride=stride)
