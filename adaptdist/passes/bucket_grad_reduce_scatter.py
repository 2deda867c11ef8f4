"""Pass: reduce-scatter sharded parameters' gradients in buckets.

Redistribution gives every gradient of a sharded parameter its own padded
``reduce_scatter`` at the end of the graph. This pass merges the gradients, in the
order backward produces them, into buckets of at most ``ctx.bucket_bytes``: each
padded gradient ``[world * block, ...]`` is viewed as ``[world, block * ...]`` (row r
is rank r's block), the bucket is concatenated along dim 1 and flattened, one
``reduce_scatter`` gives every rank its row of the sum, which is split back into
the per-parameter blocks. The collective is issued as soon as the bucket's last
gradient exists and waited on just before the graph returns, so it overlaps the
rest of backward. Only gradients are bucketed: a reduce_scatter whose result feeds an op
(a Partial -> Shard redistribution in forward or backward) stays where its consumer needs it.

Before/after (two gradients)::

    rs_1 = reduce_scatter(pad(g_1), 'sum', 2, 'adaptdist:dp') ...  rs_2 = reduce_scatter(pad(g_2), ...)
    # becomes
    flat = reshape(cat([reshape(pad(g_1), [2, -1]), reshape(pad(g_2), [2, -1])], 1), [-1])
    rs = reduce_scatter(flat, 'sum', 2, 'adaptdist:dp')          # issued after g_2
    ...
    parts = split_with_sizes(wait(rs), [m_1, m_2]); block_1 = reshape(parts[0], [b_1, ...]) ...
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .. import _torch_compat as compat
from .. import graph_meta as gmeta
from ..placement import Partial, Shard
from .context import PassContext
from .graph_build import add_op

aten = torch.ops.aten


def bucket_grad_reduce_scatter(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Merge per-gradient reduce_scatters into buckets; returns ``(gm, changed)``."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    chains = []  # (grad, pre nodes [moved?, padded], rs, wait)
    for rs in graph.nodes:
        if gmeta.get_collective(rs, ctx.group_name) != "reduce_scatter":
            continue
        padded = rs.args[0]
        pre = [padded]
        src = padded.args[0]
        if src.op == "call_function" and src.target == aten.permute.default and len(src.users) == 1:
            pre.insert(0, src)
            src = src.args[0]
        wait = next(iter(rs.users))
        if not _feeds_output(wait):
            continue  # a forward P->S (redistribution before a consumer): its consumer needs it where it is
        chains.append((src, pre, rs, wait))
    if len(chains) < 2:
        return gm, False
    chains.sort(key=lambda c: order[c[0]])
    buckets: list[list] = [[]]
    size = 0
    for c in chains:
        v = c[1][-1].meta["val"]
        nbytes = v.numel() * v.element_size()
        if buckets[-1] and (size + nbytes > ctx.bucket_bytes or v.dtype != buckets[-1][0][1][-1].meta["val"].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(c)
        size += nbytes
    changed = False
    out = graph.output_node()
    for bucket in buckets:
        if len(bucket) > 1:
            _merge(graph, bucket, ctx, out, order)
            changed = True
    return gm, changed


def _feeds_output(wait: torch.fx.Node) -> bool:
    """Whether the reduce_scatter waited on by ``wait`` is a gradient's: its trim (and the permute and clone
    back, for a dim other than 0) leads, one user each, to the graph's output. Only such moves count: a
    backward P->S redistribution whose one consumer computes a gradient (HF T5 under fsdp: ``slice(wait)`` ->
    ``mul`` -> ``sum`` -> a norm weight's gradient) is not a gradient's, and stays where its consumer is."""
    n = wait
    while len(n.users) == 1:
        n = next(iter(n.users))
        if n.op == "output":
            return True
        if n.op != "call_function" or n.target not in _MOVES:
            return False
    return False


# what may lie between a gradient's reduce_scatter and the output: its trim, permute back, copies and views
_MOVES = {aten.slice.Tensor, aten.permute.default, aten.clone.default, aten._to_copy.default,
          aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _merge(graph, bucket, ctx: PassContext, out: torch.fx.Node, order: dict) -> None:
    w = ctx.axis_size
    last = max((c[0] for c in bucket), key=order.__getitem__)
    mode = getattr(bucket[0][1][-1].meta["val"], "fake_mode", None)

    def call(target, args, placement):
        return add_op(graph, target, args, placement)

    # Move each gradient's permute/pad right after the bucket's last gradient.
    anchor = last
    for _, pre, _, _ in bucket:
        for n in pre:  # they sit at the end of the graph (redistribution put them before the output)
            anchor.append(n)
            anchor = n
    with graph.inserting_before(anchor.next):
        rows = [call(aten.reshape.default, (pre[-1], [w, -1]), Partial()) for _, pre, _, _ in bucket]
        cat = call(aten.cat.default, (rows, 1), Partial())
        flat = call(aten.reshape.default, (cat, [-1]), Partial())
        rs = graph.call_function(compat.functional_reduce_scatter_op(), (flat, "sum", w, ctx.group_name))
    with mode if mode is not None else torch.no_grad():
        rs.meta["val"] = flat.meta["val"].new_empty((flat.meta["val"].numel() // w,))
    gmeta.set_placements(rs, (Shard(0),))
    gmeta.mark_collective(rs, "reduce_scatter", ctx.group_name)
    first_wait = min((c[3] for c in bucket), key=order.__getitem__)  # the trims follow the old waits
    with graph.inserting_before(first_wait):
        wait = graph.call_function(compat.functional_wait_op(), (rs,))
        wait.meta["val"] = rs.meta["val"]
        gmeta.set_placements(wait, (Shard(0),))
        gmeta.mark_collective(wait, "wait", ctx.group_name)
        sizes = [r.meta["val"].shape[1] for r in rows]
        parts = call(aten.split_with_sizes.default, (wait, sizes), Partial())
        gmeta.set_placements(parts, (tuple(Partial() for _ in bucket),))
        for i, (_, pre, old_rs, old_wait) in enumerate(bucket):
            item = graph.call_function(operator.getitem, (parts, i))
            item.meta["val"] = parts.meta["val"][i]
            gmeta.set_placements(item, (Partial(),))
            block_shape = list(old_wait.meta["val"].shape)
            block = call(aten.reshape.default, (item, block_shape), Partial())
            old_wait.replace_all_uses_with(block)
    for _, _, old_rs, old_wait in bucket:
        graph.erase_node(old_wait)
        graph.erase_node(old_rs)
