"""Pass (runtime, per rank): put a shared-memory axis's collectives back on gloo -- the inverse of
:func:`adaptdist.passes.use_shm_collectives.use_shm_collectives`.

Used when ``--comm auto`` lowered an axis onto shared memory but its group could not be made when the run
started (:class:`~adaptdist.errors.ShmCapacityError`: /dev/shm filled between the lowering's check and the
group's creation, or the artifacts compiled where /dev/shm was larger): every rank agrees on the axes and rewrites
its program once, before the first step (:mod:`adaptdist.runtime.shm_groups`), so no collective pays for the choice.

Each ``adaptdist.shm_X(..., shm_name)`` on such a group becomes ``_c10d_functional.X(..., group_name)`` followed by
its ``wait_tensor``; a started ``shm_X_start`` becomes the functional collective and its ``shm_wait`` the
``wait_tensor``; ``shm_flatten_all_reduce_start(parts, offset, op, shm_name)`` becomes ``aten.cat(parts)`` and the
functional all_reduce (the values the gloo lowering computes: the same ops in the same order as a program lowered
with ``--comm gloo``).
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.fx

from ..comm_transport import SHM_FLATTEN_OP, SHM_OPS, SHM_START_OPS, SHM_WAIT_OP, _adaptdist_op_name

_BLOCKING = {v: k for k, v in SHM_OPS.items()}
_STARTED = {v: k for k, v in SHM_START_OPS.items()}


def use_gloo_collectives(gm: torch.fx.GraphModule, gloo_names: Mapping[str, str]
                         ) -> tuple[torch.fx.GraphModule, bool]:
    """Swap the shared-memory collectives of ``gm`` on the groups of ``gloo_names`` (shared-memory group name -> the
    functional collectives' group name, ``{"adaptdist:dp[0,1]": "adaptdist:dp"}``) back to functional collectives and
    their waits; returns ``(gm, changed)``. Linted and recompiled when changed."""
    if not gloo_names:
        return gm, False
    graph = gm.graph
    c10d = torch.ops._c10d_functional
    wait_op = c10d.wait_tensor.default
    changed = False
    started: set[torch.fx.Node] = set()  # new functional collectives whose shm_wait becomes a wait_tensor
    for node in list(graph.nodes):
        if node.op != "call_function" or not node.args:
            continue
        name = _adaptdist_op_name(node.target)
        if name == SHM_WAIT_OP:
            if node.args[0] in started:
                node.target = wait_op
                changed = True
            continue
        if name is None or str(node.args[-1]) not in gloo_names:
            continue
        group = gloo_names[str(node.args[-1])]
        with graph.inserting_before(node):
            if name == SHM_FLATTEN_OP:
                parts, _offset, *rest = node.args[:-1]
                cat = graph.call_function(torch.ops.aten.cat.default, (list(parts),))
                cat.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "stack_trace")}
                new = graph.call_function(c10d.all_reduce.default, (cat, *rest, group))
            elif name in _BLOCKING or name in _STARTED:
                base = _BLOCKING.get(name) or _STARTED[name]
                new = graph.call_function(getattr(c10d, base).default, (*node.args[:-1], group))
            else:
                continue
            new.meta = dict(node.meta)
        if name in _BLOCKING:
            with graph.inserting_after(new):
                done = graph.call_function(wait_op, (new,))
            done.meta = dict(node.meta)
        else:
            done = new
            started.add(new)
        node.replace_all_uses_with(done)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm, changed
