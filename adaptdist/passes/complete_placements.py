"""Completion: infer the placements of parameters the user did not annotate, from their uses.

Propagation runs forward from the annotations; an unannotated parameter starts
replicated. When every edge that redistributes it asks for the same ``Shard(d)``
(a bias added to a column-parallel output, a norm weight applied to a sharded
activation), storing it whole only to slice it on every use is waste: completion
places it ``Shard(d)`` itself and propagates again, sweeping back and forth until
no placement changes (a fixed point; each sweep only turns replicated parameters
into shards, so it ends). Parameters whose uses disagree, or that some use needs
whole, stay replicated.

Before/after (annotations ``fc1.weight: S(0)``, ``fc2.weight: S(1)``)::

    add = aten.add.Tensor(mm, fc1_bias)     # mm: f32[7, 24] S(1), fc1_bias: f32[24] R -> needs S(0)
    # completion: fc1.bias -> S(0); then add needs nothing and fc1.bias is stored sharded
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.fx

from .. import graph_meta as gmeta
from ..placement import Placement, Replicate, Shard
from .context import PassContext
from .decompose_addmm import decompose_addmm
from .localize_shapes import copy_graph_module
from .propagate_placements import propagate_placements

log = logging.getLogger("adaptdist.passes")
MAX_SWEEPS = 8


def _wanted_shard(ph: torch.fx.Node) -> Shard | None:
    """The one Shard every redistributing use asks ``ph`` for, if all agree and some do."""
    wanted = set()
    for user in ph.users:
        for path, layout in gmeta.get_redistribute(user).items():
            arg = user.args[path[0]] if len(path) == 1 else user.args[path[0]][path[1]]
            if arg is ph:
                wanted.add(layout[0])
    if len(wanted) == 1:
        (p,) = wanted
        return p if isinstance(p, Shard) else None
    return None


def complete_param_placements(gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Placement]:
    """``ctx.param_placements`` plus the placements inferred for unannotated parameters (see the
    module docstring). ``gm`` is not changed; with one rank nothing is inferred."""
    placements = dict(ctx.param_placements)
    if ctx.world_size == 1 or not any(isinstance(p, Shard) for p in placements.values()):
        return {f: p for f, p in placements.items() if not isinstance(p, Replicate)}
    for _ in range(MAX_SWEEPS):
        c = dataclasses.replace(ctx, param_placements=placements)
        g, _ = decompose_addmm(copy_graph_module(gm), c)
        propagate_placements(g, c)
        inferred = {}
        for ph in g.graph.find_nodes(op="placeholder"):
            fqn = gmeta.get_fqn(ph)
            if gmeta.get_role(ph) == "param" and fqn not in placements:
                want = _wanted_shard(ph)
                if want is not None:
                    inferred[fqn] = want
        if not inferred:
            break
        log.info("completion on mesh axis %s: %s", ctx.mesh_axis,
                 ", ".join(f"{f} -> {p!r}" for f, p in sorted(inferred.items())))
        placements.update(inferred)
    return {f: p for f, p in placements.items() if not isinstance(p, Replicate)}
