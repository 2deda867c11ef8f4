"""Gradient-norm clipping over sharded gradients: the global norm across all shards, as eager computes it.

Rank programs (:func:`clip_grad_norm_`) sum squares over the mesh axes a gradient is sharded on. Pipeline programs
(:func:`shard_owners`, :func:`owned_squares`, :func:`scale_grads_`; the executor adds one world all-reduce) count
every distinct shard once: of the ranks holding the same shard (data-parallel peers of a stage, tensor-parallel
ranks holding a replicated parameter, the stages holding a tied weight, whose copies are equal after the gradient
all-reduce) the lowest rank counts it.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

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
    norm = float(global_grad_norm(grads, program))
    scale_grads_(grads.values(), norm, max_norm)
    return norm


def scale_grads_(grads: Iterable[torch.Tensor], norm: float, max_norm: float) -> None:
    """Multiply ``grads`` in place by ``min(1, max_norm / (norm + 1e-6))``: ``torch.nn.utils.clip_grad_norm_``'s
    rule (torch/nn/utils/clip_grad.py), ``norm`` the global 2-norm of all gradients."""
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)


def shard_owners(holdings: Mapping[int, Iterable[tuple[str, Any]]]) -> dict[int, set[str]]:
    """rank -> the parameters whose gradient it counts in the global norm.

    Args:
        holdings: rank -> ``(fqn, box)`` of each parameter shard it holds (``box``: ``[[start, stop), ...]`` per dim
            of the global tensor, :func:`adaptdist.runtime.pipeline_programs._box`).

    Returns:
        For each rank, the fqns of the shards it is the lowest holder of (every distinct shard counted once).
    """
    first: dict[tuple, int] = {}
    for r in sorted(holdings):
        for f, box in holdings[r]:
            first.setdefault((f, tuple(map(tuple, box))), r)
    out: dict[int, set[str]] = {r: set() for r in holdings}
    for (f, _), r in first.items():
        out[r].add(f)
    return out


def owned_squares(grads: Mapping[str, torch.Tensor], owned: Iterable[str]) -> torch.Tensor:
    """The sum of squares (float64 scalar) of the gradients in ``grads`` named by ``owned`` (this rank's part of the
    squared global norm; summed over every rank it is the squared global norm)."""
    total = torch.zeros((), dtype=torch.float64)
    for f in sorted(owned):
        total = total + grads[f].detach().double().pow(2).sum()
    return total
