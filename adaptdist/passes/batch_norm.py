"""Passes: training-mode BatchNorm over a split batch, in DDP's or SyncBatchNorm's semantics.

``LoweringOptions.batch_norm`` (``ctx.batch_norm``) chooses:

* ``"local"`` (the default; DDP's): each rank normalizes its rows with the mean and variance of its
  own rows, and its backward uses them too (the rule :func:`.sharding_rules.batch_norm_training` keeps
  BatchNorm on the batch shard). The running buffers follow rank 0's rows, as DDP's broadcast of rank
  0's buffers at every forward makes them: :func:`keep_rank0_running_stats` multiplies each rank's
  updated running mean and variance by 1 on rank 0 and 0 elsewhere (localization fills the factor in)
  and all-reduces the result.
* ``"sync"`` (SyncBatchNorm's): statistics over the global batch. :func:`sync_batch_norm` rewrites each
  training-mode BatchNorm and its backward into per-channel sums, which propagation turns into
  partial sums and redistribution all-reduces; the counts are global (the graph's shapes are), so
  uneven shards are exact too. Forward, for ``x [N, C, *S]`` with ``n = N * prod(S)``::

      mean = sum(x, [0, 2, ...]) / n                 # P(sum) -> all_reduce
      xc = x - mean;  var = sum(xc * xc, dims) / n     # P(sum) -> all_reduce (biased, for normalizing)
      invstd = rsqrt(var + eps);  out = xc * invstd * w + b
      running_mean' = (1 - m) * running_mean + m * mean
      running_var'  = (1 - m) * running_var + m * var * n / (n - 1)

  Backward (``xhat = xc * invstd``; ``g`` the output's gradient)::

      grad_b = sum(g, dims);  grad_w = sum(g * xhat, dims)          # P(sum): the weights' gradients
      grad_x = (g - grad_b / n - xhat * grad_w / n) * invstd * w     # each sum all-reduced first

Before/after (``sync``, batch 4 over 2 ranks, global shapes)::

    bn = aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-05)  # x: f32[4, 4, 8, 8] S(0)
    # becomes
    sum_1 = aten.sum.dim_IntList(x, [0, 2, 3]); mean = aten.div.Tensor(sum_1, 256.0)    # P(sum)
    sub = aten.sub.Tensor(x, aten.view(mean, [1, 4, 1, 1]))  # mean all-reduced first  # S(0)
    ...
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx

from .. import graph_meta as gmeta
from ..placement import Partial, Shard
from .context import PassContext
from .graph_build import set_fake_val
from .infra import placement_of

log = logging.getLogger("adaptdist.passes")
aten = torch.ops.aten

TRAINING_FORWARD = (aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.default,
                    aten.native_batch_norm.default)
"""BatchNorm forward ops whose args are ``(x, weight, bias, running_mean, running_var, training, momentum, eps)``."""


def is_training_forward(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a BatchNorm forward in training mode (batch statistics)."""
    return node.op == "call_function" and node.target in TRAINING_FORWARD and bool(node.args[5])


def is_training_backward(node: torch.fx.Node) -> bool:
    """Whether ``node`` is ``native_batch_norm_backward`` in training mode (with running statistics)."""
    return (node.op == "call_function" and node.target == aten.native_batch_norm_backward.default
            and node.args[7] is not False and node.args[3] is not None)


