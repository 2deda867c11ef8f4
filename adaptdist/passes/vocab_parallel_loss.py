"""Pass: cross-entropy over logits sharded by vocabulary (Megatron's vocab-parallel cross entropy).

When the output layer is vocabulary-parallel, the logits ``[N, V]`` are sharded on the
class dim. Instead of gathering them, each rank works on its own columns:

* ``_log_softmax(x, 1)``: ``m = all_reduce_max(amax(x))``, ``z = x - m``,
  ``s = all_reduce_sum(sum(exp(z)))``, ``out = z - log(s)`` (still sharded);
* its backward ``g - exp(out) * all_reduce_sum(sum(g))``;
* ``nll_loss_forward(logp, target, mean|sum)``: each rank picks the targets inside its
  columns ``[start, end)`` (the others, and ``ignore_index``, are masked to -100), sums
  them, and divides by the global count of non-ignored targets: a ``Partial`` sum;
* ``nll_loss_backward``: the same masked targets, so each rank writes only its columns.

``start`` and ``end - start`` differ per rank: the nodes carrying them are marked
(``adaptdist.vocab_bounds``, with the log-probabilities as the sharded tensor) and
localization fills them in. Formulas: Shoeybi et al., "Megatron-LM" (2019), section 3.

Before/after (rank r holds columns [s, e))::

    nll = aten.nll_loss_forward(logp, y, None, 1, -1)       # logp: f32[N, V] S(1), y: i64[N] R
    # becomes
    sub = aten.sub.Tensor(y, s); valid = (y != -1) & (sub >= 0) & (sub < e - s)
    local_y = aten.masked_fill.Scalar(sub, ~valid, -100)
    picked = aten.nll_loss_forward(logp, local_y, None, 2, -100)   # sum over this rank's columns
    count = aten.sum(y != -1)                                        # global, replicated
    loss = picked[0] / count                                         # P(sum)
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .. import _torch_compat as compat
from .. import graph_meta as gmeta
from ..placement import Partial, Replicate, Shard
from .context import PassContext
from .graph_build import add_op
from .infra import placement_of
from .sharding_rules import vocab_parallel_nll

aten = torch.ops.aten
R = Replicate()
_MEAN, _SUM, _LOCAL_IGNORE = 1, 2, -100


def _all_reduce(graph, x, op: str, ctx: PassContext, out_placement) -> torch.fx.Node:
    ar = add_op(graph, compat.functional_all_reduce_op(), (x, op, ctx.group_name), out_placement,
                collective="all_reduce", group=ctx.group_name)
    return add_op(graph, compat.functional_wait_op(), (ar,), R, collective="wait", group=ctx.group_name)


def vocab_parallel_loss(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Rewrite log-softmax and nll_loss over class-sharded inputs; returns ``(gm, changed)``."""
    graph = gm.graph
    changed = False
    targets: dict[tuple[torch.fx.Node, torch.fx.Node], tuple[torch.fx.Node, torch.fx.Node]] = {}

    def local_targets(y: torch.fx.Node, logp: torch.fx.Node, ignore: int, before: torch.fx.Node):
        key = (y, logp)
        if key not in targets:
            with graph.inserting_before(before):
                sub = add_op(graph, aten.sub.Tensor, (y, 0), R)
                gmeta.set_vocab_bounds(sub, "start", logp, ctx.group_name)
                ge = add_op(graph, aten.ge.Scalar, (sub, 0), R)
                lt = add_op(graph, aten.lt.Scalar, (sub, logp.meta["val"].shape[1]), R)
                gmeta.set_vocab_bounds(lt, "rows", logp, ctx.group_name)
                kept = add_op(graph, aten.ne.Scalar, (y, ignore), R)
                valid = add_op(graph, aten.logical_and.default, (add_op(graph, aten.logical_and.default, (ge, lt), R), kept), R)
                invalid = add_op(graph, aten.logical_not.default, (valid,), R)
                local_y = add_op(graph, aten.masked_fill.Scalar, (sub, invalid, _LOCAL_IGNORE), R)
                count = add_op(graph, aten.sum.dim_IntList, (kept, []), R,
                               kwargs={"dtype": logp.meta["val"].dtype})
            targets[key] = (local_y, count)
        return targets[key]

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == aten._log_softmax.default and placement_of(node) == Shard(1) and node.args[1] % 2 == 1 \
                and node.meta["val"].dim() == 2:
            x = node.args[0]
            with graph.inserting_before(node):
                m = _all_reduce(graph, add_op(graph, aten.amax.default, (x, [1], True), R), "max", ctx, R)
                z = add_op(graph, aten.sub.Tensor, (x, m), Shard(1))
                se = add_op(graph, aten.sum.dim_IntList, (add_op(graph, aten.exp.default, (z,), Shard(1)), [1], True),
                            Partial())
                se = _all_reduce(graph, se, "sum", ctx, R)
                out = add_op(graph, aten.sub.Tensor, (z, add_op(graph, aten.log.default, (se,), R)), Shard(1))
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            changed = True
        elif node.target == aten._log_softmax_backward_data.default and placement_of(node) == Shard(1) \
                and node.args[2] % 2 == 1 and node.meta["val"].dim() == 2:
            g, out = node.args[0], node.args[1]
            with graph.inserting_before(node):
                s = _all_reduce(graph, add_op(graph, aten.sum.dim_IntList, (g, [1], True), Partial()), "sum", ctx, R)
                prod = add_op(graph, aten.mul.Tensor, (add_op(graph, aten.exp.default, (out,), Shard(1)), s), Shard(1))
                res = add_op(graph, aten.sub.Tensor, (g, prod), Shard(1))
            node.replace_all_uses_with(res)
            graph.erase_node(node)
            changed = True
        elif node.target == aten.nll_loss_forward.default and vocab_parallel_nll(node, placement_of):
            logp, y, _, reduction, ignore = node.args[:5]
            local_y, count = local_targets(y, logp, ignore, node)
            node.args = (logp, local_y, None, _SUM, _LOCAL_IGNORE)
            gmeta.set_placements(node, ((Partial(), R),))
            for u in list(node.users):
                if u.target is operator.getitem and u.args[1] == 0:
                    if reduction == _MEAN:
                        with graph.inserting_after(u):
                            loss = add_op(graph, aten.div.Tensor, (u, count), Partial())
                        u.replace_all_uses_with(loss, delete_user_cb=lambda v: v is not loss)
                elif u.target is operator.getitem and u.args[1] == 1:
                    u.replace_all_uses_with(count)  # the total weight is the global count
            changed = True
        elif node.target == aten.nll_loss_backward.default and vocab_parallel_nll(node, placement_of):
            g, logp, y, _, reduction, ignore, tw = node.args[:7]
            local_y, count = local_targets(y, logp, ignore, node)
            if reduction == _MEAN:
                with graph.inserting_before(node):
                    g = add_op(graph, aten.div.Tensor, (g, count), R)
            node.args = (g, logp, local_y, None, _SUM, _LOCAL_IGNORE, count)
            changed = True
    return gm, changed
