"""Pass: all-reduce partial gradients in buckets, as DDP does.

Every gradient output whose placement is ``Partial`` (a per-rank partial sum
over the batch shard) is summed over the data-parallel mesh axis. Gradients
are grouped in the order backward produces them into buckets of at most
``ctx.bucket_bytes`` (a gradient larger than that gets its own bucket). Each
bucket is flattened into one buffer right after its last gradient is computed,
all-reduced as a functional collective, and waited on just before the graph
returns, so communication overlaps the rest of backward.

Before/after (two small gradients, one bucket)::

    return (loss, mm_5, sum_3)                    # f32[64, 32] P, f32[64] P
    # becomes
    cat = aten.cat([aten.reshape(mm_5, [-1]), aten.reshape(sum_3, [-1])])   # f32[2112]
    all_reduce = _c10d_functional.all_reduce(cat, 'sum', 'adaptdist:dp')
    ...
    wait_tensor = _c10d_functional.wait_tensor(all_reduce)
    split = aten.split_with_sizes(wait_tensor, [2048, 64])
    return (loss, aten.view(split[0], [64, 32]), aten.view(split[1], [64]))
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx

from .. import _torch_compat as compat
from .. import graph_meta as gmeta
from ..placement import Partial, Replicate
from .context import PassContext
from .infra import placement_of

aten = torch.ops.aten


def _bytes(n: torch.fx.Node) -> int:
    v = n.meta["val"]
    return v.numel() * v.element_size()


def plan_buckets(grads: list[torch.fx.Node], bucket_bytes: int) -> list[list[torch.fx.Node]]:
    """Group gradients (in production order) into consecutive buckets of at most ``bucket_bytes``."""
    buckets: list[list[torch.fx.Node]] = []
    cur: list[torch.fx.Node] = []
    size = 0
    for g in grads:
        b = _bytes(g)
        if cur and (size + b > bucket_bytes or g.meta["val"].dtype != cur[0].meta["val"].dtype):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(g)
        size += b
    if cur:
        buckets.append(cur)
    return buckets


def _call(graph, target, args, val, placement) -> torch.fx.Node:
    n = graph.call_function(target, args)
    n.meta["val"] = val
    gmeta.set_placements(n, (placement,))
    return n


def bucket_grad_allreduce(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Insert bucketed all_reduces for Partial gradient outputs; returns ``(gm, changed)``."""
    graph = gm.graph
    out_node = graph.output_node()
    outs = list(out_node.args[0])
    roles = gmeta.get_output_roles(out_node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    grad_slots: dict[torch.fx.Node, list[int]] = {}
    for j, (o, role) in enumerate(zip(outs, roles)):
        if role.startswith("grad:") and isinstance(o, torch.fx.Node) and isinstance(placement_of(o), Partial):
            grad_slots.setdefault(o, []).append(j)
    if not grad_slots:
        return gm, False
    grads = sorted(grad_slots, key=order.__getitem__)
    for g in grads:
        gmeta.add_resharded(out_node, g.name, repr(Partial()), repr(Replicate()), ctx.group_name, "all_reduce")
    for bucket in plan_buckets(grads, ctx.bucket_bytes):
        last = max(bucket, key=order.__getitem__)
        fake = bucket[0].meta["val"]
        mode = getattr(fake, "fake_mode", None)
        if len(bucket) == 1:
            flat = bucket[0]
            anchor = last
        else:
            with graph.inserting_before(last.next):
                flats = []
                for g in bucket:
                    v = g.meta["val"]
                    with mode or contextlib.nullcontext():
                        fv = v.reshape(-1)
                    flats.append(_call(graph, aten.reshape.default, (g, [-1]), fv, Partial()))
                with mode or contextlib.nullcontext():
                    cv = torch.cat([f.meta["val"] for f in flats])
                flat = _call(graph, aten.cat.default, (flats,), cv, Partial())
            anchor = flat
        w = _all_reduce_after(graph, flat, anchor, out_node, ctx.group_name)
        if len(bucket) == 1:
            for j in grad_slots[bucket[0]]:
                outs[j] = w
            continue
        sizes = [g.meta["val"].numel() for g in bucket]
        with graph.inserting_before(out_node):
            with mode or contextlib.nullcontext():
                parts = torch.split(w.meta["val"], sizes)
            sp = _call(graph, aten.split_with_sizes.default, (w, sizes), parts, Replicate())
            gmeta.set_placements(sp, (tuple(Replicate() for _ in bucket),))
            for i, g in enumerate(bucket):
                item = _call(graph, operator.getitem, (sp, i), parts[i], Replicate())
                with mode or contextlib.nullcontext():
                    vv = parts[i].view(g.meta["val"].shape)
                view = _call(graph, aten.view.default, (item, list(g.meta["val"].shape)), vv, Replicate())
                for j in grad_slots[g]:
                    outs[j] = view
    out_node.args = (tuple(outs),)
    return gm, True


def _all_reduce_after(graph, flat, anchor, out_node, group_name) -> torch.fx.Node:
    with graph.inserting_after(anchor):
        ar = graph.call_function(compat.functional_all_reduce_op(), (flat, "sum", group_name))
    ar.meta["val"] = flat.meta["val"]
    gmeta.mark_collective(ar, "all_reduce", group_name)
    gmeta.set_placements(ar, (Partial(),))
    with graph.inserting_before(out_node):
        w = graph.call_function(compat.functional_wait_op(), (ar,))
    w.meta["val"] = flat.meta["val"]
    gmeta.mark_collective(w, "wait", group_name)
    gmeta.set_placements(w, (Replicate(),))
    return w