class _Builder:
    """Adds ops before ``anchor`` with fake values and the anchor's source metadata."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node):
        self.graph, self.anchor = graph, anchor

    def __call__(self, target: Any, *args: Any) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            n = self.graph.call_function(target, tuple(args))
        for key in ("stack_trace", "nn_module_stack", "seq_nr"):
            if key in self.anchor.meta:
                n.meta[key] = self.anchor.meta[key]
        set_fake_val(n)
        return n


def _layout(x: torch.fx.Node) -> tuple[list[int], list[int], float]:
    """(reduced dims, per-channel view shape, element count per channel) of a BatchNorm input [N, C, *S]."""
    shape = tuple(x.meta["val"].shape)
    dims = [0] + list(range(2, len(shape)))
    view = [1, shape[1]] + [1] * (len(shape) - 2)
    n = 1
    for d in dims:
        n *= shape[d]
    return dims, view, float(n)


def _replace_outputs(graph: torch.fx.Graph, node: torch.fx.Node, values: list[Any]) -> None:
    for u in list(node.users):
        assert u.target is operator.getitem, f"{node.name} is used whole by {u.name}"
        new = values[u.args[1]]
        assert new is not None, f"{u.name} reads an output the rewrite does not compute"
        u.replace_all_uses_with(new)
        graph.erase_node(u)
    graph.erase_node(node)


def _decompose_forward(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    x, w, b, rm, rv, _, momentum, eps = node.args[:8]
    op = _Builder(graph, node)
    dims, view, n = _layout(x)
    mean = op(aten.div.Tensor, op(aten.sum.dim_IntList, x, dims), n)
    xc = op(aten.sub.Tensor, x, op(aten.view.default, mean, view))
    var = op(aten.div.Tensor, op(aten.sum.dim_IntList, op(aten.mul.Tensor, xc, xc), dims), n)
    invstd = op(aten.rsqrt.default, op(aten.add.Tensor, var, float(eps)))
    out = op(aten.mul.Tensor, xc, op(aten.view.default, invstd, view))
    if w is not None:
        out = op(aten.mul.Tensor, out, op(aten.view.default, w, view))
    if b is not None:
        out = op(aten.add.Tensor, out, op(aten.view.default, b, view))
    values: list[Any] = [out, mean, invstd]
    if node.target == aten._native_batch_norm_legit_functional.default:
        m = float(momentum)
        unbiased = op(aten.mul.Tensor, var, m * n / max(n - 1.0, 1.0))
        new_rm = op(aten.add.Tensor, op(aten.mul.Tensor, rm, 1.0 - m), op(aten.mul.Tensor, mean, m))
        new_rv = op(aten.add.Tensor, op(aten.mul.Tensor, rv, 1.0 - m), unbiased)
        values += [new_rm, new_rv]
    _replace_outputs(graph, node, values)


def _decompose_backward(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    g, x, w, _, _, mean, invstd, _, _, mask = node.args[:10]
    op = _Builder(graph, node)
    dims, view, n = _layout(x)
    xhat = op(aten.mul.Tensor, op(aten.sub.Tensor, x, op(aten.view.default, mean, view)),
              op(aten.view.default, invstd, view))
    sum_g = op(aten.sum.dim_IntList, g, dims)
    sum_gx = op(aten.sum.dim_IntList, op(aten.mul.Tensor, g, xhat), dims)
    grad_x = None
    if mask[0]:
        centered = op(aten.sub.Tensor, op(aten.sub.Tensor, g, op(aten.view.default, op(aten.div.Tensor, sum_g, n), view)),
                      op(aten.mul.Tensor, xhat, op(aten.view.default, op(aten.div.Tensor, sum_gx, n), view)))
        scale = invstd if w is None else op(aten.mul.Tensor, invstd, w)
        grad_x = op(aten.mul.Tensor, centered, op(aten.view.default, scale, view))
    _replace_outputs(graph, node, [grad_x, sum_gx if mask[1] else None, sum_g if mask[2] else None])


def sync_batch_norm(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Under ``ctx.batch_norm == "sync"``, rewrite training-mode BatchNorm and its backward into per-channel
    sums (module docstring) on the mesh axis that splits the batch; returns ``(gm, changed)``. Leaves the graph
    alone in ``"local"`` mode, on other axes (the batch is whole there), or without training-mode BatchNorm."""
    if ctx.batch_norm != "sync" or not ctx.shards_batch:
        return gm, False
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if is_training_forward(node):
            _decompose_forward(graph, node)
            changed = True
        elif is_training_backward(node):
            _decompose_backward(graph, node)
            changed = True
    return gm, changed


def keep_rank0_running_stats(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Under ``"local"`` BatchNorm, make every rank's updated running mean and variance rank 0's (DDP
    broadcasts rank 0's buffers): ``all_reduce(new_stat * flag)`` with ``flag`` 1 on coordinate 0 of the
    mesh axis and 0 elsewhere (marked ``adaptdist.rank0_flag``; localization fills it in). Applies to the
    buffer outputs of training-mode ``_native_batch_norm_legit_functional`` whose input is split on the
    batch dim; returns ``(gm, changed)``.

    Before/after (rank 1 after localization)::

        getitem_3 = bn[3]                                   # f32[4] (this rank's running mean)
        # becomes, where it is returned as the buffer
        mul = aten.mul.Tensor(getitem_3, 0.0)               # P(sum): rank 0's value, zero elsewhere
        all_reduce = _c10d_functional.all_reduce(mul, 'sum', 'adaptdist:dp'); wait_tensor(all_reduce)  # R
    """
    from .insert_redistributes import all_reduce

    if ctx.batch_norm != "local" or ctx.axis_size < 2:
        return gm, False
    graph = gm.graph
    out_node = graph.output_node()
    changed = False
    for node in list(graph.nodes):
        if not (is_training_forward(node) and node.target == aten._native_batch_norm_legit_functional.default
                and placement_of(node.args[0]) == Shard(0)):
            continue
        for u in list(node.users):
            if u.target is not operator.getitem or u.args[1] not in (3, 4) or out_node not in u.users:
                continue
            with graph.inserting_after(u):
                flag = graph.call_function(aten.mul.Tensor, (u, 1.0))
            flag.meta["val"] = u.meta["val"]
            gmeta.set_placements(flag, (Partial(),))
            gmeta.set_rank0_flag(flag, ctx.group_name)
            reduced = all_reduce(graph, flag, ctx.group_name)
            out_node.replace_input_with(u, reduced)
            changed = True
    if changed:
        log.info("BatchNorm in training mode: statistics per rank from its own rows (DDP's semantics), running "
                 "buffers from rank 0; --batch-norm sync for statistics over the global batch")
    return gm, changed
