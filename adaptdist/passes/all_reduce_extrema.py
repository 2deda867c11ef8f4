"""Pass: a max or min over a sharded dim, as this rank's extremum all-reduced (issue 14 point 1, "opinfo90").

``amax``/``amin``/``max``/``min`` (no dim), and ``all``/``any`` (a min/max of bools: ``F.one_hot`` checks its
labels with them) over the sharded dim: the rule
(``sharding_rules.extremum``) leaves the input sharded and calls the output replicated; here
each rank's extremum is all-reduced with ``max``/``min`` (gloo and the simulator support both)
right after the op, so every consumer sees the global one. A rank that may hold no rows of
the sharded dim reduces its shard padded with one element of the reduction's identity
(``-inf`` for max), which changes no other rank's value. The backward graphs need nothing
more: they compare the input with the (replicated) extremum and count the ties with a sum,
which is all-reduced as any Partial sum, so the gradient is split evenly among the ties over
all ranks, as eager does (``evenly_distribute_backward``). NaN inputs: the all-reduce's
max/min may not propagate a NaN as eager's does.

Before/after (4 rows over 3 ranks: rank 2 holds none)::

    amax = aten.amax.default(x, [0])                  # x: f32[4] S(0), amax: R (local)
    # becomes
    pad = aten.constant_pad_nd.default(x, [0, 1], -inf)
    amax = aten.amax.default(pad, [0])
    ar = _c10d_functional.all_reduce.default(amax, "max", "adaptdist:dp"); w = wait_tensor(ar)
"""

from __future__ import annotations

import math

import torch
import torch.fx

from .. import _torch_compat as compat
from ..placement import Replicate, Shard, chunk_interval
from .context import PassContext
from .graph_build import add_op
from .infra import placement_of

aten = torch.ops.aten
R = Replicate()
EXTREMA = {aten.amax.default: "max", aten.max.default: "max", aten.amin.default: "min", aten.min.default: "min",
           # a bool's all is its min, any its max (gloo reduces bools with both)
           aten.all.default: "min", aten.all.dim: "min", aten.all.dims: "min",
           aten.any.default: "max", aten.any.dim: "max", aten.any.dims: "max"}


def reduced_dims(node: torch.fx.Node) -> list[int]:
    """The dims ``node`` (one of :data:`EXTREMA`) reduces over."""
    nd = node.args[0].meta["val"].dim()
    if node.target in (aten.max.default, aten.min.default, aten.all.default, aten.any.default):
        return list(range(nd))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d % nd for d in dims) if dims else list(range(nd))


def is_local_extremum(node: torch.fx.Node) -> bool:
    """Whether ``node`` reduces its sharded input over the sharded dim into a replicated output (the form
    ``sharding_rules.extremum`` gives and this pass completes)."""
    if node.op != "call_function" or node.target not in EXTREMA:
        return False
    p = placement_of(node.args[0])
    return isinstance(p, Shard) and p.dim in reduced_dims(node) and placement_of(node) == R


def _some_rank_empty(size: int, ctx: PassContext) -> bool:
    if any(e == s for s, e in (chunk_interval(size, ctx.axis_size, r) for r in range(ctx.axis_size))):
        return True
    return size == ctx.batch_size and 0 in ctx.shard_sizes()


def _identity(op: str, dtype: torch.dtype):
    if dtype.is_floating_point:
        return -math.inf if op == "max" else math.inf
    if dtype == torch.bool:
        return op != "max"
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def all_reduce_extrema(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """All-reduce every local extremum over the sharded dim; returns ``(gm, changed)``."""
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if not is_local_extremum(node):
            continue
        op = EXTREMA[node.target]
        x = node.args[0]
        d = placement_of(x).dim
        v = x.meta["val"]
        if _some_rank_empty(v.shape[d], ctx):
            pad = [0, 0] * (v.dim() - 1 - d) + [0, 1]
            with graph.inserting_before(node):
                padded = add_op(graph, aten.constant_pad_nd.default, (x, pad, _identity(op, v.dtype)), Shard(d))
            node.args = (padded, *node.args[1:])
        with graph.inserting_after(node):
            ar = add_op(graph, compat.functional_all_reduce_op(), (node, op, ctx.group_name), R,
                        collective="all_reduce", group=ctx.group_name)
        with graph.inserting_after(ar):
            w = add_op(graph, compat.functional_wait_op(), (ar,), R, collective="wait", group=ctx.group_name)
        node.replace_all_uses_with(w, delete_user_cb=lambda u: u is not ar)
        changed = True
    return gm, changed
