"""Completion: infer the placements of parameters the user did not annotate, from their uses.

Propagation runs forward from the annotations; an unannotated parameter starts
replicated. Its uses then say in which placement each consumes it (a bias added to a
column-parallel output asks for ``Shard(d)``). Completion stores each unannotated
parameter in the placement whose redistributions to all its uses cost least by DTensor's
own estimate (``redistribute_cost``), shards first on a tie (same communication, less
memory), and propagates again, sweeping until no placement changes (a fixed point; each
sweep only turns replicated parameters into shards, so it ends). A parameter some use
needs whole stays replicated when gathering it would cost more.

Before/after (annotations ``fc1.weight: S(0)``, ``fc2.weight: S(1)``)::

    add = aten.add.Tensor(mm, fc1_bias)     # mm: f32[7, 24] S(1), fc1_bias: f32[24] R -> needs S(0)
    # completion: fc1.bias -> S(0); then add needs nothing and fc1.bias is stored sharded
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.fx

from .. import _torch_compat as compat
from .. import graph_meta as gmeta
from ..placement import Placement, Replicate, Shard
from .context import PassContext
from .decompose_addmm import decompose_addmm
from .infra import copy_graph_module
from .propagate_placements import propagate_placements
from .sharding_rules import tensor_args

log = logging.getLogger("adaptdist.passes")
MAX_SWEEPS = 8


def _uses(ph: torch.fx.Node) -> list[Placement]:
    """The placement each use of ``ph`` consumes it in: what the use's redistribution asks for,
    else its current placement."""
    wants = []
    for user in ph.users:
        needs = gmeta.get_redistribute(user)
        for path, a in tensor_args(user):
            if a is ph:
                wants.append(needs[path][0] if path in needs else gmeta.get_placements(ph)[0])
    return wants


def _cheapest_storage(ph: torch.fx.Node, world_size: int) -> Placement:
    """Among Replicate and the shards ``ph``'s uses ask for, the placement to store it in whose
    redistributions to every use cost least by DTensor's estimate; ties go to shards (same
    communication, less memory), lower dim first, then Replicate: a fixed order."""
    wants = _uses(ph)
    options = sorted({w for w in wants if isinstance(w, Shard)}, key=lambda p: p.dim) + [Replicate()]
    v = ph.meta["val"]

    def cost(src: Placement) -> float:
        return sum(0.0 if src == w else compat.dtensor_redistribute_cost(
            compat.dtensor_placement(src), compat.dtensor_placement(w), tuple(v.shape), v.dtype, world_size)
            for w in wants)

    return min(options, key=lambda p: (cost(p), options.index(p)))


def complete_param_placements(gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, Placement]:
    """``ctx.param_placements`` plus the placements inferred for unannotated parameters (see the
    module docstring). ``gm`` is not changed; with one rank nothing is inferred."""
    placements = dict(ctx.param_placements)
    if ctx.axis_size == 1 or not any(isinstance(p, Shard) for p in placements.values()):
        return {f: p for f, p in placements.items() if not isinstance(p, Replicate)}
    for _ in range(MAX_SWEEPS):
        c = dataclasses.replace(ctx, param_placements=placements)
        g, _ = decompose_addmm(copy_graph_module(gm), c)
        propagate_placements(g, c)
        inferred = {}
        for ph in g.graph.find_nodes(op="placeholder"):
            fqn = gmeta.get_fqn(ph)
            if gmeta.get_role(ph) == "param" and fqn not in placements:
                best = _cheapest_storage(ph, ctx.axis_size)
                if isinstance(best, Shard):
                    inferred[fqn] = best
        if not inferred:
            break
        log.info("completion on mesh axis %s: %s", ctx.mesh_axis,
                 ", ".join(f"{f} -> {p!r}" for f, p in sorted(inferred.items())))
        placements.update(inferred)
    return {f: p for f, p in placements.items() if not isinstance(p, Replicate)}
