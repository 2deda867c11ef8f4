"""Pass: statistics and norms over a sharded dim, as partial sums (issue 14 point 1, "opinfo90").

A ``var`` or a vector norm over the sharded batch dim is not a reduction of per-rank values
of the same op, so their rules would gather the whole input. Rewritten here into ops whose
rules keep the shard (sums give ``Partial`` sums, an ``amax`` an all-reduced maximum, see
:mod:`.all_reduce_extrema`), exact for any split of the rows:

* ``var(x, dims, correction=c)`` (``std``, ``var_mean``, ``std_mean``): two passes,
  ``m = sum(x) / N``, ``var = sum((x - m)^2) / (N - c)`` with N the global count (the mean
  all-reduced before the subtraction, the unbiased correction global);
* ``linalg_vector_norm(x, p, dims)`` and ``norm.ScalarOpt_dim``: ``sum(|x|^p)^(1/p)``
  (``p = 2``: ``sqrt(sum(x * x))``), ``p = inf / -inf``: ``amax / amin(|x|)``, ``p = 0``:
  ``sum(x != 0)``; ``dist(a, b, p)`` is ``linalg_vector_norm(a - b, p)``;
* ``trace(x)`` of a matrix sharded by rows or columns: ``sum(where(eye, x, 0))``;
* ``renorm(x, p, dim, maxnorm)`` whose slices span the shard: ATen's formula on the norms above;
* 2-D ``diagonal`` / ``diagonal_backward`` / ``diagonal_scatter`` and ``diag_embed`` of a split vector through
  the diagonal's mask (:func:`_diagonal`: the shard stays where the diagonal runs along the rows, else a
  Partial sum);
* ``_chunk_cat`` where a rank may hold no rows (torch's kernel rejects an empty tensor): pad, view, cat.

The backward graphs of these ops read only the op's output (replicated once reduced) and the
sharded input elementwise, so they keep the shard already. Needs placements; run
``propagate_placements`` again afterwards.

Before/after (global shapes, batch 5 over 2 ranks)::

    var = aten.var.correction(x, None, correction=1)       # x: f32[5, 5] S(0): gathered
    # becomes
    s = aten.sum.dim_IntList(x, [0, 1], True)               # P(sum)
    m = aten.div.Tensor(s, 25.0)                            # P(sum) -> all_reduce where used
    d = aten.sub.Tensor(x, m); q = aten.mul.Tensor(d, d)    # S(0)
    var = aten.div.Tensor(aten.sum.dim_IntList(q, [0, 1], False), 24.0)   # P(sum)
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from ..placement import Shard
from .context import PassContext
from .infra import placement_of

aten = torch.ops.aten

_VAR = {aten.var.correction: "var", aten.std.correction: "std", aten.var_mean.correction: "var_mean",
        aten.std_mean.correction: "std_mean"}


def _dims(dims, nd: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(nd))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d % nd for d in dims) if nd else []


def _sharded_on(node, dims: list[int]) -> bool:
    p = placement_of(node) if isinstance(node, torch.fx.Node) else None
    return isinstance(p, Shard) and p.dim in dims


class _Builder:
    """Adds nodes before ``at`` with fake values and ``at``'s trace metadata."""

    def __init__(self, graph: torch.fx.Graph, at: torch.fx.Node):
        self.graph, self.at = graph, at

    def __call__(self, target, *args, **kwargs) -> torch.fx.Node:
        with self.graph.inserting_before(self.at):
            n = self.graph.call_function(target, tuple(args), kwargs)
        for key in ("stack_trace", "nn_module_stack", "seq_nr"):
            if key in self.at.meta:
                n.meta[key] = self.at.meta[key]
        # factories (arange, eye) have no fake input to take the mode from: the replaced node's
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
        with _fake_mode(self.at):
            n.meta["val"] = target(*args, **kwargs)
        return n


def _fake_mode(node: torch.fx.Node):
    from .._torch_compat import tree_leaves

    for v in tree_leaves(node.meta.get("val")):
        if getattr(v, "fake_mode", None) is not None:
            return v.fake_mode
    for a in node.all_input_nodes:
        for v in tree_leaves(a.meta.get("val")):
            if getattr(v, "fake_mode", None) is not None:
                return v.fake_mode
    raise AssertionError(f"node {node.name} has no fake value")


