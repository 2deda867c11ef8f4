"""Sum the low-precision gradients of a parameter's autocast casts before casting them up, as eager does (at capture).

Eager autocast casts a trainable float32 parameter to bf16 once per autocast region and hands that one cast to
every op that reads the parameter (its cast cache, ``cached_cast`` in ``aten/src/ATen/autocast_mode.cpp``: a
float32 leaf that requires grad). A Linear called twice under autocast then has one ``ToCopyBackward``: autograd
sums the two uses' bf16 gradients in bf16 and casts that sum to float32 once. The captured joint graph has no
such cache (``make_fx`` and aot_autograd trace with it turned off, ``proxy_tensor.disable_autocast_cache``; and
the parameters they trace with are not leaves), so it casts the parameter once per use, and its backward casts
each use's gradient to float32 and sums there: other roundings than eager's (a user's model with one Linear
used twice: step 2 loss 1.4347949 vs eager-bf16's 1.4347214). This fold restores eager's order: where a
parameter is cast to one low-precision dtype more than once and its gradient is a sum of float32 casts of
gradients of that dtype, the casts' inputs are summed in that dtype, left to right, and the sum is cast once.

Before/after (``shared``: a Linear(37, 37) used twice under bf16 autocast; ``arg3_1`` its float32 weight)::

    _to_copy_4 = aten._to_copy(arg3_1, dtype=bf16)        # first use's cast
    _to_copy_6 = aten._to_copy(arg3_1, dtype=bf16)        # second use's cast
    ...
    _to_copy_24 = aten._to_copy(t_13, dtype=f32)          # t_13: bf16[37, 37], second use's gradient
    _to_copy_27 = aten._to_copy(t_17, dtype=f32)          # t_17: bf16[37, 37], first use's gradient
    add_8 = aten.add(_to_copy_24, _to_copy_27)            # f32[37, 37], the weight's gradient
    # becomes
    add_10 = aten.add(t_13, t_17)                         # bf16[37, 37]
    _to_copy_31 = aten._to_copy(add_10, dtype=f32)        # f32[37, 37], the weight's gradient

Other terms of the gradient (a use of the parameter outside autocast, in float32) keep their order; the cast
sum takes the place of the last cast term. Not distinguished: a parameter a user casts explicitly twice
(``w.bfloat16()`` in two places), whose eager gradient sums in float32; and casts in two separate autocast
regions (eager's cast cache is cleared when the outer region exits, so eager sums those in float32 too): this
fold sums both in bf16 (the graph does not say which casts autocast made, nor in which region).
"""

from __future__ import annotations

import torch
import torch.fx

from .. import graph_meta as gmeta

aten = torch.ops.aten
_LOW = (torch.bfloat16, torch.float16)


def _is_cast(node: torch.fx.Node, dtype: torch.dtype) -> bool:
    return (node.op == "call_function" and node.target == aten._to_copy.default and len(node.args) == 1
            and node.kwargs.get("dtype") == dtype)


def _terms(node: torch.fx.Node, root: torch.fx.Node) -> list[torch.fx.Node]:
    """The summands of ``node``'s tree of float32 ``add.Tensor`` (no alpha, each inner add used only there)."""
    if (node.op == "call_function" and node.target == aten.add.Tensor and len(node.args) == 2 and not node.kwargs
            and all(isinstance(a, torch.fx.Node) for a in node.args) and (node is root or len(node.users) == 1)):
        return _terms(node.args[0], root) + _terms(node.args[1], root)
    return [node]


def _add(graph: torch.fx.Graph, a: torch.fx.Node, b: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node:
    node = graph.call_function(aten.add.Tensor, (a, b))
    node.meta.update({k: v for k, v in like.meta.items() if k in ("stack_trace", "nn_module_stack")})
    node.meta["val"] = gmeta.val(a) + gmeta.val(b)
    return node


def sum_cast_gradients_in_low_precision(gm: torch.fx.GraphModule, grads: dict[torch.fx.Node, torch.fx.Node]
                                        ) -> dict[torch.fx.Node, torch.fx.Node]:
    """Rewrite the gradients ``grads`` ({parameter placeholder: its gradient node}) as the module docstring says.

    Returns ``{parameter placeholder: gradient node}``, the new node where one was rewritten (the old one is
    left for dead-code elimination); ``grads`` itself where nothing applies (no autocast, or each parameter cast
    once). Shapes are unchanged: each new sum has the parameter's shape.
    """
    graph = gm.graph
    out = dict(grads)
    for param, grad in grads.items():
        pval = gmeta.val(param)
        if not isinstance(pval, torch.Tensor) or pval.dtype != torch.float32:
            continue
        for dtype in _LOW:
            if sum(1 for u in param.users if _is_cast(u, dtype)) < 2:
                continue
            terms = _terms(grad, grad)
            low = [t for t in terms if _is_cast(t, torch.float32) and isinstance(t.args[0], torch.fx.Node)
                   and getattr(gmeta.val(t.args[0]), "dtype", None) == dtype
                   and tuple(gmeta.val(t.args[0]).shape) == tuple(pval.shape)]
            if len(low) < 2:
                continue
            with graph.inserting_before(grad):
                s = low[0].args[0]
                for t in low[1:]:
                    s = _add(graph, s, t.args[0], grad)
                cast = graph.call_function(aten._to_copy.default, (s,), dict(low[-1].kwargs))
                cast.meta.update({k: v for k, v in low[-1].meta.items() if k != "val"})
                cast.meta["val"] = gmeta.val(s).to(torch.float32)
                total = None
                for t in terms:  # the cast sum where the last of its terms was
                    if t in low and t is not low[-1]:
                        continue
                    t = cast if t is low[-1] else t
                    total = t if total is None else _add(graph, total, t, grad)
            grad.replace_all_uses_with(total)
            out[param] = total
            grad = total
    return out
