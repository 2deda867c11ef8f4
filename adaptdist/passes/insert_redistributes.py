"""Pass: insert the collective for every edge whose placements differ.

Consumes ``adaptdist.redistribute`` (from propagation) and inserts, as
functional collectives on the mesh axis's process group:

* ``Partial -> Replicate``: ``all_reduce(sum)`` + ``wait_tensor``;
* ``Replicate -> Shard(d)``: a local slice, bounds filled per rank by localization (made
  contiguous when ``d`` is not the outermost dim: some ATen kernels read strided inputs wrongly);
* ``Partial -> Shard(d)``: a padded ``reduce_scatter``. Rank r must end with the rows the
  consumer's other sharded operands hold on rank r (localization aligns them). Those are
  torch.chunk blocks of ``n`` (a gradient going to its parameter's shard, operands that are
  parameters or batch inputs, or ops of them that keep the dim's size), or, where the operand's
  rows come from a view that merged the sharded dim of a chunked value with ``k`` inner rows
  (``[B, T, ...] S(0) -> [B * T, ...]``: rank r holds rows ``[k s_r, k e_r)``), torch.chunk
  blocks of ``n / k`` groups of ``k`` rows. For those, ``x`` is viewed as ``[..., n / k, k, ...]``,
  reduce-scattered in chunk blocks of ``n / k`` and viewed back: each rank receives exactly its
  rows, with uneven and empty shards, at the volume of the chunk case
  (``world * ceil(n / k / world) * k`` rows). Only where those rows cannot be derived from
  torch.chunk blocks (an operand that is a rank slice, a multi-output op, a view whose sizes are
  not multiples) is it still an all_reduce then a rank slice that aligns with that operand.

* ``Shard(d) -> Replicate``: each rank pads its shard on ``d`` to the largest shard
  (torch.chunk shards are packed at the front, so the padding is only at the end
  of short shards), ``all_gather_into_tensor`` on dim 0 (``d`` moved there), then
  the first ``n`` rows are kept.

* ``Shard(i) -> Shard(j)``: an ``all_to_all``: each rank pads its shard of ``i`` to the
  largest shard and ``j`` to ``world * ceil(n_j / world)`` rows, sends block ``d`` of ``j``
  to rank ``d``, and lays the received blocks side by side along ``i`` (the padding of
  short torch.chunk shards is only at their end, so the first ``n_i`` are the data), then
  keeps its own rows of ``j``. It moves ``1 / world`` of what all_gather + slice would.

Before/after::

    div = aten.div.Tensor(nll_sum, total_weight)              # loss: f32[] P(sum)
    return (div, ...)
    # becomes
    all_reduce = _c10d_functional.all_reduce(div, 'sum', 'adaptdist:dp')
    wait_tensor = _c10d_functional.wait_tensor(all_reduce)    # f32[] R
    return (wait_tensor, ...)
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from .. import _torch_compat as compat
from .. import graph_meta as gmeta
from ..errors import UnsupportedOpError
from ..placement import Partial, Replicate, Shard
from ..redistribute import FUNCTIONAL_OP, transition_collective
from .context import PassContext
from .graph_build import add_op
from .infra import padded_shard_size, placement_of
from .sharding_rules import tensor_args

aten = torch.ops.aten


def _copy_meta(n: torch.fx.Node, src: torch.fx.Node) -> None:
    n.meta["val"] = src.meta["val"]
    for key in ("stack_trace", "nn_module_stack"):
        if key in src.meta:
            n.meta[key] = src.meta[key]


def all_reduce(graph: torch.fx.Graph, x: torch.fx.Node, group_name: str, *, wait_before: torch.fx.Node | None = None) -> torch.fx.Node:
    """Insert ``all_reduce(x)`` after ``x`` and its ``wait_tensor`` (before ``wait_before`` if given)."""
    with graph.inserting_after(x):
        ar = graph.call_function(compat.functional_all_reduce_op(), (x, "sum", group_name))
    _copy_meta(ar, x)
    gmeta.mark_collective(ar, "all_reduce", group_name)
    gmeta.set_placements(ar, (gmeta.get_placements(x)[0],))
    ctx = graph.inserting_before(wait_before) if wait_before is not None else graph.inserting_after(ar)
    with ctx:
        w = graph.call_function(compat.functional_wait_op(), (ar,))
    _copy_meta(w, x)
    gmeta.mark_collective(w, "wait", group_name)
    gmeta.set_placements(w, (Replicate(),))
    return w


def rank_slice(graph: torch.fx.Graph, x: torch.fx.Node, dim: int, before: torch.fx.Node, group_name: str
               ) -> torch.fx.Node:
    """Insert a slice of ``x`` along ``dim`` that localization turns into this rank's shard."""
    size = x.meta["val"].shape[dim]
    with graph.inserting_before(before):
        s = graph.call_function(aten.slice.Tensor, (x, dim, 0, size))
    _copy_meta(s, x)
    gmeta.mark_collective(s, "rank_slice", group_name)
    gmeta.set_rank_slice(s, dim, group_name)
    gmeta.set_placements(s, (Shard(dim),))
    return s


