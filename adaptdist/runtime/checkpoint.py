"""Checkpoint helpers: a rank's local shard as a global DTensor for torch.distributed.checkpoint."""

from __future__ import annotations

import torch

from ..errors import UsageError
from ..placement import Shard, parse_placement
from ..program import RankProgram


def as_global(t: torch.Tensor, fqn: str, program: RankProgram, device_mesh) -> torch.Tensor:
    """``t`` (this rank's shard of state ``fqn``) as a DTensor over ``device_mesh`` (torch's
    DeviceMesh for the program's mesh), or ``t`` itself when the state is replicated. Uneven
    (torch.chunk) shards are described by the global shape.

    Raises:
        UsageError: one tensor dim is sharded on two mesh axes; DTensor orders such nested
            shards by mesh axis, adaptdist by lowering order, so they are not saved as one DTensor.
    """
    texts = program.state_placements.get(fqn)
    if texts is None:
        return t
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as DShard

    placements = [parse_placement(x) for x in texts]
    dims = [p.dim for p in placements if isinstance(p, Shard)]
    if len(dims) != len(set(dims)):
        raise UsageError(f"state {fqn!r} shards one dim on two mesh axes ({texts}); its checkpoint would need "
                         "DTensor's strided sharding, which adaptdist does not write yet: shard another dim")
    shape = torch.Size(program.global_shapes[fqn])
    stride = torch.empty(shape, device="meta").stride()
    dplacements = [DShard(p.dim) if isinstance(p, Shard) else Replicate() for p in placements]
    return DTensor.from_local(t, device_mesh, dplacements, run_check=False, shape=shape, stride=stride)
