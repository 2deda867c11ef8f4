"""Batched matmuls against stacked ``[E, ...]`` weights under the backend's vmap over ranks (issue 14, moe/ep).

A stacked-experts MoE runs every expert at once as ``torch.bmm(xe [E, N, d], w_in [E, d, h])``. Under the
backend's capture (:mod:`.dynamo_capture`: every rank's forward at once, ``torch.vmap`` over a leading rank dim)
``xe`` is batched (``[W, E, N, d]`` physically) and the weight is not, and vmap's rule for ``bmm`` expands the
weight to ``[W, E, d, h]`` and folds the two leading dims into one batch dim ``W * E``. The planner then sees
one dim mixing ranks and experts: splitting it on the ranks' axis splits the ranks, not the experts, so the
expert weights (``S(0)`` on their expert dim under ``plan="ep"``) are gathered where used, and the expanded copy
costs ``W`` times the weight's memory.

:func:`rank_bmm` writes the same product with the rank dim folded into the token dim instead, the way one
process runs the whole batch::

    a [W, E, N, d] (rank dim 0)  -> permute -> [E, W, N, d] -> reshape [E, W*N, d]
    bmm(., w [E, d, h])          -> [E, W*N, h] -> [E, W, N, h] -> permute -> [W, E, N, h] (rank dim 0)

so the expert dim stays the bmm's batch dim, shardable together with the weight's dim 0: under ``ep`` the
planner keeps each rank's experts and moves the tokens by all_to_all (the permute turns the rank-split dim 0
into a split dim 1: ``S(1) -> S(0)`` is an all_to_all), and the weight's gradient ``bmm(a^T, g)`` sums over every
rank's tokens where the expert lives (not all-reduced, so not scaled by the ep degree). The values are those of
``torch.bmm`` row for row (the same products and sums, grouped differently).
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch
import torch.fx

from .. import _torch_compat as compat


def rank_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` (``a [E, N, d]``, ``b [E, d, h]`` per rank -> ``[E, N, h]``) under the vmap over ranks,
    with the rank dim folded into ``N`` (of ``a``) or ``h`` (of ``b``) when only one side is batched (module
    docstring); ``torch.bmm`` otherwise (both batched, neither, outside vmap, not 3-D)."""
    ra, la = compat.vmap_unwrap(a)
    rb, lb = compat.vmap_unwrap(b)
    if (la is None) == (lb is None) or a.dim() != 3 or b.dim() != 3:
        return torch.bmm(a, b)
    if la is not None:  # ra [W, E, N, d], b [E, d, h]
        w, e, n, d = ra.shape
        out = torch.bmm(ra.permute(1, 0, 2, 3).reshape(e, w * n, d), rb)  # [E, W*N, h]
        return compat.vmap_wrap(out.reshape(e, w, n, -1).permute(1, 0, 2, 3), la)
    w, e, d, h = rb.shape  # a [E, N, d], rb [W, E, d, h]
    out = torch.bmm(ra, rb.permute(1, 2, 0, 3).reshape(e, d, w * h))  # [E, N, W*h]
    return compat.vmap_wrap(out.reshape(e, -1, w, h).permute(2, 0, 1, 3), lb)


def rank_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``: :func:`rank_bmm` where both are 3-D per rank, ``torch.matmul`` otherwise."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 3 and b.dim() == 3:
        return rank_bmm(a, b)
    return torch.matmul(a, b)


_TARGETS = {torch.bmm: rank_bmm, torch.ops.aten.bmm.default: rank_bmm, torch.matmul: rank_matmul,
            operator.matmul: rank_matmul, torch.ops.aten.matmul.default: rank_matmul}


_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _is_param(x: Any, params: set[str]) -> bool:
    """A parameter placeholder (by name), or a dtype cast of one (autocast's, in a graph traced under it)."""
    if not isinstance(x, torch.fx.Node):
        return False
    if x.op == "placeholder":
        return x.name in params
    return x.op == "call_function" and x.target in _CASTS and _is_param(x.args[0], params)


def _stacked_weight_products(gm: torch.fx.GraphModule, params: set[str]) -> list[torch.fx.Node]:
    """The ``bmm`` / 3-D ``matmul`` calls of a Dynamo graph with a parameter (or its cast) as one operand."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _TARGETS and len(n.args) == 2
            and not n.kwargs and any(_is_param(x, params) for x in n.args)]


def with_rank_bmm(gm: torch.fx.GraphModule, param_placeholders: set[str]) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose batched matmuls against a parameter (``param_placeholders``: placeholder names) are
    :func:`rank_bmm` / :func:`rank_matmul`; ``gm`` itself when it has none."""
    calls = _stacked_weight_products(gm, param_placeholders)
    if not calls:
        return gm
    graph = copy.deepcopy(gm.graph)
    by_name = {n.name: n for n in graph.nodes}
    for n in calls:
        by_name[n.name].target = _TARGETS[n.target]
    return torch.fx.GraphModule(gm, graph)