def _var(b: _Builder, x, dims: list[int], correction: float, keepdim: bool, shape) -> tuple:
    """(var, mean) of ``x`` over ``dims`` by two passes; mean with ``keepdim``."""
    count = float(math.prod(shape[d] for d in dims))
    mean_k = b(aten.div.Tensor, b(aten.sum.dim_IntList, x, dims, True), count)
    dev = b(aten.sub.Tensor, x, mean_k)
    ss = b(aten.sum.dim_IntList, b(aten.mul.Tensor, dev, dev), dims, keepdim)
    var = b(aten.div.Tensor, ss, max(count - correction, 0.0))
    mean = mean_k if keepdim else b(aten.div.Tensor, b(aten.sum.dim_IntList, x, dims, False), count)
    return var, mean


def _norm(b: _Builder, x, ord_, dims: list[int], keepdim: bool, dtype) -> torch.fx.Node:
    """The vector ``ord_``-norm of ``x`` over ``dims`` from sums (or amax/amin) of its elements."""
    if dtype is not None and dtype != x.meta["val"].dtype:
        x = b(aten._to_copy.default, x, dtype=dtype)
    p = 2.0 if ord_ is None else float(ord_)
    if p == 2.0:
        return b(aten.sqrt.default, b(aten.sum.dim_IntList, b(aten.mul.Tensor, x, x), dims, keepdim))
    a = b(aten.abs.default, x)
    if p == math.inf:
        return b(aten.amax.default, a, dims, keepdim)
    if p == -math.inf:
        return b(aten.amin.default, a, dims, keepdim)
    if p == 0.0:
        nz = b(aten.ne.Scalar, x, 0)
        return b(aten.sum.dim_IntList, nz, dims, keepdim, dtype=x.meta["val"].dtype)
    if p == 1.0:
        return b(aten.sum.dim_IntList, a, dims, keepdim)
    s = b(aten.sum.dim_IntList, b(aten.pow.Tensor_Scalar, a, p), dims, keepdim)
    return b(aten.pow.Tensor_Scalar, s, 1.0 / p)


