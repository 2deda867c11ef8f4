"""The layout of a rank program's state: which rows of each tensor a rank holds, and stacked experts' names.

Data-model helpers shared by the compiler (artifacts, the backend) and the runtime (checkpoints, weights).
"""

from __future__ import annotations

from typing import Any

import torch

from .placement import Shard, chunk_interval, parse_placement


def shard_layout(program: Any) -> dict[str, dict[str, Any]]:
    """Per state tensor of ``program``: global shape, placement per mesh axis, and the ``[start, stop)`` of
    every dim this rank holds (torch.chunk along the axes in lowering order)."""
    from .mesh import Mesh, lowering_order

    mesh = Mesh(tuple(program.mesh.items()))
    batch_axis = program.plan.batch_axis if program.plan is not None else None
    order = lowering_order(mesh, batch_axis)
    coords = dict(zip(mesh.names, mesh.coords(program.rank)))
    out = {}
    for f in program.input_fqns:
        shape = list(program.global_shapes[f] if f in program.global_shapes else program.state[f].shape)
        pls = program.state_placements.get(f, ["R"] * len(mesh.names))
        ranges = [[0, n] for n in shape]
        by_axis = dict(zip(mesh.names, pls))
        for a in order:
            p = parse_placement(by_axis[a])
            if isinstance(p, Shard) and mesh.size(a) > 1:
                lo, hi = ranges[p.dim]
                s, e = chunk_interval(hi - lo, mesh.size(a), coords[a])
                ranges[p.dim] = [lo + s, lo + e]
        out[f] = {"global_shape": shape, "placements": dict(zip(mesh.names, pls)), "ranges": ranges}
    return out


def unstack_state(state: dict[str, torch.Tensor], stacked: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """``state`` with every full stacked value split into its experts, under the user's names (in place of the
    stacked name); other entries unchanged."""
    out = {}
    for k, v in state.items():
        if k in stacked:
            out.update(zip(stacked[k], v.unbind(0)))
        else:
            out[k] = v
    return out
