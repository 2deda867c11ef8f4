"""Reorder the rows of a merge that puts the batch inside another dim (at capture), so the batch split survives it.

``nn.MultiheadAttention(batch_first=True)`` transposes its input to ``[T, B, D]`` and merges ``T`` and the batch
``B`` into rows ``[T*B, D]`` for its projections (``linear`` on a 3-d input, and ``attn_output.transpose(0, 1)
.contiguous().view(T * B, E)`` before ``out_proj``), then views the rows back to ``[T, B, E]``. With the batch
split over ranks, ``B`` is the inner dim of the merge: the global rows a rank holds are strided, not a
``Shard(0)`` block, so the view rule gathers the activation and every rank computes the whole batch from there.

The rows in between are only ever used row by row (a matmul with them as rows, elementwise ops, the view back)
or summed over (a weight gradient ``mm(t(g), x)``, a bias gradient ``sum(g, [0])``). Such a region computes the
same values whatever order its rows are in; this rewrite puts them in ``(b, t)`` order: each merge
``[A, B, *r] -> [A*B, *r]`` (its input read as ``[A, B, *r]``) becomes ``transpose(.., 0, 1)`` then the merge
``[B*A, *r]``, and each view back ``[A*B, *r'] -> [A, ...]`` reads the rows as ``[B, A, *r']`` and transposes
them back. The batch is then the outer dim of every merge, and the view rules keep it split (``Shard(0)`` of
the rows, ``Shard(1)`` of ``[T, B, E]``). Only the summation order of the row sums changes (within float
rounding of eager).

A region is rewritten only when every use of every row tensor in it is one of: elementwise (``torch.Tag.
pointwise``, clone/detach/alias/``_to_copy``) with the other operands rows of the same region or broadcast over
the rows; ``t``/2-d ``transpose``; ``mm``/``addmm`` with the rows as the rows of the product (the other operand
not a row tensor) or contracting two row tensors of the region; ``sum`` over the rows; a view back. Anything
else (a row tensor returned, indexed, gathered, sliced, reduced otherwise, views of other shapes) leaves the
whole region as it was. And only where a batch split would lose the split: under a data-parallel sweep of the
sharding rules (batch inputs ``Shard(0)``), some merge of the region reads its input ``Shard(1)`` and none
reads it sharded otherwise.

Before/after (``out_proj`` of ``nn.MultiheadAttention``, T=6, B=8, E=64)::

    view = aten.view(clone, [48, 64])              # clone: f32[6, 8, 64]  (dp: S(1) -> gathered)
    addmm = aten.addmm(b, view, t)
    view_1 = aten.view(addmm, [6, 8, 64])
    # becomes
    reshape = aten.reshape(clone, [6, 8, 64]); transpose = aten.transpose(reshape, 0, 1)
    clone_1 = aten.clone(transpose, memory_format=torch.contiguous_format)
    view = aten.view(clone_1, [48, 64])            # rows (b, t): dp S(0)
    addmm = aten.addmm(b, view, t)
    reshape_1 = aten.reshape(addmm, [8, 6, 64]); transpose_1 = aten.transpose(reshape_1, 0, 1)
    clone_2 = aten.clone(transpose_1, memory_format=torch.contiguous_format)
    view_1 = aten.view(clone_2, [6, 8, 64])        # dp S(1)
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.fx

from .. import graph_meta as gmeta

log = logging.getLogger("adaptdist.compiler")
aten = torch.ops.aten

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_IDENTITY = (aten.clone.default, aten.detach.default, aten.alias.default, aten._to_copy.default)


def _shape(n: Any) -> tuple[int, ...] | None:
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    if not isinstance(v, torch.Tensor) or not all(isinstance(s, int) for s in v.shape):
        return None
    return tuple(v.shape)


def _merge(node: torch.fx.Node) -> tuple[int, int] | None:
    """``(A, B)`` where ``node`` is a view of ``[A, B*m, ...]`` into ``[A*B, *r]`` (A, B > 1), else None."""
    if node.op != "call_function" or node.target not in _VIEWS or not isinstance(node.args[0], torch.fx.Node):
        return None
    si, so = _shape(node.args[0]), _shape(node)
    if si is None or so is None or len(si) < 2 or len(so) < 1:
        return None
    a = si[0]
    if a <= 1 or so[0] % a or so[0] == a:
        return None
    b = so[0] // a
    if b <= 1 or si[1] % b or math.prod(si) != math.prod(so):
        return None
    return a, b


def _split_back(node: torch.fx.Node, ab: tuple[int, int]) -> bool:
    """Whether ``node`` views rows ``[A*B, *r]`` back into ``[A, B*m, ...]``."""
    if node.op != "call_function" or node.target not in _VIEWS:
        return False
    si, so = _shape(node.args[0]), _shape(node)
    a, b = ab
    return (si is not None and so is not None and len(so) >= 2 and si[0] == a * b and so[0] == a
            and so[1] % b == 0 and math.prod(si) == math.prod(so))


def _elementwise(t: Any) -> bool:
    """Whether op ``t`` computes each output element from the same element of its inputs, deterministically."""
    tags = getattr(t, "tags", ())
    return t in _IDENTITY or (torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags)


def _dp_placements(gm: torch.fx.GraphModule) -> dict:
    """Each node's placement under a data-parallel sweep of the sharding rules on 2 ranks (best effort)."""
    from ..placement import Replicate, Shard
    from ..passes.sharding_rules import apply_rule

    rep = Replicate()
    pl: dict = {}
    get = lambda a: pl.get(a, rep)  # noqa: E731
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            s = _shape(node)
            pl[node] = Shard(0) if gmeta.get_role(node) == "batch" and s and s[0] > 1 else rep
        elif node.op == "call_function":
            try:
                pl[node] = apply_rule(node, get, 2).out
            except Exception:  # noqa: BLE001 - a best-effort sweep: an op it cannot place counts as replicated
                v = node.meta.get("val")
                pl[node] = tuple(rep for _ in v) if isinstance(v, (tuple, list)) else rep
    return pl


