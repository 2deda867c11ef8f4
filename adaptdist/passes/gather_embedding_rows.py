"""Pass: build a large embedding table's gradient from the batch's gathered rows instead of all-reducing it.

Under data parallelism ``embedding_dense_backward(grad, indices, V, ...)`` on each rank's share of the batch gives a
``Partial`` ``[V, C]`` gradient that is all-reduced (in a bucket) although at most one row per looked-up id is
nonzero: each step moves, zeroes and sums the whole table (a recommender's 9,742-row MovieLens table: 1.25 MB per
step for 128 ids). Where the batch's rows are fewer bytes than the table, this pass marks the node so its rule
(:func:`.sharding_rules.embedding_backward`) asks for ``grad`` and ``indices`` replicated (``insert_redistributes``
gathers them: the batch's rows, ``(n-1)/n`` of ``numel(grad) * 4 + numel(indices) * 8`` bytes per rank) and gives
the whole gradient on every rank (``Replicate``, out of the gradient bucket); the same sum, in another order.
Propagation then re-annotates the graph.

A node is rewritten when its ``grad`` and ``indices`` are both split on the batch (``Shard(0)``), its value goes
only to the graph's output (not summed with another gradient first, as a table tied to an output head is), it
does not ``scale_grad_by_freq``, the table's gradient is at least :data:`MIN_TABLE_BYTES`, and the gathered bytes are at
most the table's (an all_reduce moves ``2 (n-1)/n`` of the table per rank, the gather ``(n-1)/n`` of the rows: at
least a 2x saving). Below :data:`MIN_TABLE_BYTES` the table's share of the bucketed all_reduce costs less than the
two extra gathers' latency (``alpha`` of 10-20 us each on the shared-memory kernels, 2 GB/s: 64 KiB is 32 us).

Before/after (2 ranks, global batch 256, a 9,742-row table)::

    edb = aten.embedding_dense_backward(g, idx, 9742, -1, False)   # g: f32[256, 1, 32] S(0), idx: i64[256, 1] S(0)
    # edb: P(sum) -> in the gradient bucket's all_reduce (1.25 MB)
    # after: the same node, marked; g and idx all_gathered (32 KB + 2 KB) before it; edb: R
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from .. import graph_meta as gmeta
from ..placement import Shard
from .context import PassContext
from .infra import placement_of
from .propagate_placements import propagate_placements
from .sharding_rules import _arg, embedding_bag_length, embedding_bag_rewritable

aten = torch.ops.aten

MIN_TABLE_BYTES = 64 * 1024
"""Smallest table gradient (bytes) worth gathering rows for (see the module docstring)."""


def gathered_bytes(node: torch.fx.Node) -> tuple[int, int]:
    """``(bytes of the gradient rows and indices of the whole batch, bytes of the table's gradient)`` of an
    ``embedding_dense_backward`` node (global shapes, from its fake values)."""
    g, idx = gmeta.val(node.args[0]), gmeta.val(node.args[1])
    out = gmeta.val(node)
    rows = g.numel() * g.element_size() + idx.numel() * idx.element_size()
    return rows, math.prod(out.shape) * out.element_size()


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def only_a_gradient(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value reaches nothing but the graph's output (directly or through views): a table's whole
    gradient. A gradient summed with another one first (a table tied to an output head) stays Partial, so that the
    sum is all-reduced once, as before."""
    for u in node.users:
        if u.op == "output":
            continue
        if not (u.op == "call_function" and u.target in _VIEWS and only_a_gradient(u)):
            return False
    return True


def worth_gathering_bytes(rows_bytes: int, table_bytes: int) -> bool:
    """The module docstring's rule on sizes: a table's gradient of ``table_bytes`` (at least
    :data:`MIN_TABLE_BYTES`) is built from the batch's gathered rows and indices (``rows_bytes``, the whole batch's)
    when those are no more bytes than the table. ``cost_models/recsys.py`` and the planner read the same rule."""
    return table_bytes >= MIN_TABLE_BYTES and rows_bytes <= table_bytes


def worth_gathering(node: torch.fx.Node) -> bool:
    """Whether ``node`` (an ``embedding_dense_backward`` with batch-split inputs) is cheaper built from gathered
    rows (the module docstring's rule)."""
    if _arg(node, 4, "scale_grad_by_freq", False):
        return False
    return worth_gathering_bytes(*gathered_bytes(node))


def _bag_gathered_bytes(node: torch.fx.Node) -> tuple[int, int] | None:
    """:func:`gathered_bytes` of the ``embedding_dense_backward`` that ``passes/embedding_bag.py`` makes of an
    ``_embedding_bag_backward`` over bags of one length ``L`` (its ``grad [B, D]`` expanded to ``[B, L, D]``, its
    indices ``[B*L]``), or None for a form that pass leaves alone."""
    grad, idx, offsets, o2b = node.args[:4]
    fwd = o2b.args[0] if isinstance(o2b, torch.fx.Node) and o2b.target is operator.getitem else None
    if not (isinstance(grad, torch.fx.Node) and isinstance(idx, torch.fx.Node) and isinstance(fwd, torch.fx.Node)
            and fwd.target == aten._embedding_bag.default and embedding_bag_rewritable(fwd) is not None
            and embedding_bag_length(idx, offsets) is not None):
        return None
    g, i = gmeta.val(grad), gmeta.val(idx)
    L = i.numel() // max(1, g.shape[0])
    rows = g.numel() * L * g.element_size() + i.numel() * i.element_size()
    return rows, int(node.args[6]) * g.shape[-1] * g.element_size()


def gathered_when_batch_split(node: torch.fx.Node) -> bool:
    """Whether this pass rewrites ``node`` on an axis that splits the batch over 2 or more ranks, once its
    ``grad`` and ``indices`` are both ``Shard(0)``: an ``embedding_dense_backward`` whose value reaches only the
    output and that is :func:`worth_gathering`, or an ``_embedding_bag_backward`` that ``passes/embedding_bag.py``
    rewrites into such a one (bags of one length; what the planner sees of builtin:dlrm's tables). The planner
    (``compiler/planner/problem.py``) prices such a node as the lowering runs it."""
    if node.op != "call_function" or not only_a_gradient(node):
        return False
    if node.target == aten._embedding_bag_backward.default:
        if _arg(node, 7, "scale_grad_by_freq", False):
            return False
        got = _bag_gathered_bytes(node)
        return got is not None and worth_gathering_bytes(*got)
    return (node.target == aten.embedding_dense_backward.default
            and isinstance(node.args[0], torch.fx.Node) and isinstance(node.args[1], torch.fx.Node)
            and worth_gathering(node))


def gather_embedding_rows(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Mark each embedding gradient worth building from gathered rows and re-propagate placements; returns
    ``(gm, changed)``. Only on an axis that splits the batch over 2 or more ranks."""
    if not ctx.shard_batch or ctx.axis_size < 2:
        return gm, False
    marked = False
    for node in gm.graph.find_nodes(op="call_function", target=aten.embedding_dense_backward.default):
        if gmeta.gathers_rows(node):
            continue
        if (gathered_when_batch_split(node) and placement_of(node.args[0]) == Shard(0)
                and placement_of(node.args[1]) == Shard(0)):
            gmeta.mark_gather_rows(node)
            marked = True
    if not marked:
        return gm, False
    propagate_placements(gm, ctx)
    return gm, True
