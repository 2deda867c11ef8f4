"""Pass: turn ``view`` into ``reshape`` once collectives have been inserted.

A captured ``view`` assumes the strides its input had when the model was traced.
Values that now come out of a collective (a gather, a reduce_scatter) are
contiguous in a different layout, and ``view`` would fail on them; ``reshape`` is
the same view when the strides allow it and a copy when they do not. The graph is
functional, so nothing can observe the difference.

Before/after::

    view_9 = aten.view(transpose_3, [4, 8, 32])     # transpose_3 now made by a gather
    # becomes
    view_9 = aten.reshape(transpose_3, [4, 8, 32])
"""

from __future__ import annotations

import torch
import torch.fx

from .. import graph_meta as gmeta
from .context import PassContext

aten = torch.ops.aten


def relax_views(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Rewrite ``view``/``_unsafe_view`` as ``reshape`` when the graph has collectives; ``(gm, changed)``."""
    if not any(gmeta.get_collective(n) for n in gm.graph.nodes):
        return gm, False
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (aten.view.default, aten._unsafe_view.default):
            n.target = aten.reshape.default
            changed = True
    return gm, changed