def _kw(node: torch.fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def globalize_statistics(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Rewrite var/std, vector norms, dist, trace and diagonals over sharded dims; returns ``(gm, changed)``.

    A rewrite can shard what the ops before it had gathered (the backward of a diagonal, which the forward's
    gather had replicated): after one, placements are propagated again and the graph swept again, until
    nothing changes (at most a few sweeps: each rewrites ops whose inputs became sharded)."""
    from .propagate_placements import propagate_placements

    diagonals: set = set()  # (shape, offset, dim1, dim2) of the diagonals rewritten: their backward follows
    changed = False
    for _ in range(4):
        if not _sweep(gm, ctx, diagonals):
            break
        changed = True
        gm.graph.lint()
        gm, _ = propagate_placements(gm, ctx)
    return gm, changed


def _sweep(gm: torch.fx.GraphModule, ctx: PassContext, diagonals: set) -> bool:
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        b = _Builder(graph, node)
        new = None
        if node.target in _VAR:
            x = node.args[0]
            shape = x.meta["val"].shape
            dims = _dims(_kw(node, 1, "dim"), len(shape))
            if not _sharded_on(x, dims) or not x.meta["val"].is_floating_point():
                continue
            corr = node.kwargs.get("correction", None)
            corr = 1.0 if corr is None else float(corr)
            var, mean = _var(b, x, dims, corr, bool(node.kwargs.get("keepdim", False)), shape)
            kind = _VAR[node.target]
            first = b(aten.sqrt.default, var) if kind.startswith("std") else var
            if kind in ("var", "std"):
                new = first
            else:
                for u in list(node.users):
                    assert u.target is operator.getitem, u
                    u.replace_all_uses_with(first if u.args[1] == 0 else mean)
                    graph.erase_node(u)
                graph.erase_node(node)
                changed = True
                continue
        elif node.target in (aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim, aten.dist.default):
            if node.target == aten.dist.default:
                a, c = node.args[0], node.args[1]
                if not (_sharded_on(a, list(range(a.meta["val"].dim())))
                        or _sharded_on(c, list(range(c.meta["val"].dim())))) or not a.meta["val"].is_floating_point():
                    continue
                x = b(aten.sub.Tensor, a, c)  # every dim is reduced: the shard of a or c is on one of them
                ord_, dims, keepdim, dtype = _kw(node, 2, "p", 2), list(range(x.meta["val"].dim())), False, None
            else:
                x = node.args[0]
                nd = x.meta["val"].dim()
                if node.target == aten.norm.ScalarOpt_dim:
                    ord_, dims, keepdim, dtype = _kw(node, 1, "p"), _dims(_kw(node, 2, "dim"), nd), \
                        bool(_kw(node, 3, "keepdim", False)), None
                else:
                    ord_, dims = _kw(node, 1, "ord", 2), _dims(_kw(node, 2, "dim"), nd)
                    keepdim, dtype = bool(_kw(node, 3, "keepdim", False)), node.kwargs.get("dtype")
                if not _sharded_on(x, dims):
                    continue
            if not x.meta["val"].is_floating_point():
                continue
            new = _norm(b, x, ord_, dims, keepdim, dtype)
        elif node.target == aten.trace.default:
            x = node.args[0]
            if not _sharded_on(x, [0, 1]):
                continue
            n, m = x.meta["val"].shape
            eye = b(aten.eye.m, n, m, dtype=torch.bool, device=x.meta["val"].device)
            zero = b(aten.scalar_tensor.default, 0.0, dtype=x.meta["val"].dtype, device=x.meta["val"].device)
            new = b(aten.sum.default, b(aten.where.self, eye, x, zero))
        elif node.target in (aten.diagonal.default, aten.diagonal_copy.default, aten.diagonal_backward.default,
                             aten.diagonal_scatter.default, aten.diag_embed.default):
            new = _diagonal(b, node, diagonals)
        elif node.target == aten.renorm.default:
            x, p, dim, maxnorm = node.args[:4]
            nd = x.meta["val"].dim()
            dims = [d for d in range(nd) if d != dim % nd]
            if not _sharded_on(x, dims) or not x.meta["val"].is_floating_point():
                continue
            # ATen's renorm: factor = where(norm > maxnorm, maxnorm / (norm + 1e-7), 1), norm in float64
            norm = _norm(b, x, p, dims, True, torch.float64)
            big = b(aten.gt.Scalar, norm, maxnorm)
            scale = b(aten.mul.Tensor, b(aten.reciprocal.default, b(aten.add.Scalar, norm, 1e-7)), float(maxnorm))
            one = b(aten.scalar_tensor.default, 1.0, dtype=torch.float64, device=x.meta["val"].device)
            factor = b(aten._to_copy.default, b(aten.where.self, big, scale, one), dtype=x.meta["val"].dtype)
            new = b(aten.mul.Tensor, x, factor)
        elif node.target == aten._chunk_cat.default:
            new = _chunk_cat(b, node, ctx)
        if new is None:
            continue
        if new.meta["val"].dtype != node.meta["val"].dtype:
            new = b(aten._to_copy.default, new, dtype=node.meta["val"].dtype)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        changed = True
    return changed


def _diagonal(b: _Builder, node: torch.fx.Node, done: set) -> torch.fx.Node | None:
    """Diagonals of a 2-D ``x`` sharded on one of the two dims, through the diagonal's mask ``M`` (replicated,
    sliced to the rows; ``M[a, b]``: ``b - a == k`` along ``(dim1, dim2)``). None where none applies.

    * ``diagonal(x, k)`` whose index runs along the sharded dim with its rows (every row of that dim holds one
      element: ``L`` equals its size): the row sum ``sum(where(M, x, 0), other dim)`` keeps the shard, no
      collective; otherwise the sum over the sharded dim, sliced to the diagonal: a Partial sum;
    * ``diagonal_backward(g)`` of an aligned diagonal (in ``done``; its gradient was laid out before the
      forward was rewritten): ``where(M, g[:, None], 0)``, right for any placement of ``g``;
    * ``diagonal_scatter(x, src, k)``: ``where(M, src placed along the diagonal's dim, x)`` (keeps the shard);
    * ``diag_embed(v)`` of a 1-D sharded ``v``, offset 0: ``where(eye, v[:, None], 0)`` (keeps the shard).
    """
    t = node.target
    dev = node.meta["val"].device
    if t == aten.diag_embed.default:
        v = node.args[0]
        if (v.meta["val"].dim() != 1 or placement_of(v) != Shard(0) or any(node.args[1:2])
                or not v.meta["val"].is_floating_point()):
            return None
        n = v.meta["val"].shape[0]
        eye = b(aten.eye.default, n, dtype=torch.bool, device=dev)
        zero = b(aten.scalar_tensor.default, 0.0, dtype=node.meta["val"].dtype, device=dev)
        return b(aten.where.self, eye, b(aten.unsqueeze.default, v, 1), zero)
    if t == aten.diagonal_backward.default:
        g, sizes, k, d1, d2 = node.args[:5]
        src, shape = g, tuple(sizes)
    elif t == aten.diagonal_scatter.default:
        src = node.args[0]
        shape = tuple(src.meta["val"].shape)
        k, d1, d2 = _kw(node, 2, "offset", 0), _kw(node, 3, "dim1", 0), _kw(node, 4, "dim2", 1)
    else:
        src = node.args[0]
        shape = tuple(src.meta["val"].shape)
        k, d1, d2 = _kw(node, 1, "offset", 0), _kw(node, 2, "dim1", 0), _kw(node, 3, "dim2", 1)
    if len(shape) != 2 or not node.meta["val"].is_floating_point():
        return None
    d1, d2 = d1 % 2, d2 % 2
    rows = d1 if k >= 0 else d2  # the dim along which the diagonal's index runs without an offset
    length = max(0, min(shape[d1], shape[d2] - k) if k >= 0 else min(shape[d1] + k, shape[d2]))
    key = (shape, k, d1, d2)
    p = placement_of(src)
    if t == aten.diagonal_backward.default:
        if length != shape[rows] or key not in done:
            return None
    elif not isinstance(p, Shard):
        return None
    i0 = b(aten.unsqueeze.default, b(aten.arange.default, shape[0], dtype=torch.int64, device=dev), 1)
    i1 = b(aten.unsqueeze.default, b(aten.arange.default, shape[1], dtype=torch.int64, device=dev), 0)
    diff = b(aten.sub.Tensor, i1, i0) if d1 == 0 else b(aten.sub.Tensor, i0, i1)  # index along dim2 - along dim1
    mask = b(aten.eq.Scalar, diff, k)
    zero = b(aten.scalar_tensor.default, 0.0, dtype=node.meta["val"].dtype, device=dev)
    if t == aten.diagonal_backward.default:
        return b(aten.where.self, mask, b(aten.unsqueeze.default, g, 1 - rows), zero)
    if t == aten.diagonal_scatter.default:
        upd = node.args[1]
        if shape[rows] != length:
            upd = b(aten.constant_pad_nd.default, upd, [0, shape[rows] - length], 0.0)
        return b(aten.where.self, mask, b(aten.unsqueeze.default, upd, 1 - rows), src)
    masked = b(aten.where.self, mask, src, zero)
    if length == shape[rows] and p == Shard(rows):
        done.add(key)
        return b(aten.sum.dim_IntList, masked, [1 - rows])
    # the sum over the sharded dim s leaves the other dim o: v[j] holds the diagonal's element at index j of o
    o = 1 - p.dim
    start = (max(k, 0) if o == d2 else max(-k, 0))
    v = b(aten.sum.dim_IntList, masked, [p.dim])
    return b(aten.slice.Tensor, v, 0, start, start + length)


def _chunk_cat(b: _Builder, node: torch.fx.Node, ctx: PassContext) -> torch.fx.Node | None:
    """``_chunk_cat(tensors, dim, n)`` sharded on a dim before ``dim`` where a rank may hold no rows (torch's
    kernel rejects an empty tensor): each tensor padded with zeros on ``dim`` to ``n`` chunks of
    ``ceil(size / n)``, viewed as ``[*lead, n, -]`` and concatenated on the last dim, as the kernel does."""
    from ..placement import chunk_interval

    tensors, dim, n = node.args[:3]
    nd = tensors[0].meta["val"].dim()
    dim = dim % nd
    ps = [placement_of(t) for t in tensors]
    if not all(isinstance(p, Shard) and p.dim < dim for p in ps):
        return None
    size = tensors[0].meta["val"].shape[ps[0].dim]
    if not (any(s == e for s, e in (chunk_interval(size, ctx.axis_size, r) for r in range(ctx.axis_size)))
            or (size == ctx.batch_size and 0 in ctx.shard_sizes())):
        return None
    pieces = []
    for t in tensors:
        shape = list(t.meta["val"].shape)
        chunk = -(-shape[dim] // n)
        pad = [0, 0] * (nd - 1 - dim) + [0, chunk * n - shape[dim]]
        padded = b(aten.constant_pad_nd.default, t, pad, 0.0) if chunk * n != shape[dim] else t
        pieces.append(b(aten.view.default, padded, shape[:dim] + [n, chunk * math.prod(shape[dim + 1:])]))
    return b(aten.cat.default, pieces, dim + 1)
