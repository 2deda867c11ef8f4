"""A user's ``torch.utils.checkpoint`` through the torch.compile backend: the checkpointed block recomputed.

Dynamo turns ``checkpoint(block, x, use_reentrant=False)`` into the higher-order op
``torch.ops.higher_order.tag_activation_checkpoint(body, x, *block_params)``. Run as it is inside the backend's
capture (:mod:`.dynamo_capture`), the op tags the nodes it traces with ``node.meta["recompute"]`` and
``ac_graph_id`` (torch's selective-checkpoint machinery, ``torch/utils/checkpoint.py``,
``_CachingTorchDispatchMode``), but ``aot_export_module(trace_joint=True)`` re-traces its joint graph with a plain
``make_fx`` (``torch/_functorch/aot_autograd.py``, ``flattened_joint``), whose nodes copy no meta: every tag is lost,
the joint graph saves the block's internals for the backward like any other value, and nothing is recomputed.

So the backend marks the regions itself, with an op that survives every re-trace:

1. :func:`with_marked_regions` replaces each ``tag_activation_checkpoint`` call of the Dynamo graph by
   :func:`run_region`, which runs the body inline between identity markers (``adaptdist::region_mark``, a custom op
   with an identity autograd and vmap rule): one on each input (``end=False``), one on each output (``end=True``),
   carrying the region's number.
2. :func:`recompute_regions`, on the exported joint graph: a region is the nodes that are descendants of its input
   markers and ancestors of its output markers (all forward nodes). Every use of a region-internal value by a
   backward node (one that no forward output needs) reads instead a copy of the region's nodes, inserted just before
   the region's first backward use, which reads only the region's inputs (its markers' inputs, parameters, values
   computed outside it). The region's outputs are not recomputed (the next op keeps them, as under eager
   checkpointing). The markers are then removed. Before/after, one block ``y = b(tanh(a(x)))``::

       forward:  h = a(x); t = tanh(h); y = b(t)          forward:  h = a(x); t = tanh(h); y = b(t)
       backward: ... tanh_backward(g, t) ...        ->    backward: h' = a(x); t' = tanh(h'); ... tanh_backward(g, t')

   The forward/backward split (:mod:`.partition`) then keeps ``x`` for the backward, not ``h`` and ``t``, and the
   planner's liveness-based memory estimate (:mod:`adaptdist.cost_models.memory`) sees the shorter lives and the
   recomputation's compute without knowing about checkpoints, as for ``adaptdist train --activation-checkpointing``.

A random op inside a region (dropout's ``bernoulli``) is not recomputed: its draws are kept from the forward and the
recomputation reads them (recomputing would draw other numbers; eager checkpointing replays the generator's state to
draw the same ones), so the recomputed values are the forward's; only the draws (the mask) stay alive, not the
activations.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.fx

log = logging.getLogger(__name__)


@torch.library.custom_op("adaptdist::region_mark", mutates_args=())
def region_mark(x: torch.Tensor, region: int, end: bool) -> torch.Tensor:
    """Identity (a copy: a custom op returns no alias) marking ``x`` as an input (``end=False``) or an output
    (``end=True``) of checkpointed region ``region``; removed from the joint graph by :func:`recompute_regions`."""
    return x.clone()


@region_mark.register_fake
def _region_mark_fake(x: torch.Tensor, region: int, end: bool) -> torch.Tensor:
    return torch.empty_like(x)


def _region_mark_backward(ctx: Any, grad: torch.Tensor):
    return grad, None, None


region_mark.register_autograd(_region_mark_backward)


@region_mark.register_vmap
def _region_mark_vmap(info: Any, in_dims: tuple, x: torch.Tensor, region: int, end: bool):
    return region_mark(x, region, end), in_dims[0]


_MARK = torch.ops.adaptdist.region_mark.default


def run_region(body: torch.fx.GraphModule, region: int, *args: Any, **checkpoint_kwargs: Any) -> tuple:
    """The body of a ``tag_activation_checkpoint`` call run inline, its tensor inputs and outputs marked as region
    ``region``'s (module docstring); the checkpoint's keyword arguments (``use_reentrant``, ...) are not needed."""
    marked = [region_mark(a, region, False) if isinstance(a, torch.Tensor) else a for a in args]
    outs = body(*marked)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return tuple(region_mark(o, region, True) if isinstance(o, torch.Tensor) else o for o in outs)


def checkpoint_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The ``tag_activation_checkpoint`` calls of a Dynamo graph (one per ``torch.utils.checkpoint`` call)."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    return [n for n in gm.graph.nodes if n.op == "call_function" and hop is not None and n.target is hop]


def with_marked_regions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose checkpoint calls are :func:`run_region` calls numbered 0, 1, ... in graph order;
    ``gm`` itself when it has none."""
    calls = checkpoint_calls(gm)
    if not calls:
        return gm
    graph = copy.deepcopy(gm.graph)
    by_name = {n.name: n for n in graph.nodes}
    for k, n in enumerate(calls):
        new = by_name[n.name]
        new.target = run_region
        new.args = (new.args[0], k, *new.args[1:])
    return torch.fx.GraphModule(gm, graph)


