"""Pass: ``nn.EmbeddingBag`` over bags of one length (a 2-D input) as an embedding and a reduction.

``nn.EmbeddingBag(x)`` with ``x [B, L]`` is captured as ``_embedding_bag(weight, x.view(B*L),
arange(0, B*L, L), ...)``: flat indices and offsets that only make sense whole. Where the offsets are
that ``arange`` (every bag has ``L`` indices), mode is ``sum`` or ``mean``, no ``padding_idx`` and no
``include_last_offset``, the bag is rewritten as the ops it means, which keep the batch split (and a
table split by rows or columns) through the existing rules::

    bag = aten._embedding_bag(w, view, arange, False, 1)                 # w: f32[V, D], view: i64[B*L]
    # becomes
    idx = aten.view(view, [B, L]); emb = aten.embedding(w, idx)           # [B, L, D]
    out = aten.div.Tensor(aten.sum.dim_IntList(emb, [1]), L)              # mean; sum: no div
    # per_sample_weights p [B*L] (sum mode): emb * p.view(B, L, 1) before the sum

and its backward ``_embedding_bag_backward(grad, ...)`` as ``embedding_dense_backward`` of ``grad``
expanded over the bag (divided by ``L`` for mean, times the weights); the weights' own gradient
``_embedding_bag_per_sample_weights_backward`` as ``sum(grad[:, None] * emb, -1)``. Other forms
(1-D input with offsets of its own, ``max`` mode, ``padding_idx``) are left as they are: the rule
:func:`.sharding_rules.embedding_bag` gathers their inputs.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .batch_norm import _Builder
from .context import PassContext
from .sharding_rules import _arg
from .sharding_rules import embedding_bag_rewritable as _rewritable

aten = torch.ops.aten
_SUM, _MEAN = 0, 1


def decompose_embedding_bag(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Rewrite ``_embedding_bag`` over bags of one length and its backward (module docstring); returns
    ``(gm, changed)``. Leaves the graph alone on one rank and for the other forms."""
    if ctx.axis_size < 2:
        return gm, False
    graph = gm.graph
    changed = False
    done: dict[tuple[torch.fx.Node, torch.fx.Node], tuple[torch.fx.Node, int]] = {}  # (idx, offsets) -> (2-D idx, L)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == aten._embedding_bag.default:
            L = _rewritable(node)
            if L is None:
                continue
            w, idx, off = node.args[:3]
            psw = _arg(node, 6, "per_sample_weights", None)
            op = _Builder(graph, node)
            t = idx.meta["val"].shape[0]
            idx2 = op(aten.view.default, idx, [t // L, L])
            emb = op(aten.embedding.default, w, idx2)
            if psw is not None:
                emb = op(aten.mul.Tensor, emb, op(aten.view.default, psw, [t // L, L, 1]))
            out = op(aten.sum.dim_IntList, emb, [1])
            if _arg(node, 4, "mode", _SUM) == _MEAN:
                out = op(aten.div.Tensor, out, float(L))
            for u in list(node.users):
                assert u.target is operator.getitem, f"{node.name} is used whole by {u.name}"
                if u.args[1] == 0:
                    u.replace_all_uses_with(out)
                    graph.erase_node(u)
            done[(idx, off)] = (idx2, L)
            changed = True
        elif node.target in (aten._embedding_bag_backward.default, aten._embedding_bag_dense_backward.default):
            dense = node.target == aten._embedding_bag_dense_backward.default
            idx = node.args[1]
            off = None if dense else node.args[2]
            key = next((k for k in done if k[0] is idx and (dense or k[1] is off)), None)
            if key is None:
                continue
            idx2, L = done[key]
            g = node.args[0]
            num_weights = node.args[5] if dense else node.args[6]
            mode = node.args[7] if dense else node.args[8]
            psw = node.args[8] if dense else node.args[10]
            op = _Builder(graph, node)
            b, d = g.meta["val"].shape
            ge = op(aten.expand.default, op(aten.unsqueeze.default, g, 1), [b, L, d])
            if mode == _MEAN:
                ge = op(aten.div.Tensor, ge, float(L))
            if psw is not None:
                ge = op(aten.mul.Tensor, ge, op(aten.view.default, psw, [b, L, 1]))
            gw = op(aten.embedding_dense_backward.default, ge, idx2, num_weights, -1, False)
            node.replace_all_uses_with(gw)
            graph.erase_node(node)
            changed = True
        elif node.target == aten._embedding_bag_per_sample_weights_backward.default:
            g, w, idx, off = node.args[:4]
            if (idx, off) not in done:
                continue
            idx2, L = done[(idx, off)]
            op = _Builder(graph, node)
            emb = op(aten.embedding.default, w, idx2)
            prod = op(aten.mul.Tensor, op(aten.unsqueeze.default, g, 1), emb)
            gp = op(aten.view.default, op(aten.sum.dim_IntList, prod, [-1]), [idx.meta["val"].shape[0]])
            node.replace_all_uses_with(gp)
            graph.erase_node(node)
            changed = True
    if changed:
        for node in list(graph.nodes):  # the forward bags whose outputs nothing reads any more
            if node.target == aten._embedding_bag.default and all(
                    u.target is operator.getitem and not u.users for u in node.users):
                for u in list(node.users):
                    graph.erase_node(u)
                graph.erase_node(node)
    return gm, changed
