"""Gradient-norm clipping over sharded gradients: the global norm across all shards, as eager computes it."""

from __future__ import annotations

import torch

from .. import _torch_compat as compat
from ..program import RankProgram


def global_grad_norm(grads: dict[str, torch.Tensor], program: RankProgram) -> torch.Tensor:
    """The 2-norm of all gradients of the whole model, from this rank's shards (float64 scalar).

    A gradient sharded along some mesh axes contributes its squares summed over those axes'
    groups; a replicated one counts once (every rank of the axis holds the same values).
    Gradients are grouped by the set of axes they are sharded on, one all_reduce per axis per
    group, in a fixed order, so every rank issues the same collectives. Must be called on every
    rank, with the process groups of ``program.group_names`` registered.
    """
    by_axes: dict[tuple[str, ...], torch.Tensor] = {}
    for f, g in grads.items():
        pls = program.state_placements.get(f) or []
        axes = tuple(a for a, p in zip(program.mesh, pls) if p.startswith("S("))
        sq = g.detach().double().pow(2).sum()
        by_axes[axes] = by_axes[axes] + sq if axes in by_axes else sq
    all_reduce, wait = compat.functional_all_reduce_op(), compat.functional_wait_op()
    total = torch.zeros((), dtype=torch.float64)
    for axes in sorted(by_axes):
        sq = by_axes[axes]
        for a in axes:
            sq = wait(all_reduce(sq, "sum", program.group_names[a]))
        total = total + sq
    return total.sqrt()


def clip_grad_norm_(grads: dict[str, torch.Tensor], program: RankProgram, max_norm: float) -> float:
    """Scale ``grads`` in place so that their global norm is at most ``max_norm``; returns the norm
    before clipping. Same rule as ``torch.nn.utils.clip_grad_norm_``: every gradient is multiplied
    by ``min(1, max_norm / (norm + 1e-6))``."""
    norm = global_grad_norm(grads, program)
    coef = min(1.0, max_norm / (float(norm) + 1e-6))
    if coef < 1.0:
        for g in grads.values():
            g.mul_(coef)
    return float(norm)
