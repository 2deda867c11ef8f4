"""Pass: gather the embedding rows and ids of every table ``gather_embedding_rows`` marked in one collective.

``gather_embedding_rows`` has each marked table's gradient rows (``float32[B, ..., C]``) and ids (``int64[B, ...]``)
gathered, and ``insert_redistributes`` gives each its own padded all_gather: two collectives per table (four a
step for builtin:dlrm's users and movies), each paying the collective's latency (``alpha``: 10-20 us on the
shared-memory kernels, more on gloo) for a few KB. This pass merges them: each rank flattens its padded blocks
into one buffer, one ``all_gather`` brings ``[world, total]``, and each value is cut back out and reshaped to the
rows the original gather produced. Ids travel in the rows' buffer as float32 values (``_to_copy``, and back to
int64 after), which is exact because an id of a table of ``V <= 2**24`` rows is an integer below ``2**24``
(float32's 24-bit significand); a table with more rows keeps its ids in a buffer of their own dtype (a second
collective). Gathers of other dtypes (bfloat16 rows) are merged among themselves.

The merged collective is issued right after the last of its padded blocks is computed, and the ops that read
the gathered values (the slice, the marked ``embedding_dense_backward`` and the views to the output: nothing
else reads them, ``gather_embedding_rows.only_a_gradient``) move after it, in their order.

Before/after (two tables, 2 ranks, local shapes)::

    ag_1 = all_gather(pad_1, 2, 'adaptdist:dp')   # f32[256, 1, 32]   ag_2 = all_gather(pad_2, ...)  # i64[256, 1]
    ag_3 = all_gather(pad_3, 2, 'adaptdist:dp')   # f32[256, 1, 32]   ag_4 = all_gather(pad_4, ...)  # i64[256, 1]
    # becomes
    cat = aten.cat([reshape(pad_1, [-1]), reshape(_to_copy(pad_2, f32), [-1]), ...])         # f32[8448]
    ag = all_gather(cat, 2, 'adaptdist:dp'); w = wait(ag)                                      # f32[16896]
    parts = split_with_sizes(reshape(w, [2, -1]), [4096, 128, 4096, 128], 1)
    rows_1 = reshape(parts[0], [-1, 1, 32])      ids_1 = reshape(_to_copy(parts[1], i64), [-1, 1])   ...
"""

from __future__ import annotations


import torch
import torch.fx

from .. import graph_meta as gmeta
from ..placement import Replicate
from .context import PassContext
from .bucket_param_allgather import coalesced_all_gather
from .graph_build import add_op

aten = torch.ops.aten

FLOAT32_EXACT_IDS = 2**24
"""Ids below this are exact as float32 values (its significand has 24 bits)."""


def _chains(graph: torch.fx.Graph, group: str) -> list[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, int]]:
    """``(all_gather, pad, wait, rows of the table)`` of each padded batch gather whose only reader is a slice read
    only by ``embedding_dense_backward`` nodes ``gather_embedding_rows`` marked."""
    out = []
    for n in graph.nodes:
        if gmeta.get_collective(n, group) != "all_gather" or len(n.users) != 1:
            continue
        pad = n.args[0]
        if not isinstance(pad, torch.fx.Node) or gmeta.get_gather_pad(pad, group) != 0:
            continue
        wait = next(iter(n.users))
        if len(wait.users) != 1:
            continue
        sl = next(iter(wait.users))
        if sl.target != aten.slice.Tensor or not sl.users:
            continue
        readers = list(sl.users)
        if not all(r.target == aten.embedding_dense_backward.default and gmeta.gathers_rows(r) for r in readers):
            continue
        out.append((n, pad, wait, max(int(r.args[2]) for r in readers)))
    return out


def _carrier(pad: torch.fx.Node, table_rows: int) -> torch.dtype:
    """The dtype a gathered value travels in: ids of a table of at most 2**24 rows as float32, else its own."""
    dtype = pad.meta["val"].dtype
    if not dtype.is_floating_point and table_rows <= FLOAT32_EXACT_IDS:
        return torch.float32
    return dtype


def bucket_gathered_rows(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Merge the gathers of marked embedding gradients into one all_gather per carrier dtype (module docstring);
    returns ``(gm, changed)``."""
    graph = gm.graph
    groups: dict[torch.dtype, list] = {}
    for c in _chains(graph, ctx.group_name):
        groups.setdefault(_carrier(c[1], c[3]), []).append(c)
    changed = False
    for dtype, bucket in groups.items():
        if len(bucket) > 1:
            _merge(graph, bucket, dtype, ctx)
            changed = True
    return gm, changed


def _merge(graph: torch.fx.Graph, bucket: list, dtype: torch.dtype, ctx: PassContext) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = max((pad for _, pad, _, _ in bucket), key=order.__getitem__)

    def call(target, args, kwargs=None):
        return add_op(graph, target, args, Replicate(), kwargs=kwargs)

    new: list[torch.fx.Node] = []
    with graph.inserting_before(anchor.next):
        flats = []
        for _, pad, _, _ in bucket:
            x = pad if pad.meta["val"].dtype == dtype else call(aten._to_copy.default, (pad,), {"dtype": dtype})
            flats.append(call(aten.reshape.default, (x, [-1])))
        items = coalesced_all_gather(graph, flats, [pad for _, pad, _, _ in bucket], ctx)
        for item, (_, pad, old_wait, _) in zip(items, bucket):
            own = pad.meta["val"].dtype
            if own != dtype:
                item = call(aten._to_copy.default, (item,), {"dtype": own})
            full = call(aten.reshape.default, (item, [-1, *pad.meta["val"].shape[1:]]))
            new.append(full)
            old_wait.replace_all_uses_with(full)
    for old_ag, _, old_wait, _ in bucket:
        graph.erase_node(old_wait)
        graph.erase_node(old_ag)
    # the readers that came before the anchor (an earlier table's slice, backward and views) move after the
    # merged gather, in their order: they read nothing else computed after them, and only the output reads them
    late: set[torch.fx.Node] = set()
    todo = [u for f in new for u in f.users]
    while todo:
        u = todo.pop()
        if u in late or u.op == "output" or u not in order or order[u] > order[anchor]:
            continue
        late.add(u)
        todo.extend(u.users)
    tail = new[-1]
    for u in sorted(late, key=order.__getitem__):
        tail.append(u)
        tail = u
