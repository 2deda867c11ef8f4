"""Fold the ``as_strided`` ops of a captured joint graph that are reshapes into ``reshape`` (at capture).

``as_strided(x, size, stride, offset)`` reads ``x``'s memory with explicit strides, which means nothing on a
shard of ``x``: no sharding rule can take it. Functionalization emits it for plain reshapes, though: a
restride that only moves size-1 dims (``adaptive_avg_pool``'s output, kept ``[B, C, 1, 1]``: Hugging Face
Swin's pooler), and, in the backward, the replay of a view over a fresh buffer (``new_zeros([B * C])`` viewed
as ``[B, C]``, written whole by ``as_strided_scatter``, viewed again). Where the input is contiguous, starts
its memory and the strides are the row-major ones of ``size`` (any stride on a size-1 dim), ``as_strided``
reads the input's elements in row-major order: it is ``reshape(x, size)``. An ``as_strided_scatter(base, src,
size, stride, offset)`` of that kind over all of ``base`` overwrites every element: it is ``reshape(src,
base.shape)``. The view rules then shard them like any reshape (the batch dim split into whole rows).

Any other ``as_strided`` is left alone; its sharding rule (``passes/sharding_rules.as_strided``) refuses it on
a sharded input, naming the op and what to write instead.

Before/after (Swin's pooler and its backward, batch 4, 16 channels)::

    as_strided = aten.as_strided(mean, [4, 16, 1, 1], [16, 1, 16, 16])     # mean: f32[4, 16, 1, 1] contiguous
    new_zeros = aten.new_zeros(g, [64])
    as_strided_1 = aten.as_strided(new_zeros, [4, 16], [16, 1], 0)
    copy = aten.copy(as_strided_1, g)
    as_strided_scatter = aten.as_strided_scatter(new_zeros, copy, [4, 16], [16, 1], 0)
    # becomes
    as_strided = aten.reshape(mean, [4, 16, 1, 1])
    as_strided_1 = aten.reshape(new_zeros, [4, 16])
    copy = aten.copy(as_strided_1, g)
    as_strided_scatter = aten.reshape(copy, [64])
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

aten = torch.ops.aten


def row_major_strides(size: list[int]) -> list[int]:
    """The contiguous (row-major) strides of ``size``, in elements."""
    out, step = [], 1
    for n in reversed(size):
        out.append(step)
        step *= max(int(n), 1)
    return out[::-1]


def _is_row_major(size: Any, stride: Any) -> bool:
    """Whether ``stride`` lays ``size`` out row-major (strides of size-1 dims are never used, so any do)."""
    if not isinstance(size, (list, tuple)) or not isinstance(stride, (list, tuple)) or len(size) != len(stride):
        return False
    if not all(isinstance(v, int) for v in (*size, *stride)):
        return False
    return all(n == 1 or s == w for n, s, w in zip(size, stride, row_major_strides(list(size))))


def _whole_contiguous(x: Any, size: Any, offset: Any) -> bool:
    """Whether ``x`` (a node) holds exactly ``prod(size)`` elements, contiguous from the start of its memory,
    and the view starts there too (``offset`` 0, or None: the input's own offset)."""
    v = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(v, torch.Tensor) or not v.is_contiguous() or v.storage_offset() != 0:
        return False
    return offset in (None, 0) and v.numel() == math.prod(size)


def _args(node: torch.fx.Node, names: tuple[str, ...]) -> list[Any]:
    return [node.args[i] if len(node.args) > i else node.kwargs.get(n) for i, n in enumerate(names)]


def fold_contiguous_as_strided(gm: torch.fx.GraphModule) -> int:
    """Rewrite every ``as_strided`` / ``as_strided_scatter`` of ``gm`` that is a reshape (module docstring) as
    ``aten.reshape``, in place; returns how many were rewritten (``gm`` is recompiled if any)."""
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.as_strided.default:
            x, size, stride, offset = _args(node, ("self", "size", "stride", "storage_offset"))
            if _is_row_major(size, stride) and _whole_contiguous(x, size, offset):
                node.target, node.args, node.kwargs = aten.reshape.default, (x, list(size)), {}
                folded += 1
        elif node.target is aten.as_strided_scatter.default:
            base, src, size, stride, offset = _args(node, ("self", "src", "size", "stride", "storage_offset"))
            sv = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
            bv = base.meta.get("val") if isinstance(base, torch.fx.Node) else None
            if (_is_row_major(size, stride) and _whole_contiguous(base, size, offset) and isinstance(sv, torch.Tensor)
                    and list(sv.shape) == list(size) and sv.dtype == bv.dtype):
                node.target, node.args, node.kwargs = aten.reshape.default, (src, list(bv.shape)), {}
                folded += 1
    if folded:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return folded
