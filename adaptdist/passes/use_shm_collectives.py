"""Pass (late, per rank): carry the collectives of shared-memory axes through adaptdist's kernels.

Runs on each rank's localized graph after the lowering and its consistency checks
(``compiler/lowering.py``), for the groups of the mesh axes that :func:`adaptdist.comm_transport.axis_transports`
puts on shared memory. Each ``_c10d_functional.X(..., group_name)`` on such a group, with the ``wait_tensor``
that follows it, becomes ``torch.ops.adaptdist.shm_X(..., shm_name)`` with the same other arguments (the ops
mirror the functional collectives' signatures and are complete on return: no wait). ``shm_name`` names the
shared-memory group by this rank's group's ranks (:func:`adaptdist.mesh.shm_group_name`, ``adaptdist:dp[0,1]``):
a shared-memory group cannot be re-pointed between runs as a gloo group's name is, so graphs over other ranks
(the torch.compile backend's graphs on different meshes) must name other groups. An all_reduce, all_gather or
reduce_scatter whose wait does not follow it at once (work in between: a gradient bucket's collective issued
before the rest of backward) becomes the started op, ``adaptdist.shm_X_start``, and its wait
``adaptdist.shm_wait``: with the group's comm thread on, the caller computes on while that thread carries the
collective, as gloo's worker thread does for a functional collective; with it off the started op completes on
return. Everything before this pass
(planner, passes, consistency checks, cost model) sees the functional collectives unchanged.

An all_reduce of a gradient bucket (``aten.cat`` of 1-d tensors) becomes ``adaptdist.shm_flatten_all_reduce_start``:
the cat's copy goes straight into the rank's registered input region and the all_reduce skips its copy-in
(:func:`_fuse_bucket_flattens`).

Stays on gloo (left as is): an ``all_to_all_single`` with uneven splits; an ``all_reduce`` /
``reduce_scatter_tensor`` whose reduce op the kernels lack (only sum, avg, max) or whose dtype they do not
reduce (only float32, bfloat16, float16); a ``broadcast`` (its ``src`` is a global rank, the kernel's a group
rank; the lowering issues none); coalesced collectives.

Before/after (a gradient bucket on ``dp``, local shapes)::

    all_reduce = _c10d_functional.all_reduce(cat, 'sum', 'adaptdist:dp')      # f32[2112]
    wait_tensor = _c10d_functional.wait_tensor(all_reduce)
    split = aten.split_with_sizes(wait_tensor, [2048, 64])
    # becomes (rank 0 of dp=2)
    shm_all_reduce = adaptdist.shm_all_reduce(cat, 'sum', 'adaptdist:dp[0,1]')    # f32[2112]
    split = aten.split_with_sizes(shm_all_reduce, [2048, 64])
    # and a bucket of 256 KiB or more (f32[65600]) is flattened into the registered input region at its offset
    shm_flatten = adaptdist.shm_flatten_all_reduce_start([reshape, reshape_1], 0, 'sum', 'adaptdist:dp[0,1]')
    shm_wait = adaptdist.shm_wait(shm_flatten)
"""

from __future__ import annotations

from typing import AbstractSet, Mapping

import torch
import torch.fx

from .. import _torch_compat as compat
from ..comm_transport import SHM_OPS, SHM_START_OPS

_REDUCE_OPS = ("sum", "avg", "max")
_REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _functional_name(target) -> str | None:
    """``"all_reduce"`` for ``torch.ops._c10d_functional.all_reduce.default`` etc.; None for other targets."""
    if compat.functional_collective_kind(target) in (None, "wait"):
        return None
    name = getattr(getattr(target, "overloadpacket", None), "__name__", None)
    return name if name in SHM_OPS else None


