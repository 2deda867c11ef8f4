"""Pass: annotate every node with its placement along the data-parallel mesh axis.

Seeds: batch inputs ``Shard(0)`` (``Replicate()`` when ``ctx.shards_batch`` is false:
one rank, or a batch of one sample), parameters and buffers ``Replicate()``. One
forward sweep in topological order applies :func:`.sharding_rules.apply_rule` to each node (our rule
for the op, else DTensor's strategy that moves the least: the sources the planner chooses from);
where a rule needs an input in another placement, the node records it under
``adaptdist.redistribute`` (the redistribution pass inserts the collective).
Planner hints (``ctx.node_hints``, from an automatic plan): a node with one takes the planner's
strategy when the op's rule, given the hinted input placements, yields the hinted outputs; its
inputs are then redistributed to those placements (e.g. a local slice of a replicated tensor).
Otherwise the rule's own choice stands, so a hint can never make a program wrong.
Graph outputs: the loss and mutated buffers need ``Replicate()``; gradients are
left to the gradient-bucketing pass.

Before/after (annotations only, the graph is unchanged)::

    mm = aten.mm(view, t)          # view: f32[8, 64] S(0), t: f32[64, 256] R
    # after: mm.meta["adaptdist.placements"] == (S(0),)
    mm_1 = aten.mm(t_1, view_2)    # t_1: f32[64, 8] S(1), view_2: f32[8, 256] S(0)
    # after: mm_1 -> (P(sum),)     (a weight gradient: a partial sum over ranks)
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from .. import graph_meta as gmeta
from ..errors import UnsupportedOpError
from ..placement import Partial, Replicate, Shard
from .context import PassContext
from .infra import placement_of
from .sharding_rules import RuleResult, apply_rule, gather_all, tensor_args

log = logging.getLogger("adaptdist.passes")


def propagate_placements(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Annotate placements; returns ``(gm, changed)`` where changed means annotations changed.

    With ``ctx.replicate_fallback``, an op with no rule for the placements it receives (no rule at all, or
    a rule that refuses them) gets its inputs gathered and runs whole on every rank instead; one warning
    lists every such node.

    Raises:
        UnsupportedOpError: an op has no rule for the placements it receives (and no
            replicate fallback was asked for), or a
            mutated buffer / the loss would end up sharded.
    """
    changed = False
    fallbacks: list[str] = []
    reduce_early: set[torch.fx.Node] = set()

    def seen_as(a: torch.fx.Node):
        return Replicate() if a in reduce_early else placement_of(a)

    for node in gm.graph.nodes:
        old = gmeta.get_placements(node)
        needs: dict = {}
        if node.op == "placeholder":
            role = gmeta.get_role(node)
            if role == "batch":
                out = Shard(0) if ctx.shards_batch else Replicate()
            else:
                out = ctx.param_placements.get(gmeta.get_fqn(node), Replicate()) if ctx.axis_size > 1 else Replicate()
        elif node.op == "get_attr":
            out = Replicate()
        elif node.op == "call_function":
            try:
                res = (_follow_hint(node, ctx.node_hints.get(node.name), seen_as, ctx.axis_size)
                       or apply_rule(node, seen_as, ctx.axis_size))
            except UnsupportedOpError:
                # any op with no rule for the placements it receives (none at all, or a rule of ours that
                # refuses this form, e.g. addmm's partial product with a whole bias): what the error's advice
                # (sharding_rules.unsupported) promises --replicate-fallback does (fix-lower)
                if not ctx.replicate_fallback:
                    raise
                res = gather_all(node, seen_as, "no sharding rule (replicate fallback)")
                fallbacks.append(f"{node.name} ({node.target})")
            out, needs = res.out, dict(res.needs)
            for path, a in tensor_args(node):
                if a in reduce_early:
                    needs.setdefault(path, Replicate())
            if _reduce_at_producer(node, out):
                reduce_early.add(node)
        elif node.op == "output":
            needs = _output_needs(node, ctx)
            out = None
        else:
            raise UnsupportedOpError(f"node {node.name!r}: op kind {node.op!r} is not supported in joint graphs")
        layout = (out,) if out is not None else None
        gmeta.set_placements(node, layout)
        old_needs = gmeta.get_redistribute(node)
        new_needs = {path: (p,) for path, p in needs.items()}
        gmeta.set_redistribute(node, new_needs)
        changed |= old != layout or old_needs != new_needs
    out_node = gm.graph.output_node()
    if fallbacks and gmeta.get_fallbacks(out_node) != fallbacks:  # once, not again on re-propagation
        gmeta.set_fallbacks(out_node, fallbacks)
        log.warning("replicate fallback: %d op(s) without a sharding rule run whole on every rank, their inputs "
                    "gathered: %s", len(fallbacks), ", ".join(fallbacks))
    return gm, changed