def all_gather(graph: torch.fx.Graph, x: torch.fx.Node, dim: int, ctx: PassContext,
               before: torch.fx.Node) -> torch.fx.Node:
    """Insert the gather of ``x`` (sharded on ``dim``) into a replicated tensor, before ``before``."""
    val = x.meta["val"]
    nd, n = val.dim(), val.shape[dim]
    mode = getattr(val, "fake_mode", None)

    def call(target, args, placement, kind=None, kwargs=None):
        return add_op(graph, target, args, placement, kwargs=kwargs, collective=kind, group=ctx.group_name)

    with graph.inserting_before(before):
        perm = [dim] + [d for d in range(nd) if d != dim]
        moved = call(aten.permute.default, (x, perm), Shard(0)) if dim else x
        padded = call(aten.constant_pad_nd.default, (moved, [0, 0] * (nd - 1) + [0, 0], 0.0), Shard(0), "gather_pad")
        gmeta.set_gather_pad(padded, 0, ctx.group_name)
        gathered = graph.call_function(compat.functional_all_gather_op(), (padded, ctx.axis_size, ctx.group_name))
        gv = padded.meta["val"]
        with mode if mode is not None else torch.no_grad():
            gathered.meta["val"] = gv.new_empty((gv.shape[0] * ctx.axis_size, *gv.shape[1:]))
        gmeta.set_placements(gathered, (Replicate(),))
        gmeta.mark_collective(gathered, "all_gather", ctx.group_name)
        w = graph.call_function(compat.functional_wait_op(), (gathered,))
        w.meta["val"] = gathered.meta["val"]
        gmeta.set_placements(w, (Replicate(),))
        gmeta.mark_collective(w, "wait", ctx.group_name)
        full = call(aten.slice.Tensor, (w, 0, 0, n), Replicate())
        if dim:
            inv = [perm.index(d) for d in range(nd)]
            back = call(aten.permute.default, (full, inv), Replicate())
            full = call(aten.clone.default, (back,), Replicate(), kwargs={"memory_format": torch.contiguous_format})
    gmeta.set_gather_chain(full, [n for n in (moved, padded, gathered, w) if n is not x] + _tail(full, w),
                           ctx.group_name)
    return full


