"""Pass: add partial terms together before they meet a replicated accumulator.

Backward often accumulates several partial-sum gradients into a replicated one
one at a time (``acc = acc + g1; acc = acc + g2``). Each ``R + P`` needs its own
all_reduce; regrouping the chain as ``acc + (g1 + g2)`` needs one (``P + P`` stays
partial). Addition is reassociated only between same-shaped terms, so the result
differs from the original at most by float rounding.

Before/after (placements from propagation)::

    add_16 = add(add_13, mul_36)     # R + P: all_reduce(mul_36)
    add_17 = add(add_16, mul_40)     # R + P: all_reduce(mul_40)
    # becomes
    add_p = add(mul_36, mul_40)      # P + P = P
    add_17 = add(add_13, add_p)      # R + P: one all_reduce
"""

from __future__ import annotations

import torch
import torch.fx

from .. import graph_meta as gmeta
from ..placement import Partial, Replicate
from .context import PassContext
from .infra import placement_of

aten = torch.ops.aten


def _split(node: torch.fx.Node):
    """(replicated term, partial term) of a plain ``add(R, P)``, or None."""
    if node.op != "call_function" or node.target != aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return None
    pa, pb = placement_of(a), placement_of(b)
    if isinstance(pa, Replicate) and isinstance(pb, Partial):
        return a, b
    if isinstance(pb, Replicate) and isinstance(pa, Partial):
        return b, a
    return None


def combine_partial_sums(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Regroup ``(R + P1) + P2`` as ``R + (P1 + P2)``; returns ``(gm, changed)``. Re-run propagation after."""
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        outer = _split(node)
        if outer is None:
            continue
        inner_node, p2 = outer
        inner = _split(inner_node)
        if inner is None or len(inner_node.users) != 1:
            continue
        r, p1 = inner
        shapes = {tuple(x.meta["val"].shape) for x in (r, p1, p2, node)}
        if len(shapes) != 1:
            continue
        with graph.inserting_before(node):
            s = graph.call_function(aten.add.Tensor, (p1, p2))
        s.meta["val"] = p2.meta["val"]
        gmeta.set_placements(s, (Partial(),))
        node.args = (r, s)
        graph.erase_node(inner_node)
        changed = True
    return gm, changed
