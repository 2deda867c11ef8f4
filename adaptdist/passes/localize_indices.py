"""Pass: gather / scatter along the sharded dim by this rank's rows (issue 14 point 1, "opinfo90").

Where ``x`` of ``gather(x, d, index)`` or ``scatter*(x, d, index, src)`` is sharded on ``d`` itself and the
index replicated (``sharding_rules.index_along_shard``), rank r holding rows ``[s, e)`` of ``d`` shifts the
indices by ``s``; the in-range ones address its rows, one row further down: its shard gets a dummy row 0 in
front (``constant_pad_nd``), which every out-of-range index addresses instead.

* ``gather``: ``where(in_range, gather(pad(x), d, where(in_range, index - s + 1, 0)), 0)``: a Partial sum (each
  element read on the one rank that holds its row);
* ``scatter``/``scatter_add``/``scatter_reduce`` (any reduce, ``include_self`` either way): the update into the
  padded shard with the out-of-range ones sent to the dummy row, which is then dropped: the shard stays,
  every row's updates all reduced on its own rank, as one process reduces them.

``s`` and ``e - s`` differ per rank: the nodes carrying them are marked (``graph_meta.set_vocab_bounds``, the
sharded operand as the table) and localization fills them in.

Before/after (rank 1 of 2 holds rows [5, 10) of 10)::

    out = aten.scatter_reduce.two(x, 0, idx, src, "amax")      # x: f32[10, 5] S(0), idx, src: [5, 5] R
    # becomes (rank 1 after localization)
    sub = aten.sub.Tensor(idx, 5); ok = (sub >= 0) & (sub < 5)
    safe = aten.masked_fill.Scalar(aten.add.Scalar(sub, 1), ~ok, 0)
    out = aten.slice.Tensor(aten.scatter_reduce.two(aten.constant_pad_nd(x, [0, 0, 1, 0]), 0, safe, src, "amax"),
                            0, 1, 9223372036854775807)
"""

from __future__ import annotations

import sys

import torch
import torch.fx

from .. import graph_meta as gmeta
from ..placement import Partial, Replicate, Shard
from .context import PassContext
from .graph_build import add_op, set_fake_val
from .infra import placement_of

aten = torch.ops.aten
R = Replicate()
_SCATTERS = {aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two}


def _along_shard(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _SCATTERS | {aten.gather.default}:
        return False
    self_, dim, index = node.args[:3]
    nd = max(self_.meta["val"].dim(), 1)
    want = Partial() if node.target == aten.gather.default else Shard(dim % nd)
    return (placement_of(self_) == Shard(dim % nd) and placement_of(index) == R and placement_of(node) == want
            and index.meta["val"].dim() == nd)


def localize_indices(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Rewrite gathers and scatters along the sharded dim with replicated indices; returns ``(gm, changed)``."""
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if not _along_shard(node):
            continue
        self_, dim, index = node.args[:3]
        v = self_.meta["val"]
        nd = max(v.dim(), 1)
        d = dim % nd
        pad = [0, 0] * (nd - 1 - d) + [1, 0]
        with graph.inserting_before(node):
            sub = add_op(graph, aten.sub.Tensor, (index, 0), R)
            gmeta.set_vocab_bounds(sub, "start", self_, ctx.group_name)
            ge = add_op(graph, aten.ge.Scalar, (sub, 0), R)
            lt = add_op(graph, aten.lt.Scalar, (sub, v.shape[d]), R)
            gmeta.set_vocab_bounds(lt, "rows", self_, ctx.group_name)
            ok = add_op(graph, aten.logical_and.default, (ge, lt), R)
            safe = add_op(graph, aten.masked_fill.Scalar,
                          (add_op(graph, aten.add.Scalar, (sub, 1), R), add_op(graph, aten.logical_not.default, (ok,), R), 0),
                          R)
            padded = add_op(graph, aten.constant_pad_nd.default, (self_, pad, 0.0), Shard(d))
        node.args = (padded, dim, safe, *node.args[3:])
        set_fake_val(node)  # a scatter's output: the padded rows
        if node.target == aten.gather.default:
            with graph.inserting_after(node):
                zero = add_op(graph, aten.scalar_tensor.default, (0.0,), R,
                              kwargs={"dtype": node.meta["val"].dtype, "device": v.device})
            with graph.inserting_after(zero):
                out = add_op(graph, aten.where.self, (ok, node, zero), Partial())
        else:
            with graph.inserting_after(node):
                out = add_op(graph, aten.slice.Tensor, (node, d, 1, sys.maxsize), Shard(d))
        node.replace_all_uses_with(out, delete_user_cb=lambda u: u is not out)
        changed = True
    return gm, changed
