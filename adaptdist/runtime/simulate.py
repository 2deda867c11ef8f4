"""Run every rank's program in one process, in lockstep, with collectives simulated.

Used by tests (numerics without processes) and for debugging a lowering: each
rank's graph runs node by node; at a functional ``all_reduce`` the values of all
ranks are summed and every rank receives the sum, at ``all_gather_into_tensor``
every rank receives their concatenation on dim 0 (equal shapes required, as the
real collective requires), at ``reduce_scatter_tensor`` rank r receives block r of
the sum, exactly what the collectives compute; ``wait_tensor``
is the identity. The simulated mesh is 1-D: every collective spans all ranks.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from .. import _torch_compat as compat


def simulate_ranks(graph_modules: Sequence[torch.fx.GraphModule], inputs: Sequence[Sequence[Any]]) -> list[Any]:
    """Run ``graph_modules[r](*inputs[r])`` for all ranks; returns each rank's outputs.

    Raises:
        ValueError: the ranks' graphs differ in structure (different op sequences),
            which would hang or mismatch collectives in a real run.
    """
    graphs = [list(gm.graph.nodes) for gm in graph_modules]
    if len({len(g) for g in graphs}) != 1:
        raise ValueError(f"rank graphs have different lengths {[len(g) for g in graphs]}")
    envs: list[dict[torch.fx.Node, Any]] = [{} for _ in graph_modules]
    arg_iters = [iter(a) for a in inputs]
    all_reduce, wait = compat.functional_all_reduce_op(), compat.functional_wait_op()
    all_gather = compat.functional_all_gather_op()
    reduce_scatter = compat.functional_reduce_scatter_op()
    results: list[Any] = [None] * len(graph_modules)
    for step in zip(*graphs):
        ops = {(n.op, n.target if n.op != "placeholder" else None) for n in step}
        if len(ops) != 1:
            raise ValueError(f"ranks disagree at node {[n.name for n in step]}: {ops}")
        first = step[0]
        if first.op == "call_function" and first.target is all_reduce:
            vals = [envs[r][n.args[0]] for r, n in enumerate(step)]
            total = torch.stack(vals).sum(0)
            for r, n in enumerate(step):
                envs[r][n] = total.clone()
            continue
        if first.op == "call_function" and first.target is reduce_scatter:
            vals = [envs[r][n.args[0]] for r, n in enumerate(step)]
            if len({tuple(v.shape) for v in vals}) != 1 or vals[0].shape[0] % len(step):
                raise ValueError(f"reduce_scatter at {first.name}: shapes {[tuple(v.shape) for v in vals]} are "
                                 f"unequal or not divisible by {len(step)} ranks")
            blocks = torch.stack(vals).sum(0).chunk(len(step))
            for r, n in enumerate(step):
                envs[r][n] = blocks[r].clone()
            continue
        if first.op == "call_function" and first.target is all_gather:
            vals = [envs[r][n.args[0]] for r, n in enumerate(step)]
            if len({tuple(v.shape) for v in vals}) != 1:
                raise ValueError(f"all_gather at {first.name}: ranks pass different shapes {[tuple(v.shape) for v in vals]}")
            total = torch.cat(vals)
            for r, n in enumerate(step):
                envs[r][n] = total.clone()
            continue
        for r, n in enumerate(step):
            env = envs[r]

            def load(a, env=env):
                return env[a]

            if n.op == "placeholder":
                env[n] = next(arg_iters[r])
            elif n.op == "get_attr":
                env[n] = getattr(graph_modules[r], n.target)
            elif n.op == "call_function":
                args = torch.fx.node.map_arg(n.args, load)
                kwargs = torch.fx.node.map_arg(n.kwargs, load)
                env[n] = args[0] if n.target is wait else n.target(*args, **kwargs)
            elif n.op == "output":
                results[r] = torch.fx.node.map_arg(n.args[0], load)
            else:
                raise ValueError(f"unsupported node kind {n.op} at {n.name}")
    return results
