"""Pass: make vocabulary-parallel lookups local (Megatron's VocabParallelEmbedding).

Where the table of an ``embedding`` is sharded by vocabulary (``S(0)``) and its indices
are replicated, each rank holds rows ``[start, end)``. The lookup shifts the indices by
``start``, looks up the in-range ones (the others read row 0) and zeroes the rows of
out-of-range tokens, giving a ``Partial`` sum over ranks (an all_reduce follows where a
consumer needs the value). The table's gradient ``embedding_dense_backward`` is computed
for the local rows only (``S(0)``), from the masked incoming gradient, with the
``padding_idx`` shifted into the local rows (or -1 when another rank holds it) so every
other token's gradient survives. ``start``, the local row count and the local padding
index differ per rank: the nodes carrying them are marked, and localization fills them in.

Before/after (vocabulary 11 over 2 ranks: rank 1 holds rows [6, 11))::

    embedding = aten.embedding(w, idx)                     # w: f32[11, 4] S(0), idx: i64[3, 3] R
    # becomes (rank 1 after localization)
    sub = aten.sub.Tensor(idx, 6); lt = aten.lt.Scalar(sub, 0); ge = aten.ge.Scalar(sub, 5)
    out_of_range = aten.logical_or(lt, ge); safe = aten.masked_fill.Scalar(sub, out_of_range, 0)
    embedding = aten.embedding(w, safe)                    # f32[3, 3, 4]
    keep = aten.unsqueeze(aten.logical_not(out_of_range), -1)
    masked = aten.mul.Tensor(embedding, keep)              # P(sum)
"""

from __future__ import annotations

import torch
import torch.fx

from .. import graph_meta as gmeta
from ..placement import Partial, Replicate, Shard
from .context import PassContext
from .graph_build import add_op
from .infra import placement_of
from .sharding_rules import _arg, vocab_parallel_lookup

aten = torch.ops.aten
R = Replicate()


def vocab_parallel_embedding(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Rewrite vocabulary-parallel lookups and their backward; returns ``(gm, changed)``."""
    graph = gm.graph
    masks: dict[torch.fx.Node, tuple[torch.fx.Node, torch.fx.Node]] = {}  # indices -> (safe, out_of_range)

    def mask_for(idx: torch.fx.Node, table: torch.fx.Node, before: torch.fx.Node):
        if idx in masks:
            return masks[idx]
        rows = table.meta["val"].shape[0]
        with graph.inserting_before(before):
            sub = add_op(graph, aten.sub.Tensor, (idx, 0), R)
            gmeta.set_vocab_bounds(sub, "start", table, ctx.group_name)
            lt = add_op(graph, aten.lt.Scalar, (sub, 0), R)
            ge = add_op(graph, aten.ge.Scalar, (sub, rows), R)
            gmeta.set_vocab_bounds(ge, "rows", table, ctx.group_name)
            oor = add_op(graph, aten.logical_or.default, (lt, ge), R)
            safe = add_op(graph, aten.masked_fill.Scalar, (sub, oor, 0), R)
        masks[idx] = (safe, oor)
        return masks[idx]

    changed = False
    for node in list(graph.nodes):
        if node.target != aten.embedding.default or vocab_parallel_lookup(node.args[1], placement_of) is not node:
            continue
        table, idx = node.args[0], node.args[1]
        safe, oor = mask_for(idx, table, node)
        node.args = (table, safe, *node.args[2:])
        with graph.inserting_after(node):
            keep = add_op(graph, aten.logical_not.default, (oor,), R)
        with graph.inserting_after(keep):
            keep1 = add_op(graph, aten.unsqueeze.default, (keep, -1), R)
        with graph.inserting_after(keep1):
            masked = add_op(graph, aten.mul.Tensor, (node, keep1), Partial())
        node.replace_all_uses_with(masked, delete_user_cb=lambda u: u is not masked)
        for bw in list(idx.users):
            if bw.target != aten.embedding_dense_backward.default or placement_of(bw) != Shard(0):
                continue
            grad = bw.args[0]
            with graph.inserting_before(bw):
                g = add_op(graph, aten.mul.Tensor, (grad, keep1), R)
            padding_idx = _arg(bw, 3, "padding_idx", -1)
            bw.args = (g, safe, bw.args[2], padding_idx, *bw.args[4:])
            gmeta.set_vocab_bounds(bw, "backward", table, ctx.group_name)
        changed = True
    return gm, changed
