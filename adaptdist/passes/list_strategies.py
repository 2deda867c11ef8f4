"""Pass: list every node's candidate sharding strategies along one mesh axis.

For each op, torch's own DTensor strategies come first when it has them for the op and
these arguments (through :func:`adaptdist._torch_compat.dtensor_strategies`); then the
ones our rule (:mod:`.sharding_rules`) adds where torch has none (e.g. CPU flash
attention, the vocabulary-parallel embedding backward), found by asking the rule once with
every input replicated, once per input with that input in each of its possible placements (the others
replicated) and once per placement with all inputs of the same rank in it, recording what
it keeps and what it needs. Placeholders may
take ``Replicate`` or ``Shard`` of any dim (a batch input: its dim 0 or replicated). The
graph is not changed; the planner chooses among these, and the manual-plan path checks
that what it chose is among them.

Before/after (annotations only)::

    mm = aten.mm(view, t)   # f32[8, 64] x f32[64, 256]
    # after: strategies(mm) == [(R, R) -> (R,) [dtensor], (S(1), S(0)) -> (P(sum),) [dtensor],
    #                           (S(0), R) -> (S(0),) [dtensor], (R, S(1)) -> (S(1),) [dtensor], ...]
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .. import graph_meta as gmeta
from ..errors import UnsupportedOpError
from ..placement import Partial, Placement, Replicate, Shard
from ..strategy import Strategy
from .context import PassContext
from .sharding_rules import RuleResult, _arg, call_rule, dtensor_node_strategies, rule_for, tensor_args

R = Replicate()


def _candidates(node: torch.fx.Node) -> list[Placement]:
    nd = node.meta["val"].dim() if isinstance(node.meta.get("val"), torch.Tensor) else 0
    return [Shard(d) for d in range(nd)] + [Partial()]


def _from_rule(node: torch.fx.Node, mesh_size: int | None = None) -> list[Strategy]:
    rule = rule_for(node)
    if rule is None:
        return []
    args = [a for _, a in tensor_args(node)]
    paths = [p for p, _ in tensor_args(node)]
    trials: list[dict] = [{}]
    for a in args:
        for c in _candidates(a):
            trials.append({a: c})
    if args:  # every input of the first one's rank placed alike (e.g. gradient and output of a backward)
        nd = len(_candidates(args[0]))
        for c in _candidates(args[0]):
            trials.append({a: c for a in args if len(_candidates(a)) == nd})
    found: list[Strategy] = []
    for trial in trials:
        try:
            res: RuleResult | None = call_rule(rule, node, lambda a, t=trial: t.get(a, R), mesh_size)
        except UnsupportedOpError:
            continue
        if res is None:
            continue  # our rule leaves this form to DTensor's strategies (listed above)
        ins = tuple(res.needs.get(path, trial.get(a, R)) for path, a in zip(paths, args))
        outs = res.out if isinstance(res.out, tuple) else (res.out,)
        s = Strategy(ins, tuple(outs), "adaptdist")
        if s not in found:
            found.append(s)
    return found


def _updated(buffer: torch.fx.Node) -> bool:
    """Whether the graph returns a new value of this buffer placeholder (an output role ``buffer:<fqn>``)."""
    out = buffer.graph.output_node()
    return f"buffer:{gmeta.get_fqn(buffer)}" in (gmeta.get_output_roles(out) or [])


def node_strategies(node: torch.fx.Node, ctx: PassContext) -> list[Strategy]:
    """The candidate strategies of one node along the mesh axis of ``ctx`` (see the module docstring)."""
    if node.op == "placeholder":
        val = node.meta["val"]
        if gmeta.get_role(node) == "batch":
            return [Strategy((), (R,), "adaptdist"), Strategy((), (Shard(0),), "adaptdist")]
        if gmeta.get_role(node) == "buffer" and _updated(node):
            # a buffer the step updates (BatchNorm's running statistics) is returned whole: kept whole
            return [Strategy((), (R,), "adaptdist")]
        return [Strategy((), (R,), "adaptdist")] + [Strategy((), (Shard(d),), "adaptdist") for d in range(val.dim())]
    if node.op == "get_attr":
        return [Strategy((), (R,), "adaptdist")]
    if node.op != "call_function":
        return []
    if node.target is operator.getitem:
        # one output of a multi-output op: whatever its producer's strategies make of it
        src, idx = node.args
        out = []
        for st in gmeta.get_strategies(src) or []:
            s = Strategy((st.outputs,), (st.outputs[idx],), st.source)
            if st.outputs[idx] is not None and s not in out:
                out.append(s)
        return out
    torch_side = dtensor_node_strategies(node, ctx.axis_size) or []
    rule_side = _from_rule(node, ctx.axis_size)
    if node.target == torch.ops.aten.embedding_dense_backward.default and not _arg(node, 4, "scale_grad_by_freq", False):
        # each rank's own rows of a vocabulary-parallel table; valid together with its forward lookup
        # reading a table sharded S(0) (the vocab_parallel_embedding pass rewrites both)
        rule_side.append(Strategy((R, R), (Shard(0),), "adaptdist"))
    ours = [s for s in rule_side if not any((s.inputs, s.outputs) == (t.inputs, t.outputs) for t in torch_side)]
    return torch_side + ours


def list_strategies(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Annotate every node with its candidate strategies; returns ``(gm, changed)``.

    Raises:
        UnsupportedOpError: an op that takes tensors has no strategy from DTensor nor a rule of
            ours (names the op, node and shapes), unless ``ctx.replicate_fallback``.
    """
    changed = False
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        found = node_strategies(node, ctx)
        if not found and node.op == "call_function":
            if tensor_args(node) and not ctx.replicate_fallback:
                raise UnsupportedOpError(
                    f"op {node.target} at node {node.name!r}{gmeta.where_of(node)} "
                    f"({', '.join(gmeta.shape_str(a) for _, a in tensor_args(node))})"
                    " has no sharding strategy in DTensor nor in adaptdist/passes/sharding_rules.py; pass "
                    "--replicate-fallback to run it whole on every rank"
                )
            found = [Strategy((R,) * len(tensor_args(node)), (R,), "adaptdist")]
        if gmeta.get_strategies(node) != found:
            gmeta.set_strategies(node, found)
            changed = True
    return gm, changed