class _Regions:
    """Row tensors (node -> the dim its rows are on) grouped into regions by union-find."""

    def __init__(self):
        self.rowdim: dict[torch.fx.Node, int] = {}
        self.parent: dict[torch.fx.Node, torch.fx.Node] = {}
        self.ab: dict[torch.fx.Node, tuple[int, int]] = {}
        self.bad: set[torch.fx.Node] = set()

    def find(self, n):
        while self.parent[n] is not n:
            self.parent[n] = self.parent[self.parent[n]]
            n = self.parent[n]
        return n

    def add(self, n, dim, ab, like=None) -> bool:
        """Add ``n`` (rows on ``dim``); False when it is already there with rows on another dim."""
        if n in self.rowdim:
            if like is not None:
                self.union(n, like)
            if self.rowdim[n] != dim:
                self.fail(n)
            return False
        self.rowdim[n], self.parent[n], self.ab[n] = dim, n, ab
        if like is not None:
            self.union(n, like)
        return True

    def union(self, x, y):
        rx, ry = self.find(x), self.find(y)
        if rx is ry:
            return
        self.parent[ry] = rx
        if self.ab[rx] != self.ab[ry] or ry in self.bad:
            self.bad.add(rx)

    def fail(self, n):
        self.bad.add(self.find(n))


def _other_ok(regions: _Regions, a: Any, out_shape: tuple[int, ...], k: int, ab) -> bool | None:
    """For an elementwise op with output rows on dim ``k``: True when ``a`` broadcasts over the rows, None when
    ``a`` is a row tensor (same dim, checked by the caller), False otherwise."""
    if not isinstance(a, torch.fx.Node):
        return True
    s = _shape(a)
    if s is None:
        return False
    pos = k - (len(out_shape) - len(s))
    if pos < 0 or s[pos] == 1:
        return True
    if a in regions.rowdim and pos == k and len(s) == len(out_shape):
        return None
    return False


