"""Pass: all-gather sharded parameters in buckets, as FSDP gathers a block's parameters at once.

Each sharded parameter gets its own padded all_gather from redistribution; with
small parameters the step is dominated by per-collective latency. This pass takes
the parameter gathers in program order and merges consecutive ones into one
collective per bucket of at most ``ctx.gather_bucket_bytes`` (never across the
forward/backward boundary, so backward's gathers are not fetched in forward):
each rank flattens its padded shards into one buffer, one ``all_gather`` brings
``[world, total]``, and each parameter is cut back out and reshaped to the rows the
original gather produced. The bucket is issued where its first parameter was.

Before/after (two parameters, padded shards of 4x8 and 4)::

    ag_1 = all_gather(pad_1, 2, 'adaptdist:dp')   # [8, 8]        ag_2 = all_gather(pad_2, ...)   # [8]
    # becomes
    cat = aten.cat([reshape(pad_1, [-1]), reshape(pad_2, [-1])])                           # [36]
    ag = all_gather(cat, 2, 'adaptdist:dp'); w = wait(ag)                                   # [72]
    parts = split_with_sizes(reshape(w, [2, -1]), [32, 4], 1)                               # [2, 32], [2, 4]
    w_1 = reshape(parts[0], [-1, 8])  # [8, 8]        w_2 = reshape(parts[1], [-1])  # [8]
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .. import _torch_compat as compat
from .. import graph_meta as gmeta
from ..placement import Replicate
from .context import PassContext
from .graph_build import add_op
from .regather_in_backward import _forward_end
from .sharding_rules import _is_param

aten = torch.ops.aten


def bucket_param_allgather(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Merge consecutive parameter all_gathers into buckets; returns ``(gm, changed)``."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    out = graph.output_node()
    loss = out.args[0][gmeta.get_output_roles(out).index("loss")]
    boundary = _forward_end(loss, order)
    chains = []  # (gather node, pad node, wait node)
    for n in graph.nodes:
        if gmeta.get_collective(n, ctx.group_name) != "all_gather":
            continue
        pad = n.args[0]
        src = pad.args[0]
        if gmeta.get_gather_pad(pad, ctx.group_name) is None or not _is_param(src):
            continue
        wait = next(iter(n.users))
        chains.append((n, pad, wait))
    buckets: list[list[tuple]] = []
    size = 0
    for c in chains:
        nbytes = c[1].meta["val"].numel() * c[1].meta["val"].element_size()
        side = order[c[0]] > boundary
        if (not buckets or size + nbytes > ctx.gather_bucket_bytes
                or (order[buckets[-1][-1][0]] > boundary) != side
                or c[1].meta["val"].dtype != buckets[-1][0][1].meta["val"].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(c)
        size += nbytes
    changed = False
    for bucket in buckets:
        if len(bucket) > 1:
            _merge(graph, bucket, ctx)
            changed = True
    return gm, changed


def _merge(graph: torch.fx.Graph, bucket: list[tuple], ctx: PassContext) -> None:
    first_ag = bucket[0][0]

    def call(target, args):
        return add_op(graph, target, args, Replicate())

    # The pads (and the permutes feeding them) of later parameters depend only on
    # placeholders: move them up to the bucket's position.
    # A layout op two chains share (a parameter's transpose, read by a recomputed forward and by the backward)
    # moves once: moved again, it would land after the ops of the first chain that read it.
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved: set[torch.fx.Node] = set()
    for _, pad, _ in bucket[1:]:
        chain, n = [], pad
        while n.op == "call_function":  # pad <- layout ops <- the parameter placeholder
            chain.append(n)
            n = n.args[0]
        for n in reversed(chain):
            if order[n] > order[first_ag] and n not in moved:
                first_ag.prepend(n)
                moved.add(n)
    with graph.inserting_before(first_ag):
        flats = [call(aten.reshape.default, (pad, [-1])) for _, pad, _ in bucket]
        items = coalesced_all_gather(graph, flats, [pad for _, pad, _ in bucket], ctx)
        for item, (old_ag, pad, old_wait) in zip(items, bucket):
            rest = list(pad.meta["val"].shape[1:])
            full = call(aten.reshape.default, (item, [-1, *rest]))
            old_wait.replace_all_uses_with(full)
    for old_ag, _, old_wait in bucket:
        graph.erase_node(old_wait)
        graph.erase_node(old_ag)


def coalesced_all_gather(graph: torch.fx.Graph, flats: list[torch.fx.Node], pads: list[torch.fx.Node],
                         ctx: PassContext) -> list[torch.fx.Node]:
    """One all_gather for several tensors, inserted at ``graph``'s insertion point.

    Args:
        flats: 1-D nodes of one dtype, ``[n_i]``, each rank's part of one tensor (concatenated, gathered once
            over ``ctx``'s mesh axis of ``W = ctx.axis_size`` ranks, then split again).
        pads: the nodes whose gathers this one replaces, in the same order (recorded with
            :func:`graph_meta.set_coalesced` for the cost model and the schedule checks).

    Returns:
        One ``[W, n_i]`` node per flat (rank ``r``'s part in row ``r``), replicated on the mesh axis.
    """
    def call(target, args):
        return add_op(graph, target, args, Replicate())

    cat = call(aten.cat.default, (flats,))
    ag = graph.call_function(compat.functional_all_gather_op(), (cat, ctx.axis_size, ctx.group_name))
    ag.meta["val"] = cat.meta["val"].new_empty((cat.meta["val"].numel() * ctx.axis_size,))
    gmeta.set_placements(ag, (Replicate(),))
    gmeta.mark_collective(ag, "all_gather", ctx.group_name)
    wait = graph.call_function(compat.functional_wait_op(), (ag,))
    wait.meta["val"] = ag.meta["val"]
    gmeta.set_placements(wait, (Replicate(),))
    gmeta.mark_collective(wait, "wait", ctx.group_name)
    rows = call(aten.reshape.default, (wait, [ctx.axis_size, -1]))
    parts = call(aten.split_with_sizes.default, (rows, [f.meta["val"].numel() for f in flats], 1))
    gmeta.set_placements(parts, (tuple(Replicate() for _ in flats),))
    gmeta.set_coalesced(parts, list(pads), ctx.group_name)
    items = []
    for i in range(len(flats)):
        item = graph.call_function(operator.getitem, (parts, i))
        item.meta["val"] = parts.meta["val"][i]
        gmeta.set_placements(item, (Replicate(),))
        items.append(item)
    return items
