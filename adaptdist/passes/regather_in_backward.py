"""Pass: all-gather sharded parameters again in backward instead of keeping them alive.

A parameter sharded FSDP-style is all-gathered just before its forward use. If the
backward uses the gathered value too, keeping it alive between forward and backward
holds every full parameter at once at the peak. This pass repeats the gather chain
right before the first backward use, so each full parameter lives only around its
uses (ZeRO-3 / FSDP's reshard-after-forward).

The backward is the part of the graph after the loss is computed.

Before/after::

    full = slice(wait(all_gather(pad(w_shard))))     # forward, used by mm and by mm_7 (backward)
    # after: mm uses `full`; before mm_7 a second pad/all_gather/wait/slice gives `full_1`
"""

from __future__ import annotations

import torch
import torch.fx

from .. import graph_meta as gmeta
from .context import PassContext
from .sharding_rules import _is_param


def regather_in_backward(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Duplicate parameter all_gathers whose results are used after the loss; returns ``(gm, changed)``."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    out = graph.output_node()
    roles = gmeta.get_output_roles(out)
    loss = out.args[0][roles.index("loss")]
    loss_pos = _forward_end(loss, order)
    by_name = {n.name: n for n in graph.nodes}
    changed = False
    for full in list(graph.nodes):
        chain_names = gmeta.get_gather_chain(full, ctx.group_name)
        if not chain_names:
            continue
        chain = [by_name[c] for c in chain_names]
        src = chain[0].args[0]
        if not _is_param(src):
            continue
        late = [u for u in full.users if order[u] > loss_pos]
        if not late or len(late) == len(full.users):
            continue
        first = min(late, key=order.__getitem__)
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        with graph.inserting_before(first):
            for n in chain:
                env[n] = graph.node_copy(n, lambda a: env.get(a, a))
        copy = env[full]
        for u in late:
            u.replace_input_with(full, copy)
        changed = True
    return gm, changed


def _forward_end(loss: torch.fx.Node, order: dict) -> int:
    """Position of the loss value's computation (through the all_reduce/wait that replicate it)."""
    n = loss
    while n.op == "call_function" and gmeta.get_collective(n) in ("wait", "all_reduce"):
        n = n.args[0]
    return order[n]
