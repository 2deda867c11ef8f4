"""Pass: split ``addmm(bias, a, b)`` into ``add(mm(a, b), bias)`` when parameters are sharded.

With a row-parallel weight the product is a partial sum per rank, and the bias
must be added once, after the reduction; a fused ``addmm`` cannot express that.
Pure data parallelism (no sharded parameters) keeps the fused op.

Before/after::

    addmm = aten.addmm(bias, x, t)          # x: f32[8, 16] S(1), t: f32[16, 10] S(0)
    # becomes
    mm = aten.mm(x, t)                      # P(sum)
    addmm = aten.add.Tensor(mm, bias)       # needs mm as R: all_reduce first
"""

from __future__ import annotations

import torch
import torch.fx

from .context import PassContext

aten = torch.ops.aten


def decompose_addmm(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Rewrite every ``addmm``/``baddbmm`` with default alpha/beta when ``ctx`` shards parameters."""
    if not any(True for _ in ctx.param_placements) or ctx.axis_size == 1:
        return gm, False
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.target not in (aten.addmm.default, aten.baddbmm.default) or node.kwargs:
            continue
        bias, a, b = node.args[:3]
        mm_op = aten.mm.default if node.target == aten.addmm.default else aten.bmm.default
        with graph.inserting_before(node):
            prod = graph.call_function(mm_op, (a, b))
            fa, fb = a.meta["val"], b.meta["val"]
            with fa.fake_mode if hasattr(fa, "fake_mode") else torch.no_grad():
                prod.meta["val"] = mm_op(fa, fb)
            add = graph.call_function(aten.add.Tensor, (prod, bias))
            add.meta.update({k: v for k, v in node.meta.items() if k in ("val", "nn_module_stack")})
        node.replace_all_uses_with(add)
        graph.erase_node(node)
        changed = True
    return gm, changed