def reorder_batch_inner_merges(gm: torch.fx.GraphModule) -> int:
    """Rewrite every region of rows merged with the batch inside (module docstring) in place; returns how many
    merges were rewritten (``gm`` is recompiled if any)."""
    seeds = {n: ab for n in gm.graph.nodes if (ab := _merge(n)) is not None}
    if not seeds:
        return 0
    regions = _Regions()
    exits: dict[torch.fx.Node, torch.fx.Node] = {}  # view back -> a row tensor of its region
    matmuls: set[torch.fx.Node] = set()  # checked once every row tensor is known
    work = [n for n in seeds if regions.add(n, 0, seeds[n])]
    while work:
        r = work.pop()
        k, ab = regions.rowdim[r], regions.ab[r]
        for u in list(r.users):
            if u.op != "call_function":
                regions.fail(r)
                continue
            t = u.target
            so = _shape(u)
            if t in _VIEWS and k == 0 and u.args[0] is r and _split_back(u, ab):
                exits[u] = r
            elif t in _VIEWS and u in seeds and u.args[0] is r:
                regions.fail(r)  # a merge of rows again
            elif t in (aten.t.default, aten.transpose.int) and so is not None and len(so) == 2:
                if regions.add(u, 1 - k, ab, like=r):
                    work.append(u)
            elif t is aten.mm.default or (t is aten.addmm.default and u.args[1] is r):
                a, b = (u.args[0], u.args[1]) if t is aten.mm.default else (u.args[1], u.args[2])
                matmuls.add(u)
                if a is r and k == 0 and a is not b:
                    if regions.add(u, 0, ab, like=r):
                        work.append(u)
                elif b is r and k == 1 and a is not b and t is aten.mm.default:
                    if regions.add(u, 1, ab, like=r):
                        work.append(u)
            elif t is aten.sum.dim_IntList and u.args[0] is r:
                dims = u.args[1] if len(u.args) > 1 else None
                nd = len(_shape(r) or ())
                if not isinstance(dims, (list, tuple)) or [d % nd for d in dims] != [k] or len(u.args) > 3 or u.kwargs:
                    regions.fail(r)
            elif _elementwise(t) and so is not None and so == _shape(r):
                if regions.add(u, k, ab, like=r):
                    work.append(u)
            else:
                regions.fail(r)
    for u in matmuls:
        a, b = (u.args[0], u.args[1]) if u.target is aten.mm.default else (u.args[1], u.args[2])
        ka, kb = regions.rowdim.get(a), regions.rowdim.get(b)
        involved = [x for x in (a, b, u) if x in regions.rowdim]
        ok = a is not b and not u.kwargs
        if u.target is aten.addmm.default:
            bs = _shape(u.args[0])
            ok = ok and u.args[0] not in regions.rowdim and bs is not None and (
                len(bs) == 1 or (len(bs) == 2 and bs[0] == 1))
        k = regions.rowdim.get(u)
        if k == 0:
            ok = ok and ka == 0 and kb is None
        elif k == 1:
            ok = ok and kb == 1 and ka is None and u.target is aten.mm.default
        else:
            ok = ok and ka == 1 and kb == 0 and u.target is aten.mm.default  # rows contracted: a row sum
            if ok:
                regions.union(a, b)
        if not ok:
            for x in involved:
                regions.fail(x)
    # the other operands of every elementwise op: broadcast over the rows, or rows of the same region
    for u, k in list(regions.rowdim.items()):
        if u in seeds or not _elementwise(u.target):
            continue
        so = _shape(u)
        for a in [*u.args, *u.kwargs.values()]:
            if isinstance(a, (list, tuple)):
                if any(isinstance(x, torch.fx.Node) for x in a):
                    regions.fail(u)
                continue
            ok = _other_ok(regions, a, so, k, regions.ab[u])
            if ok is False:
                regions.fail(u)
            elif ok is None:
                if regions.rowdim[a] != k:
                    regions.fail(u)
                regions.union(u, a)
    bad = {regions.find(b) for b in regions.bad}
    if not {regions.find(v) for v in seeds} - bad:
        return 0
    # a region is worth it where a batch split (dp sweep) reads some merge's input Shard(1), none sharded otherwise
    from ..placement import Replicate, Shard

    pl = _dp_placements(gm)
    helps: dict[torch.fx.Node, bool] = {}
    for v in seeds:
        root, p = regions.find(v), pl.get(v.args[0])
        if isinstance(p, Shard) and p.dim == 1:
            helps.setdefault(root, True)
        elif not isinstance(p, Replicate):
            helps[root] = False  # sharded otherwise, or partial: leave the region as it is
    chosen = {root for root, ok in helps.items() if ok and root not in bad}
    rewritten = 0
    g = gm.graph
    for v in [n for n in seeds if regions.find(n) in chosen]:
        a, b = seeds[v]
        x = v.args[0]
        rest = list(_shape(v)[1:])
        v.args = (_swap_outer(g, x, a, b, rest, v), [b * a, *rest], *v.args[2:])
        rewritten += 1
    for e, r in exits.items():
        if regions.find(r) not in chosen:
            continue
        a, b = regions.ab[r]
        y = e.args[0]
        rest = list(_shape(y)[1:])
        e.args = (_swap_outer(g, y, b, a, rest, e), *e.args[1:])
    if rewritten:
        log.info("reordered %d merge(s) of rows with the batch inside, the batch outer", rewritten)
        g.lint()
        gm.recompile()
    return rewritten


def _call(g: torch.fx.Graph, target: Any, args: tuple, like: torch.fx.Node, kwargs: dict | None = None
          ) -> torch.fx.Node:
    """A new node computing ``target(*args)``, its ``val`` computed on the fake inputs, the rest of its meta
    (source, module stack) taken from ``like``."""
    n = g.call_function(target, args, kwargs or {})
    for key, value in like.meta.items():
        if key not in ("val", "tensor_meta", "example_value"):
            n.meta[key] = value
    fake = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    n.meta["val"] = target(*fake, **(kwargs or {}))
    return n


def _swap_outer(g: torch.fx.Graph, x: torch.fx.Node, p: int, q: int, rest: list, before: torch.fx.Node
                ) -> torch.fx.Node:
    """Nodes, inserted before ``before``, that read ``x`` as ``[p, q, *rest]`` and give it as a contiguous
    ``[q, p, *rest]`` (reshape, transpose(0, 1), clone): a merge's rows reordered to (b, t) on the way in, and back
    on the way out."""
    with g.inserting_before(before):
        x1 = _call(g, aten.reshape.default, (x, [p, q, *rest]), before)
        x2 = _call(g, aten.transpose.int, (x1, 0, 1), before)
        return _call(g, aten.clone.default, (x2,), before, {"memory_format": torch.contiguous_format})