def _random(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in n.target.tags)


def _closure(starts: list[torch.fx.Node], step: Any, within: Any = None) -> set[torch.fx.Node]:
    out: set[torch.fx.Node] = set()
    stack = list(starts)
    while stack:
        n = stack.pop()
        if n not in out and (within is None or within(n)):
            out.add(n)
            stack.extend(step(n))
    return out


def recompute_regions(gm: torch.fx.GraphModule, forward_outputs: list[torch.fx.Node], loss: torch.fx.Node) -> int:
    """Recompute the marked regions of the joint graph ``gm`` in its backward and remove the markers (module
    docstring), in place. ``forward_outputs``: the joint graph's forward outputs; ``loss``: the node the backward
    starts from (the backward is its descendants). Returns the number of nodes recomputed (0 without regions).

    A region's nodes are its *core* (descendants of its input markers that are ancestors of its output markers,
    the outputs excluded) and the forward-time nodes made from the core for the backward only (the ``detach`` that
    autograd saves, which no forward output needs); each backward use of one reads its copy."""
    graph = gm.graph
    marks = [n for n in graph.nodes if n.op == "call_function" and n.target == _MARK]
    if not marks:
        return 0
    forward = _closure(list(forward_outputs), lambda n: n.all_input_nodes)
    backward = _closure([loss], lambda n: n.users)
    order = {n: i for i, n in enumerate(graph.nodes)}
    recomputed = 0
    for region in sorted({int(m.args[1]) for m in marks}):
        starts = [m for m in marks if int(m.args[1]) == region and not m.args[2]]
        ends = [m for m in marks if int(m.args[1]) == region and m.args[2]]
        below = _closure(starts, lambda n: n.users, lambda n: not _random(n))  # draws: kept, not recomputed
        core = _closure(ends, lambda n: n.all_input_nodes, lambda n: n in below) - set(ends)
        helpers = _closure([u for n in core for u in n.users], lambda n: n.users,
                           lambda n: n not in forward and n not in backward and n not in core and n.op != "output"
                           and not _random(n))
        inside = core | helpers
        uses = [(u, n) for n in inside for u in n.users if u in backward]
        if not uses:
            continue
        needed = _closure([n for _, n in uses], lambda n: n.all_input_nodes, lambda n: n in inside)
        first = min((u for u, _ in uses), key=order.__getitem__)
        copies: dict[torch.fx.Node, torch.fx.Node] = {}
        with graph.inserting_before(first):
            for n in sorted(needed, key=order.__getitem__):
                copies[n] = graph.node_copy(n, lambda a: copies.get(a, a))
                copies[n].meta = dict(n.meta)
        for u, n in uses:
            u.replace_input_with(n, copies[n])
        recomputed += len([n for n in copies if n.target != _MARK])
    for m in [n for n in graph.nodes if n.op == "call_function" and n.target == _MARK]:
        if any(u.op == "output" for u in m.users):  # an output keeps its node's name (the export's signature)
            m.target, m.args = torch.ops.aten.clone.default, (m.args[0],)
            continue
        m.replace_all_uses_with(m.args[0])
        graph.erase_node(m)
    graph.eliminate_dead_code()
    gm.recompile()
    log.debug("adaptdist: %d nodes of checkpointed regions recomputed in the backward", recomputed)
    return recomputed
