"""Pass: make reductions over the sharded batch mean what they mean on the global batch.

With uneven shards a per-rank mean is not a piece of the global mean, so every
mean-like reduction whose input is sharded on a reduced dim is rewritten as a
per-rank *sum* divided by the *global* count:

* ``mean(x, dims)`` -> ``sum(x, dims) / N`` with N the product of the global sizes;
* ``nll_loss_forward(..., reduction=mean)`` -> ``reduction=sum``, divided by the
  total weight all-reduced over ranks (so ``ignore_index`` and class weights
  count globally); ``nll_loss_backward`` then receives the global total weight;
* ``mse_loss``/``smooth_l1_loss``/``huber_loss``/``binary_cross_entropy*`` with
  ``reduction=mean`` -> ``reduction=sum`` divided by the global element count
  (their backward: ``reduction=sum`` with the incoming gradient divided by it).

Run :func:`~.propagate_placements.propagate_placements` again afterwards.

Before/after (global shapes, batch 8 over 2 ranks)::

    mean = aten.mean.dim(x, [0])             # x: f32[8, 16] S(0)
    # becomes
    sum_ = aten.sum.dim_IntList(x, [0])      # P(sum)
    mean = aten.div.Tensor(sum_, 8)          # P(sum), exact for any split of the 8 rows
"""

from __future__ import annotations

import math

import torch
import torch.fx

from ..placement import Shard
from .context import PassContext
from .graph_build import set_fake_val
from .infra import placement_of

aten = torch.ops.aten

# op -> (position of the reduction arg, is backward)
_LOSSES = {
    aten.mse_loss.default: (2, False),
    aten.mse_loss_backward.default: (3, True),
    aten.smooth_l1_loss.default: (2, False),
    aten.smooth_l1_loss_backward.default: (3, True),
    aten.huber_loss.default: (2, False),
    aten.huber_loss_backward.default: (3, True),
    aten.binary_cross_entropy.default: (3, False),
    aten.binary_cross_entropy_backward.default: (4, True),
    aten.binary_cross_entropy_with_logits.default: (4, False),
}
_MEAN, _SUM = 1, 2


def _new(graph: torch.fx.Graph, target, args, kwargs=None, like=None) -> torch.fx.Node:
    n = graph.call_function(target, tuple(args), kwargs or {})
    if like is not None:
        for key in ("stack_trace", "nn_module_stack", "seq_nr"):
            if key in like.meta:
                n.meta[key] = like.meta[key]
    return n


def _sharded_on(node: torch.fx.Node, dims: list[int]) -> bool:
    p = placement_of(node)
    return isinstance(p, Shard) and p.dim in dims


def globalize_reductions(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Rewrite mean-like reductions over sharded dims; returns ``(gm, changed)``.

    Needs placements from ``propagate_placements``.
    """
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in (aten.mean.dim, aten.mean.default):
            x = node.args[0]
            shape = x.meta["val"].shape
            nd = len(shape)
            if node.target == aten.mean.default:
                dims = list(range(nd))
            else:
                dims_arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
                dims = list(range(nd)) if not dims_arg else sorted(d % nd for d in dims_arg)
            if not _sharded_on(x, dims):
                continue
            count = math.prod(shape[d] for d in dims)
            keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            dtype = node.kwargs.get("dtype")
            with graph.inserting_before(node):
                s = _new(graph, aten.sum.dim_IntList, (x, dims, keepdim), {"dtype": dtype} if dtype else {}, like=node)
                set_fake_val(s)
                d = _new(graph, aten.div.Tensor, (s, float(count)), like=node)
                set_fake_val(d)
            node.replace_all_uses_with(d)
            graph.erase_node(node)
            changed = True
        elif node.target in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default):
            # sharded when either the scores or the target are (the rule slices the other)
            if node.args[3] != _MEAN or not (_sharded_on(node.args[0], [0]) or _sharded_on(node.args[1], [0])):
                continue
            node.args = node.args[:3] + (_SUM,) + node.args[4:]
            users = list(node.users)
            out = next((u for u in users if u.args[1] == 0), None)
            tw = next((u for u in users if u.args[1] == 1), None)
            if tw is None:
                with graph.inserting_after(node):
                    tw = _new(graph, __import__("operator").getitem, (node, 1), like=node)
                    tw.meta["val"] = node.meta["val"][1]
            if out is not None:
                with graph.inserting_after(max(out, tw, key=lambda n: _index(graph, n))):
                    d = _new(graph, aten.div.Tensor, (out, tw), like=node)
                    d.meta["val"] = out.meta["val"]
                out.replace_all_uses_with(d, delete_user_cb=lambda u: u is not d)
            changed = True
        elif node.target in _LOSSES:
            pos, backward = _LOSSES[node.target]
            red = node.args[pos] if len(node.args) > pos else node.kwargs.get("reduction", _MEAN)
            x = node.args[1 if backward else 0]
            acts = [a for a in node.args[1 if backward else 0:pos] if isinstance(a, torch.fx.Node)]
            # the rule shards the loss when any operand is sharded (a replicated one gets sliced)
            if red != _MEAN or not any(isinstance(placement_of(a), Shard) for a in acts):
                continue
            count = float(math.prod(x.meta["val"].shape))
            args = list(node.args) + [None] * (pos + 1 - len(node.args))
            args[pos] = _SUM
            kwargs = {k: v for k, v in node.kwargs.items() if k != "reduction"}
            if backward:
                with graph.inserting_before(node):
                    g = _new(graph, aten.div.Tensor, (args[0], count), like=node)
                    set_fake_val(g)
                args[0] = g
                node.args, node.kwargs = tuple(args), kwargs
            else:
                node.args, node.kwargs = tuple(args), kwargs
                with graph.inserting_after(node):
                    d = _new(graph, aten.div.Tensor, (node, count), like=node)
                    d.meta["val"] = node.meta["val"]
                node.replace_all_uses_with(d, delete_user_cb=lambda u: u is not d)
            changed = True
    return gm, changed


def _index(graph: torch.fx.Graph, n: torch.fx.Node) -> int:
    for i, m in enumerate(graph.nodes):
        if m is n:
            return i
    raise AssertionError(n)