def _tail(full: torch.fx.Node, wait: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes from after ``wait`` up to and including ``full``, in order."""
    out, n = [], full
    while n is not wait:
        out.append(n)
        n = n.args[0]
    return out[::-1]


def reduce_scatter(graph: torch.fx.Graph, x: torch.fx.Node, dim: int, ctx: PassContext,
                   before: torch.fx.Node) -> torch.fx.Node:
    """Insert the reduce_scatter of Partial ``x`` into ``Shard(dim)`` (torch.chunk blocks), before ``before``.

    ``dim`` is moved to the front and padded to ``world_size * ceil(n / world_size)`` rows;
    rank r receives block r of the sum and keeps its first ``size_r`` rows.
    """
    val = x.meta["val"]
    nd, n, w = val.dim(), val.shape[dim], ctx.axis_size
    block = padded_shard_size(n, w)
    mode = getattr(val, "fake_mode", None)

    def call(target, args, placement, kind=None, kwargs=None):
        return add_op(graph, target, args, placement, kwargs=kwargs, collective=kind, group=ctx.group_name)

    with graph.inserting_before(before):
        perm = [dim] + [d for d in range(nd) if d != dim]
        moved = call(aten.permute.default, (x, perm), Partial()) if dim else x
        padded = call(aten.constant_pad_nd.default, (moved, [0, 0] * (nd - 1) + [0, block * w - n], 0.0), Partial())
        rs = call(compat.functional_reduce_scatter_op(), (padded, "sum", w, ctx.group_name), Shard(0), "reduce_scatter")
        wt = call(compat.functional_wait_op(), (rs,), Shard(0), "wait")
        mine = call(aten.slice.Tensor, (wt, 0, 0, block), Shard(0))
        with mode if mode is not None else torch.no_grad():
            mine.meta["val"] = wt.meta["val"].new_empty((n, *wt.meta["val"].shape[1:]))  # global: n rows
        gmeta.set_scatter_trim(mine, 0, n, ctx.group_name)
        if dim:
            inv = [perm.index(d) for d in range(nd)]
            back = call(aten.permute.default, (mine, inv), Shard(dim))
            mine = call(aten.clone.default, (back,), Shard(dim), kwargs={"memory_format": torch.contiguous_format})
    return mine


def all_to_all(graph: torch.fx.Graph, x: torch.fx.Node, i: int, j: int, ctx: PassContext,
               before: torch.fx.Node) -> torch.fx.Node:
    """Insert the all_to_all turning ``x`` (sharded on dim ``i``) into ``Shard(j)``, before ``before``.

    Local shapes on every rank (``m = ceil(n / world)``): pad ``i`` to ``m_i``, ``j`` to ``world * m_j``,
    move ``j`` to the front, exchange equal blocks of ``m_j`` rows, view as ``[world, m_j, ...]``, put the
    source axis beside ``i`` and merge it (``world * m_i``, data first), keep ``n_i``, then this rank's
    ``c_j`` rows of ``j`` (marked like a reduce_scatter's trim, so localization sizes it).
    """
    val = x.meta["val"]
    nd, w = val.dim(), ctx.axis_size
    n_i, n_j = val.shape[i], val.shape[j]
    m_j = padded_shard_size(n_j, w)
    mode = getattr(val, "fake_mode", None)
    g = ctx.group_name

    def call(target, args, placement, kind=None, kwargs=None):
        return add_op(graph, target, args, placement, kwargs=kwargs, collective=kind, group=g)

    with graph.inserting_before(before):
        pad_i = call(aten.constant_pad_nd.default, (x, [0, 0] * nd, 0.0), Shard(i), "gather_pad")
        gmeta.set_gather_pad(pad_i, i, g)
        pad = [0, 0] * nd
        pad[2 * (nd - 1 - j) + 1] = w * m_j - n_j
        pad_j = call(aten.constant_pad_nd.default, (pad_i, pad, 0.0), Shard(i))
        perm = [j] + [d for d in range(nd) if d != j]
        i_moved = perm.index(i)
        moved = call(aten.permute.default, (pad_j, perm), Shard(i_moved))
        cont = call(aten.clone.default, (moved,), Shard(i_moved), kwargs={"memory_format": torch.contiguous_format})
        a2a = graph.call_function(compat.functional_all_to_all_op(), (cont, [m_j] * w, [m_j] * w, g))
        a2a.meta["val"] = cont.meta["val"]
        gmeta.set_placements(a2a, (Replicate(),))  # a local layout no placement names; its shapes need no localization
        gmeta.mark_collective(a2a, "all_to_all", g)
        wt = graph.call_function(compat.functional_wait_op(), (a2a,))
        wt.meta["val"] = a2a.meta["val"]
        gmeta.set_placements(wt, (Replicate(),))
        gmeta.mark_collective(wt, "wait", g)
        rest = list(cont.meta["val"].shape[1:])
        blocks = call(aten.view.default, (wt, [w, m_j] + [-1 if k == i_moved - 1 else s for k, s in enumerate(rest)]),
                      Replicate())  # [w, m_j, ..., m_i (local), ...]
        src_beside_i = [1] + [k + 2 for k in range(len(rest)) if k < i_moved - 1] + [0] + \
            [k + 2 for k in range(len(rest)) if k >= i_moved - 1]
        side = call(aten.permute.default, (blocks, src_beside_i), Replicate())
        merged_shape = [m_j] + [(-1 if k == i_moved - 1 else s) for k, s in enumerate(rest)]
        merged = call(aten.reshape.default, (side, merged_shape), Replicate())  # i: world * m_i, data first
        kept = call(aten.slice.Tensor, (merged, i_moved, 0, n_i), Replicate())
        mine = graph.call_function(aten.slice.Tensor, (kept, 0, 0, m_j))
        with mode if mode is not None else torch.no_grad():
            mine.meta["val"] = kept.meta["val"].new_empty([n_j] + list(kept.meta["val"].shape[1:]))
        gmeta.set_placements(mine, (Shard(0),))
        gmeta.set_scatter_trim(mine, 0, n_j, g)
        inv = [perm.index(d) for d in range(nd)]
        back = call(aten.permute.default, (mine, inv), Shard(j))
        out = call(aten.clone.default, (back,), Shard(j), kwargs={"memory_format": torch.contiguous_format})
    return out


def grouped_reduce_scatter(graph: torch.fx.Graph, x: torch.fx.Node, dim: int, k: int, ctx: PassContext,
                           before: torch.fx.Node) -> torch.fx.Node:
    """Insert the reduce_scatter of Partial ``x`` into ``Shard(dim)`` where rank r holds rows ``[k s_r, k e_r)``,
    ``[s_r, e_r)`` its torch.chunk block of ``n / k`` (``n = x.shape[dim]``; the rows of a view that merged a
    chunked dim with ``k`` inner rows), before ``before``.

    ``x`` ``[..., n, ...]`` is viewed as ``[..., n / k, k, ...]``, reduce-scattered in torch.chunk blocks of
    ``dim`` (:func:`reduce_scatter`) and viewed back; localization sizes the view from the scatter's block
    (``k (e_r - s_r)`` rows). ``k == 1`` is the plain :func:`reduce_scatter`.
    """
    if k == 1:
        return reduce_scatter(graph, x, dim, ctx, before)
    shape = list(x.meta["val"].shape)
    with graph.inserting_before(before):
        grouped = add_op(graph, aten.reshape.default, (x, shape[:dim] + [shape[dim] // k, k] + shape[dim + 1:]),
                         Partial())
    mine = reduce_scatter(graph, grouped, dim, ctx, before)
    with graph.inserting_before(before):
        return add_op(graph, aten.reshape.default, (mine, shape), Shard(dim))


def grouped_all_to_all(graph: torch.fx.Graph, x: torch.fx.Node, i: int, j: int, k: int, ctx: PassContext,
                       before: torch.fx.Node) -> torch.fx.Node:
    """Insert the all_to_all turning ``x`` (sharded on dim ``i``) into ``Shard(j)`` where rank r holds rows
    ``[k s_r, k e_r)`` of ``j``, ``[s_r, e_r)`` its torch.chunk block of ``n_j / k`` (the rows of a view that
    merged a chunked dim with ``k`` inner rows, e.g. an uneven batch 7 merged with T = 5: rows [0, 20) and
    [20, 35), not torch.chunk's [0, 18) and [18, 35)), before ``before``.

    ``x`` ``[..., n_j, ...]`` is viewed as ``[..., n_j / k, k, ...]``, exchanged in torch.chunk blocks of the
    groups (:func:`all_to_all`) and viewed back (:func:`grouped_reduce_scatter`'s layout). ``k == 1`` is the
    plain :func:`all_to_all`.
    """
    if k == 1:
        return all_to_all(graph, x, i, j, ctx, before)
    shape = list(x.meta["val"].shape)
    i_grouped = i if i < j else i + 1
    with graph.inserting_before(before):
        grouped = add_op(graph, aten.reshape.default, (x, shape[:j] + [shape[j] // k, k] + shape[j + 1:]),
                         Shard(i_grouped))
    mine = all_to_all(graph, grouped, i_grouped, j, ctx, before)
    with graph.inserting_before(before):
        return add_op(graph, aten.reshape.default, (mine, shape), Shard(j))


def all_to_all_groups(consumer: torch.fx.Node, src: torch.fx.Node, target: Shard, group: str) -> int | None:
    """``k`` where the rows of ``src`` that ``consumer`` wants on each rank (``target`` of Shard ``src``) are
    torch.chunk blocks of ``n / k`` groups of ``k`` rows (1: plain chunk blocks), or None where they cannot be
    derived from torch.chunk blocks (then an all_gather and a slice aligned with the operand serve).

    Only the consumer's other sharded operands of size ``n`` on their sharded dim count (localization aligns
    operands of equal size only); without any, the all_to_all's own torch.chunk blocks define the rows (1).
    """
    if consumer.op == "output":
        return 1
    n = src.meta["val"].shape[target.dim]
    others = [a for _, a in tensor_args(consumer) if a is not src and isinstance(placement_of(a), Shard)
              and _size_on_shard(a) == n]
    if not others:
        return 1
    ks = {_chunk_groups(a, group) for a in others}
    k = ks.pop() if len(ks) == 1 else None
    return k if k is not None and n % k == 0 else None


def via(src_placement, target, consumer: torch.fx.Node, src: torch.fx.Node, group: str) -> str:
    """The ``_c10d_functional`` op that turns ``src_placement`` into ``target`` at ``consumer`` (``local``: none), by
    :data:`adaptdist.redistribute.TRANSITIONS`; a P->S whose rows are not torch.chunk blocks (of groups) of the
    consumer's is an all_reduce and a local slice instead (see the module docstring)."""
    kind = transition_collective(src_placement, target)
    if kind == "reduce_scatter" and scatter_groups(consumer, src, target, group) is None:
        kind = "all_reduce"
    if kind == "all_to_all" and all_to_all_groups(consumer, src, target, group) is None:
        kind = "all_gather"  # then a local slice aligned with the consumer's operand
    return FUNCTIONAL_OP[kind] if kind is not None else "local"


def scatter_groups(consumer: torch.fx.Node, src: torch.fx.Node, target: Shard, group: str) -> int | None:
    """``k`` where the rows of ``src`` that ``consumer`` wants on each rank (``target`` of ``src``) are torch.chunk
    blocks of ``n / k`` groups of ``k`` rows (``n`` = the size of ``target.dim``; 1: plain chunk blocks), or None
    where they cannot be derived from torch.chunk blocks.

    They are what localization gives the consumer's other sharded operands of size ``n``
    (:func:`_chunk_groups`), which must all agree. A gradient going to its parameter's shard is chunked (1), and
    so is an input whose consumer has no other sharded operand (rank slices fall back to torch.chunk there).
    """
    if consumer.op == "output":
        return 1
    n = src.meta["val"].shape[target.dim]
    others = [a for _, a in tensor_args(consumer) if a is not src and isinstance(placement_of(a), Shard)]
    if not others:
        return 1
    if any(_size_on_shard(a) != n for a in others):
        return None
    ks = {_chunk_groups(a, group) for a in others}
    k = ks.pop() if len(ks) == 1 else None
    return k if k is not None and n % k == 0 else None


def _size_on_shard(a: torch.fx.Node) -> int:
    return a.meta["val"].shape[placement_of(a).dim]


def _chunk_groups(a: torch.fx.Node, group: str) -> int | None:
    """``k`` such that localization gives Shard node ``a`` (size ``n`` on its sharded dim) the rows
    ``[k s_r, k e_r)`` on rank r, ``[s_r, e_r)`` the torch.chunk block of ``n / k``; None if unknown.

    Mirrors ``localize_shapes._intervals``: a placeholder or a reduce_scatter/all_to_all trim of this axis is
    chunked (1); a view that merges its input's sharded dim ``n_in`` into ``n_out = j n_in`` multiplies ``k`` by
    ``j``; a split by ``j`` divides it (``chunk(m) k / j = chunk(m / j') k / g``, ``g = gcd(k, j)``, ``j' = j / g``,
    where localization checks that the bounds divide); any other op passes its first sharded input's rows on
    unchanged, so it keeps ``k`` only when it keeps that input's size. A rank slice has the rows of the operand it
    is aligned with (:func:`_rank_slice_alignment`; none: chunked); one output of a multi-output op those of the
    op's first sharded input of its size. The vocabulary-parallel marks align with other operands: None.
    """
    k = 1
    factors: list[tuple[int, int]] = []
    while True:
        if a.op == "placeholder" or gmeta.get_scatter_trim(a, group) is not None:
            break
        if gmeta.get_rank_slice(a, group) is not None:
            aligned = _rank_slice_alignment(a, group)
            if aligned is None:
                break  # localization falls back to the torch.chunk block of the slice's dim
            a = aligned
            continue
        if a.op == "call_function" and a.target is operator.getitem and gmeta.get_vocab_bounds(a, group) is None:
            # one output of a multi-output op has the rows of the op's first sharded input of its size
            # (localize_shapes._op_interval); a single-output producer's (its placement not a tuple) as they are
            src = a.args[0]
            if not isinstance(gmeta.get_placements(src), tuple):
                return None
            if not isinstance(placement_of(src), tuple):
                a = src
                continue
            size = _size_on_shard(a)
            same = [b for _, b in tensor_args(src) if isinstance(gmeta.get_placements(b), tuple)
                    and isinstance(placement_of(b), Shard) and _size_on_shard(b) == size]
            if not same:
                return None
            a = same[0]
            continue
        if (a.op != "call_function" or a.target is operator.getitem
                or gmeta.get_vocab_bounds(a, group) is not None):
            return None
        ins = [b for _, b in tensor_args(a) if isinstance(gmeta.get_placements(b), tuple)
               and isinstance(placement_of(b), Shard)]
        if not ins:
            return None
        n_in, n_out = _size_on_shard(ins[0]), _size_on_shard(a)
        if a.target in _VIEWS:
            if not n_in or not n_out or max(n_in, n_out) % min(n_in, n_out):
                return None
            factors.append((n_in, n_out))
        elif n_in != n_out:
            return None
        a = ins[0]
    for n_in, n_out in reversed(factors):  # from the chunked source towards the operand
        if n_out >= n_in:
            k *= n_out // n_in
        else:
            j = n_in // n_out
            k //= math.gcd(k, j)
    return k


_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def _rank_slice_alignment(sl: torch.fx.Node, group: str) -> torch.fx.Node | None:
    """The operand whose rows localization gives rank slice ``sl`` (``localize_shapes._aligned_interval``): the
    node named by its alignment mark, else the first earlier Shard operand of equal size on that dim of a
    consumer of ``sl`` (or of its contiguous copy); None: the torch.chunk block."""
    dim = gmeta.get_rank_slice(sl, group)
    size = sl.args[0].meta["val"].shape[dim]
    position = {n: p for p, n in enumerate(sl.graph.nodes)}
    align = gmeta.get_rank_slice_align(sl, group)
    if align is not None:
        other = next((n for n in sl.graph.nodes if n.name == align), None)
        if other is not None and position[other] < position[sl] and isinstance(gmeta.get_placements(other), tuple) \
                and isinstance(placement_of(other), Shard):
            return other
    mine = {sl} | {u for u in sl.users if u.target is aten.clone.default}
    for user in [c for m in mine for c in m.users]:
        for _, a in tensor_args(user):
            if (a not in mine and position.get(a, len(position)) < position[sl]
                    and isinstance(gmeta.get_placements(a), tuple) and isinstance(placement_of(a), Shard)
                    and _size_on_shard(a) == size):
                return a
    return None


def _convert(graph: torch.fx.Graph, src: torch.fx.Node, target, ctx: PassContext, consumer: torch.fx.Node,
             cache: dict) -> torch.fx.Node:
    cur = placement_of(src)
    groups = (scatter_groups(consumer, src, target, ctx.group_name)
              if isinstance(cur, Partial) and isinstance(target, Shard) else None)
    if isinstance(cur, Shard) and isinstance(target, Shard) and cur != target:
        groups = all_to_all_groups(consumer, src, target, ctx.group_name)
        if groups is not None:
            node = grouped_all_to_all(graph, src, cur.dim, target.dim, groups, ctx, before=consumer)
            cache[(src, target, groups)] = node
            return node
        # the rows the consumer's operands hold on the target dim are not torch.chunk blocks (of groups):
        # gather, then the local slice below takes the rows of the operand it is combined with
    key = (src, target, groups)
    if key in cache:
        return cache[key]
    node = src
    if groups is not None:
        # the rows the consumer's other operands hold are torch.chunk blocks (of groups of rows): a reduce_scatter
        node = grouped_reduce_scatter(graph, src, target.dim, groups, ctx, before=consumer)
        cache[key] = node
        return node
    if isinstance(cur, Partial):
        node = all_reduce(graph, src, ctx.group_name)
        cur = Replicate()
    if isinstance(cur, Shard) and cur != target:  # S -> R (and S(i) -> S(j) whose rows need aligning)
        node = all_gather(graph, src, cur.dim, ctx, before=consumer)
        cur = Replicate()
    if isinstance(target, Shard) and isinstance(cur, Replicate):
        node = rank_slice(graph, node, target.dim, before=consumer, group_name=ctx.group_name)
        shape = src.meta["val"].shape
        if any(s > 1 for s in shape[:target.dim]):
            # a strided slice: some ATen kernels read their inputs' storage as contiguous (measured, torch
            # 2.13 CPU: native_layer_norm_backward with a strided mean/rstd gives wrong gradients)
            with graph.inserting_before(consumer):
                node = add_op(graph, aten.clone.default, (node,), target,
                              kwargs={"memory_format": torch.contiguous_format})
        cur = target
    if cur != target:
        raise UnsupportedOpError(
            f"node {consumer.name!r} ({consumer.target}) needs its input {src.name!r} "
            f"({gmeta.shape_str(src)}) as {target!r} but it is {placement_of(src)!r}; that needs an "
            "all_gather/all_to_all, which data-parallel lowering does not insert yet"
        )
    cache[key] = node
    return node


def insert_redistributes(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Insert collectives for recorded needs; returns ``(gm, changed)``.

    Raises:
        UnsupportedOpError: a needed transition has no collective here yet.
    """
    graph = gm.graph
    cache: dict = {}
    changed = False
    for node in list(graph.nodes):
        needs = gmeta.get_redistribute(node)
        if not needs:
            continue
        args = [list(a) if isinstance(a, (list, tuple)) else a for a in node.args]
        kwargs = dict(node.kwargs)
        for path, layout in sorted(needs.items(), key=lambda kv: str(kv[0])):
            if isinstance(path[0], str):  # a keyword argument (attention's attn_mask)
                src = kwargs[path[0]]
            else:
                src = args[path[0]] if len(path) == 1 else args[path[0]][path[1]]
            if placement_of(src) != layout[0]:
                gmeta.add_resharded(node, src.name, repr(placement_of(src)), repr(layout[0]), ctx.group_name,
                                    via(placement_of(src), layout[0], node, src, ctx.group_name))
            new = _convert(graph, src, layout[0], ctx, node, cache)
            if isinstance(path[0], str):
                kwargs[path[0]] = new
            elif len(path) == 1:
                args[path[0]] = new
            else:
                args[path[0]][path[1]] = new
        node.args = tuple(tuple(a) if isinstance(a, list) and isinstance(node.args[i], tuple) else a
                          for i, a in enumerate(args))
        node.kwargs = kwargs
        gmeta.set_redistribute(node, {})
        changed = True
    return gm, changed
