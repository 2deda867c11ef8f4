"""Fold an index of the batch rows by ``torch.arange(batch)`` into an index that keeps the batch dim (at capture).

Hugging Face's masks (``transformers.masking_utils``: BART, BERT, LLaMA... with a padding mask) read the padding
mask ``m [B, T]`` as ``m[arange(B)[:, None, None, None], kv[None, None, None, :]]``: row ``b`` of the result is
row ``b`` of ``m``, but the op indexes the batch dim with a whole-batch constant, so under a batch split every
rank (or pipeline microbatch) would need the whole mask and cut its own rows out at its own offset — the
microbatches' programs differ, and a pipeline plan is refused. Where the first index is ``arange(x.shape[0])``
laid along the leading dim of the indices' broadcast shape (``[B, 1, ..., 1]``, checked by evaluating the
constant: :func:`~adaptdist.fx_constants.constant_value`) and every other index is constant along that dim
(size 1 there, or fewer dims), ``x[arange(B), i1, ...][b] == x[b][i1[0], ...]``: the op becomes
``x[:, i1[0], ...]`` (``None`` for the batch dim, whose sharding rule keeps ``Shard(0)``), reshaped to the old
shape. The backward's ``index_put`` / ``_unsafe_index_put`` of the same indices folds the same way. An index
whose other indices vary with the row (``out[torch.arange(B), target]``) is left alone.

Before/after (BART's padding mask, B = 8, T = 8)::

    index = aten.index.Tensor(mask, [rows, kv])      # mask: i64[8, 8]; rows = arange(8)[:, None, None, None]
                                                     # kv: i64[1, 1, 1, 8]; index: i64[8, 1, 1, 8]
    # becomes
    squeeze = aten.squeeze.dim(kv, 0)                # i64[1, 1, 8]
    index = aten.index.Tensor(mask, [None, squeeze]) # i64[8, 1, 1, 8]
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from ..fx_constants import constant_value

aten = torch.ops.aten

_INDEX = {aten.index.Tensor, aten._unsafe_index.Tensor}
_INDEX_PUT = {aten.index_put.default, aten._unsafe_index_put.default}


def _val(n: Any) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _is_row_arange(i0: Any, rows: int, nd: int) -> bool:
    """Whether index ``i0`` is ``arange(rows)`` of shape ``[rows, 1, ..., 1]`` (``nd`` dims)."""
    v = _val(i0)
    if v is None or v.dim() != nd or list(v.shape) != [rows] + [1] * (nd - 1) or v.dtype not in (torch.int64, torch.int32):
        return False
    t = constant_value(i0)
    return t is not None and torch.equal(t.reshape(-1).long(), torch.arange(rows))


def _foldable(x: Any, indices: Any) -> list[torch.fx.Node] | None:
    """The other indices when ``x[indices]`` reads row b of ``x`` into row b of the result (module docstring)."""
    xv = _val(x)
    if xv is None or xv.dim() == 0 or not isinstance(indices, (list, tuple)) or len(indices) < 2:
        return None
    vals = [_val(i) for i in indices]
    if any(v is None or v.dtype in (torch.bool, torch.uint8) for v in vals):
        return None  # a None index or a mask: not this form
    nd = max(v.dim() for v in vals)
    if any(v.dim() == nd and v.shape[0] != 1 for v in vals[1:]):
        return None  # another index varies with the row
    if not _is_row_arange(indices[0], xv.shape[0], nd):
        return None
    return list(indices[1:])


def _squeezed(graph: torch.fx.Graph, idx: torch.fx.Node, nd: int, before: torch.fx.Node) -> torch.fx.Node:
    """``idx`` without the leading (size-1) dim of the ``nd``-dim broadcast frame."""
    v = _val(idx)
    if v.dim() < nd:
        return idx
    with graph.inserting_before(before):
        out = graph.call_function(aten.squeeze.dim, (idx, 0))
    out.meta["val"] = v.squeeze(0)
    return out


def _reshaped(graph: torch.fx.Graph, x: torch.fx.Node, shape: list[int], before: torch.fx.Node) -> torch.fx.Node:
    v = _val(x)
    if list(v.shape) == list(shape):
        return x
    with graph.inserting_before(before):
        out = graph.call_function(aten.reshape.default, (x, list(shape)))
    out.meta["val"] = v.reshape(shape)
    return out


def fold_batch_arange_index(gm: torch.fx.GraphModule) -> int:
    """Rewrite every ``index`` / ``index_put`` of ``gm`` whose first index is ``arange`` over the indexed rows
    (module docstring) into one with ``None`` for that dim, in place; returns how many were rewritten (``gm``
    is recompiled if any)."""
    graph = gm.graph
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or (node.target not in _INDEX and node.target not in _INDEX_PUT):
            continue
        x, indices = node.args[0], node.args[1]
        others = _foldable(x, indices)
        if others is None:
            continue
        nd = max(_val(i).dim() for i in indices)
        xv = _val(x)
        squeezed = [_squeezed(graph, i, nd, node) for i in others]
        new_indices = [None, *squeezed]
        if node.target in _INDEX:
            out = _val(node)
            if out is None:
                continue
            node.args = (x, new_indices, *node.args[2:])
            with graph.inserting_after(node):
                user = graph.call_function(aten.reshape.default, (node, list(out.shape)))
            frame = torch.broadcast_shapes(*(tuple(_val(i).shape) for i in squeezed))
            new_shape = [xv.shape[0], *frame, *xv.shape[len(indices):]]
            if math.prod(new_shape) != out.numel():
                node.args = (x, list(indices), *node.args[2:])  # not the shapes expected: leave it
                graph.erase_node(user)
                continue
            node.meta["val"] = out.reshape(new_shape)
            user.meta["val"] = out
            if list(new_shape) != list(out.shape):
                node.replace_all_uses_with(user, delete_user_cb=lambda u: u is not user)
            else:
                graph.erase_node(user)
        else:  # index_put(base, indices, values, accumulate): the values in the new index's shape
            values = node.args[2]
            vv = _val(values)
            frame = torch.broadcast_shapes(*(tuple(_val(i).shape) for i in squeezed))
            new_shape = [xv.shape[0], *frame, *xv.shape[len(indices):]]
            if vv is None or math.prod(new_shape) != vv.numel() or vv.dim() != nd + xv.dim() - len(indices):
                continue  # values broadcast into the indexed shape: leave it
            node.args = (x, new_indices, _reshaped(graph, values, new_shape, node), *node.args[3:])
        folded += 1
    if folded:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    return folded