def _same(out, hinted: tuple) -> bool:
    outs = out if isinstance(out, tuple) else (out,)
    return len(outs) == len(hinted) and all(h is None or o == h for o, h in zip(outs, hinted))


def _follow_hint(node: torch.fx.Node, hint, seen_as, mesh_size: int) -> RuleResult | None:
    """The planner's strategy for ``node`` as a rule result: the op's own rule applied to the hinted input
    placements must give the hinted outputs and need nothing more; inputs whose placement differs are
    redistributed to the hinted one, which must not be Partial (nothing turns a value into a partial
    sum). None when the hint is absent or the rule disagrees: the rule's own choice stands."""
    if hint is None:
        return None
    args = tensor_args(node)
    if len(hint.inputs) != len(args):
        return None
    want = {a: p for (_, a), p in zip(args, hint.inputs) if p is not None}
    try:
        res = apply_rule(node, lambda a: want.get(a, seen_as(a)), mesh_size)
    except UnsupportedOpError:
        return None
    if res.needs or not _same(res.out, hint.outputs):
        return None
    needs = {}
    for path, a in args:
        p = want.get(a)
        if p is not None and p != seen_as(a):
            if isinstance(p, Partial):
                return None
            needs[path] = p
    return RuleResult(res.out, needs)


def _reduce_at_producer(node: torch.fx.Node, out) -> bool:
    """A Partial value with several consumers is all-reduced once where it is made, and every
    consumer sees it replicated (as Megatron keeps the residual stream replicated). Left Partial,
    linear consumers would pass the partial sum on and each later nonlinear use would need its
    own reduction. Gradients going to the graph's output are left to the bucketing passes."""
    users = list(node.users)
    return (isinstance(out, Partial) and len(users) > 1 and all(u.op != "output" for u in users))


def _output_needs(node: torch.fx.Node, ctx: PassContext) -> dict:
    """The loss and mutated buffers must be replicated; a gradient must end in its parameter's
    placement (Partial gradients of replicated parameters are left to the bucketing pass); per-rank
    outputs (``out:k``, ``grad_in:k``) end split like the batch inputs."""
    outs = node.args[0]
    roles = gmeta.get_output_roles(node)
    param_pl = {gmeta.get_fqn(p): placement_of(p) for p in node.graph.find_nodes(op="placeholder")}
    needs = {}
    for j, o in enumerate(outs):
        if not isinstance(o, torch.fx.Node):
            continue
        p = placement_of(o)
        if roles[j].startswith("grad:"):
            fqn = roles[j][len("grad:"):]
            want = param_pl[fqn]
            if isinstance(want, Shard) and p != want:
                # Partial: reduce_scatter; another Shard: all_gather then this rank's slice
                needs[(0, j)] = want
            elif isinstance(want, Replicate) and isinstance(p, Shard):
                needs[(0, j)] = want  # e.g. a replicated weight used on a sharded activation
            continue
        if roles[j].startswith(gmeta.PER_RANK_ROLES):
            # a per-rank output (torch.compile backend): laid out like the batch inputs
            want = Shard(0) if ctx.shards_batch else Replicate()
            if p != want:
                needs[(0, j)] = want
            continue
        if isinstance(p, Shard):
            raise UnsupportedOpError(
                f"graph output {j} (node {o.name!r}, {gmeta.shape_str(o)}) would be sharded over the batch "
                f"({p!r}); the loss must be a scalar and buffers must not be updated per sample"
            )
        if isinstance(p, Partial):
            needs[(0, j)] = Replicate()
    return needs