def _supported(name: str, node: torch.fx.Node) -> bool:
    """Whether the kernel computes what ``node`` (a functional collective ``name``) computes."""
    inp = node.args[0]
    val = inp.meta.get("val") if isinstance(inp, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    if name in ("all_reduce", "reduce_scatter_tensor"):
        return str(node.args[1]).lower() in _REDUCE_OPS and val.dtype in _REDUCE_DTYPES
    if name == "all_to_all_single":
        out_splits, in_splits = node.args[1], node.args[2]
        n = len(out_splits) or len(in_splits)
        if not n or not val.dim():
            return False
        if not all(isinstance(s, int) for s in list(out_splits) + list(in_splits)):
            return False
        even = val.shape[0] // n
        return val.shape[0] % n == 0 and all(s == even for s in list(out_splits) + list(in_splits))
    return name in ("all_gather_into_tensor",)


def use_shm_collectives(gm: torch.fx.GraphModule, shm_groups: Mapping[str, str] | AbstractSet[str]
                        ) -> tuple[torch.fx.GraphModule, bool]:
    """Swap the functional collectives on the groups of ``shm_groups`` and their waits for
    ``torch.ops.adaptdist.shm_*`` (see the module docstring); returns ``(gm, changed)``. ``shm_groups``: functional
    group name -> the shared-memory group's name the op takes (``{"adaptdist:dp": "adaptdist:dp[0,1]"}``); a set
    keeps each name. The graph is linted and recompiled when it changed; untouched otherwise. Needs the kernels
    loaded (the ops must exist).
    """
    if not shm_groups:
        return gm, False
    names = dict(shm_groups) if isinstance(shm_groups, Mapping) else {g: g for g in shm_groups}
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or not node.args:
            continue
        name = _functional_name(node.target)
        if name is None or node.args[-1] not in names or node.kwargs or not _supported(name, node):
            continue
        waits = [u for u in node.users
                 if u.op == "call_function" and compat.functional_collective_kind(u.target) == "wait"]
        started = name in SHM_START_OPS and len(waits) == 1 and len(node.users) == 1 and waits[0] is not node.next
        op = getattr(torch.ops.adaptdist, (SHM_START_OPS if started else SHM_OPS)[name]).default
        with graph.inserting_before(node):
            new = graph.call_function(op, (*node.args[:-1], names[node.args[-1]]))
        new.meta = dict(node.meta)
        for user in waits:
            if started:  # the work between the issue and the wait overlaps the collective
                with graph.inserting_before(user):
                    wait = graph.call_function(torch.ops.adaptdist.shm_wait.default, (new,))
                wait.meta = dict(user.meta)
                user.replace_all_uses_with(wait)
            else:
                user.replace_all_uses_with(new)
            graph.erase_node(user)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        changed = True
    if changed:
        _fuse_bucket_flattens(graph)
        graph.lint()
        gm.recompile()
    return gm, changed


def _fuse_bucket_flattens(graph: torch.fx.Graph) -> None:
    """Each all_reduce of a gradient bucket of 256 KiB or more (``aten.cat`` of 1-d tensors used by nothing else)
    becomes ``adaptdist.shm_flatten_all_reduce_start(parts, offset, ...)`` (and, where it was complete on return,
    its ``shm_wait`` right after): the parts are copied straight into this rank's registered input region in place
    of the cat's copy, so the all_reduce skips its copy-in. Each such all_reduce of the graph gets its own
    64-byte-aligned offset in its group's region (every started op is waited for before the graph returns, so a slot
    is free again at the next run), and its output the same range of the shared output region, so all of them read
    in place. An all_reduce of one tensor stays as it is: copying all of it into the region costs more than the
    copy-in of the peers' slices it saves (16 MiB on 2 ranks: 2.84 ms vs 1.70 ms, 4 ranks 9.7 vs 5.6 ms;
    benchmarks/RESULTS.md, 2026-12-04); its output takes the top of the shared output region, out of the buckets'
    way. Smaller buckets (their outputs are private: every rank would fall back at the cost of one more barrier;
    those of 32 KiB or less would lose the inline path) and those past the region's end stay as they are. The ranks
    of a group lower the same collectives in the same order, hence pass the same offsets (a mismatch only costs the
    copy-in: the kernel falls back on every rank)."""
    from ..comm_transport import SHM_FLATTEN_OP
    from ..kernels.shm import INPUT_REGION_BYTES, SHARED_OUTPUT_MIN_BYTES

    start, whole = torch.ops.adaptdist.shm_all_reduce_start.default, torch.ops.adaptdist.shm_all_reduce.default
    wait_op = torch.ops.adaptdist.shm_wait.default
    flatten = getattr(torch.ops.adaptdist, SHM_FLATTEN_OP).default
    offsets: dict[str, int] = {}
    for node in list(graph.nodes):
        if node.target is not start and node.target is not whole:
            continue
        inp = node.args[0]
        val = inp.meta.get("val") if isinstance(inp, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        is_cat = (isinstance(inp, torch.fx.Node) and inp.target is torch.ops.aten.cat.default
                  and len(inp.users) == 1 and (len(inp.args) < 2 or inp.args[1] in (0, -1)))
        if not is_cat:
            continue
        parts = list(inp.args[0])
        vals = [p.meta.get("val") if isinstance(p, torch.fx.Node) else None for p in parts]
        if any(not isinstance(v, torch.Tensor) or v.dtype != val.dtype or v.dim() != 1 for v in vals):
            continue  # (cat promotes mixed dtypes; the fused op takes one)
        group = str(node.args[-1])
        size_bytes = val.numel() * val.element_size()
        offset = offsets.get(group, 0)
        if size_bytes < SHARED_OUTPUT_MIN_BYTES or offset + size_bytes > INPUT_REGION_BYTES:
            continue
        offsets[group] = offset + -(-size_bytes // 64) * 64
        flat_val = val.new_empty((val.numel(),))
        with graph.inserting_before(node):
            fused = graph.call_function(flatten, (parts, offset, *node.args[1:]))
            fused.meta = {**node.meta, "val": flat_val}
            done = fused
            if node.target is whole:
                done = graph.call_function(wait_op, (fused,))
                done.meta = {**node.meta, "val": flat_val}
        node.replace_all_uses_with(done)
        graph.erase_node(node)
        graph.erase_node(inp)
