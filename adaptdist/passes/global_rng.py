"""Pass: random numbers that do not depend on the world size (``LoweringOptions.rng == "global"``).

Under ``rng="per-rank"`` (DDP's behaviour, the default) each rank draws the random numbers of its own
shard from its own generator: dropout masks depend on the number of ranks and on each rank's seed. Under
``rng="global"`` every rank starts from the same generator state (``adaptdist train`` seeds every rank
with ``--seed``; a backend script calls ``torch.manual_seed(s)`` on every rank) and every random op draws
the whole tensor one process would draw on the whole batch, then keeps this rank's shard. Each rank's
generator then advances exactly as one process's does, so the next random op draws the same numbers too,
and masks equal single-process eager bit for bit on any number of ranks, uneven shards included.

How (one mesh axis at a time, like every pass):

* :func:`mark_random_ops` (called by the lowering before the pipeline) marks every random op; the rules
  ``random_like`` and ``dropout`` of :mod:`.sharding_rules` then keep a random op of a replicated input
  replicated (every rank draws the same whole tensor) instead of splitting it; a consumer that wants it
  sharded gets a rank slice from ``insert_redistributes``.
* :func:`global_rng` (after propagation) rewrites a random op whose input is sharded: it draws the whole
  tensor (an ``empty_strided`` of the global shape and strides, replicated, as its shape-only input), then
  keeps this rank's interval with a rank slice that localization aligns with the op's input. Dropout is
  the mask drawn so (``bernoulli.p(1 - p)``, what eager's CPU dropout draws, in the memory order of its
  input: :func:`_bernoulli_whole`), times the input, times ``1 / (1 - p)``.

Before/after (batch 7 over 3 ranks, ``x: f32[7, 16] S(0)``; rank 2 holds row 6)::

    native_dropout = aten.native_dropout(x, 0.1, True)         # (f32[7, 16], b8[7, 16]) S(0)
    # becomes
    empty_strided = aten.empty_strided([7, 16], [16, 1])       # R
    bernoulli = aten.bernoulli.p(empty_strided, 0.9)           # f32[7, 16] R: every rank draws all 112
    slice_1 = aten.slice.Tensor(bernoulli, 0, 0, 7)            # rank slice, aligned with x: rank 2 [6, 7)
    mul = aten.mul.Tensor(aten.mul.Tensor(x, slice_1), 1.111)  # the dropout output, S(0)
    ne = aten.ne.Scalar(slice_1, 0)                            # the mask, S(0)

Under the torch.compile backend the joint graph draws ``[W, *s]`` (rank dim 0, one rank's shape ``s``); one
process on the whole batch draws ``s`` with the batch ``W`` times larger. Where the batch is the outermost
factor of ``s`` the orders agree; where it is not (dropout on a time-major ``[L, B, D]``), the capture records
where it is (:mod:`adaptdist.compiler.eager_batch`, node meta ``adaptdist.eager_batch``) and the op is drawn in
eager's shape, its ranks' rows moved to dim 0 (:func:`_whole_in_eager_order`), replicated or then sliced. A draw
whose rows the capture cannot follow keeps the rank-major draw, and the capture logs a warning naming it. CPU's
``bernoulli_`` and ``uniform_`` fill a tensor in memory order, so the draw also keeps the layout one rank's graph
gives the tensor it fills (a dropout of a permuted activation: ``empty_like`` keeps its strides).

Cost: every rank draws the whole tensor, ``world`` times its shard's random numbers per random op (and
holds the whole mask for a moment); measured in the README.

Not covered: random ops whose random input carries values (``bernoulli(probabilities)``, ``normal(mean,
std)``, ``poisson``, ``multinomial``) on a sharded input are refused (UnsupportedOpError); random
factories whose shape does not involve the batch, under the torch.compile backend (its graph is every
rank's forward under ``torch.vmap(randomness="different")``: such an op draws one value per rank, where
one process on the whole batch would draw it once).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from .. import graph_meta as gmeta
from ..graph_meta import EAGER_BATCH, EAGER_ORDER
from ..errors import UnsupportedOpError
from ..placement import Replicate, Shard
from .context import PassContext
from .graph_build import add_op
from .infra import placement_of
from .insert_redistributes import rank_slice

aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    out = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload or "default", None)
        if op is not None:
            out.add(op)
    return frozenset(out)


FILL_LIKE = _ops("rand_like", "randn_like", "randint_like", "randint_like.low_dtype", "bernoulli.p",
                 "uniform", "normal_functional", "exponential", "geometric", "cauchy", "log_normal",
                 "random", "random.from", "random.to")
"""Random ops whose first argument gives only a shape (its values are not read): drawn on an ``empty_strided``
of the global shape."""

DROPOUT = _ops("native_dropout")

FACTORIES = _ops("rand", "randn", "randint", "randint.low", "normal.float_float", "randperm")
"""Random ops made from sizes alone (replicated by :func:`~.sharding_rules.apply_rule`)."""

VALUED = _ops("bernoulli", "bernoulli.Tensor", "bernoulli.float", "normal.Tensor_Tensor", "normal.Tensor_float",
              "normal.float_Tensor", "poisson", "multinomial", "binomial", "_standard_gamma", "_sample_dirichlet",
              "rrelu_with_noise", "rrelu_with_noise_functional")
"""Random ops whose tensor inputs carry values (probabilities, means): not drawn whole from a shard."""

RANDOM_OPS = FILL_LIKE | DROPOUT | FACTORIES | VALUED


def mark_random_ops(gm: torch.fx.GraphModule) -> int:
    """Mark every random op of ``gm`` (:func:`adaptdist.graph_meta.mark_global_rng`), so the sharding rules
    keep those of replicated inputs replicated. Returns how many were marked."""
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in RANDOM_OPS:
            gmeta.mark_global_rng(node)
            n += 1
    return n


def _dense_strides(v: torch.Tensor) -> list[int]:
    """``v``'s strides if they are non-overlapping and dense (``empty_like``'s preserve_format keeps them),
    else contiguous strides."""
    stride = list(v.stride())
    order = sorted((i for i in range(v.dim()) if v.shape[i] != 1), key=lambda i: stride[i])
    acc = 1
    for i in order:  # a permutation of a contiguous layout (size-1 dims take any stride)
        if stride[i] != acc:
            break
        acc *= int(v.shape[i])
    else:
        return stride
    strides, acc = [], 1
    for s in reversed(v.shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return strides[::-1]


def _whole(graph: torch.fx.Graph, like: torch.Tensor, contiguous: bool) -> torch.fx.Node:
    """A replicated ``empty_strided`` with the global shape and dtype of ``like`` (its fake value)."""
    strides = _dense_strides(like.contiguous() if contiguous else like)
    node = graph.call_function(aten.empty_strided.default, (list(like.shape), strides),
                               {"dtype": like.dtype, "device": like.device, "pin_memory": False})
    mode = getattr(like, "fake_mode", None)
    with mode if mode is not None else torch.no_grad():
        node.meta["val"] = torch.empty_strided(list(like.shape), strides, dtype=like.dtype, device=like.device)
    gmeta.set_placements(node, (Replicate(),))
    return node


def _bernoulli_whole(graph: torch.fx.Graph, like: torch.Tensor, p: float) -> torch.fx.Node:
    """``bernoulli.p`` of the global shape of ``like``, drawn as eager's ``empty_like(like).bernoulli_(p)`` draws it:
    CPU's ``bernoulli_`` fills in memory order and ``empty_like`` keeps a dense layout (a dropout of a transposed
    activation), while functional ``bernoulli.p`` returns a contiguous tensor whatever its input's strides. So the
    mask is drawn contiguous with its dims in memory order, then permuted back (and made contiguous)."""
    strides = _dense_strides(like)
    order = sorted(range(like.dim()), key=lambda i: (-strides[i] if like.shape[i] != 1 else 0, i))
    order = [i for i in order if like.shape[i] != 1]
    it = iter(order)
    order = [i if like.shape[i] == 1 else next(it) for i in range(like.dim())]
    if order == list(range(like.dim())):
        full = add_op(graph, aten.bernoulli.p, (_whole(graph, like, contiguous=True), p), Replicate())
        gmeta.mark_global_rng(full)
        return full
    mode = getattr(like, "fake_mode", None)
    with mode if mode is not None else torch.no_grad():
        mem_like = torch.empty([int(like.shape[i]) for i in order], dtype=like.dtype, device=like.device)
    full = add_op(graph, aten.bernoulli.p, (_whole(graph, mem_like, contiguous=True), p), Replicate())
    gmeta.mark_global_rng(full)
    back = add_op(graph, aten.permute.default, (full, [order.index(i) for i in range(like.dim())]), Replicate())
    return add_op(graph, aten.clone.default, (back,), Replicate(), kwargs={"memory_format": torch.contiguous_format})


def _eager_loc(node: torch.fx.Node, d: int) -> tuple | None:
    """``((dim, outer, rows), order)`` for a random op of the backend's joint graph (sharded on its rank dim ``d``,
    or replicated: ``d`` 0) whose draw differs from eager's drawn rank-major: one rank's batch rows are not its
    outermost factor, or the tensor it fills is laid out otherwise than contiguous (``order``: one rank's dims,
    outermost first in memory; :mod:`adaptdist.compiler.eager_batch`); else None."""
    loc = node.meta.get(EAGER_BATCH)
    if not isinstance(loc, tuple) or d != 0:
        return None
    order = tuple(node.meta.get(EAGER_ORDER) or ())
    if loc[0] == 0 and loc[1] == 1 and order == tuple(range(len(order))):
        return None
    return loc, order


def _whole_in_eager_order(graph: torch.fx.Graph, op: Any, like: torch.Tensor, args: tuple, kwargs: dict,
                          where: tuple) -> torch.fx.Node:
    """``op`` drawn whole as one process on the whole batch draws it, the ranks' rows then moved to dim 0:
    ``like`` is the joint value ``[W, *s]`` (rank dim 0); ``where = ((k, outer, rows), order)``: one rank's batch
    is at ``k`` of ``s`` and the tensor it fills is laid out in ``order`` (dims outermost first). One process
    draws ``s`` with dim ``k`` ``W`` times larger (rank ``r``'s rows after rank ``r - 1``'s within each of the
    ``outer`` blocks), filling it in memory order (CPU's ``bernoulli_``/``uniform_``): drawn contiguous with its
    dims in memory order (functional ``bernoulli.p`` returns a contiguous tensor whatever its input's strides),
    permuted back and made contiguous, viewed ``[*s[:k], outer, W, s[k] / outer,
    *s[k+1:]]``, ``W`` moved to the front and made contiguous ``[W, *s]``: replicated, every rank holds every
    rank's draw."""
    (k, outer, _), order = where
    world, s = int(like.shape[0]), [int(v) for v in like.shape[1:]]
    order = list(order) if sorted(order) == list(range(len(s))) else list(range(len(s)))
    eager = list(s)
    eager[k] *= world
    mem = [eager[i] for i in order]  # the eager tensor's dims in memory order: drawn contiguous in that shape
    strides, acc = [], 1
    for v in reversed(mem):
        strides.append(acc)
        acc *= max(v, 1)
    whole = graph.call_function(aten.empty_strided.default, (mem, strides[::-1]),
                                {"dtype": like.dtype, "device": like.device, "pin_memory": False})
    mode = getattr(like, "fake_mode", None)
    with mode if mode is not None else torch.no_grad():
        whole.meta["val"] = torch.empty_strided(mem, strides[::-1], dtype=like.dtype, device=like.device)
    gmeta.set_placements(whole, (Replicate(),))
    full = add_op(graph, op, (whole, *args), Replicate(), kwargs=dict(kwargs))
    gmeta.mark_global_rng(full)
    if order != list(range(len(s))):  # back to the eager tensor's dim order
        full = add_op(graph, aten.permute.default, (full, [order.index(i) for i in range(len(s))]), Replicate())
        full = add_op(graph, aten.clone.default, (full,), Replicate(), kwargs={"memory_format": torch.contiguous_format})
    split = add_op(graph, aten.view.default, (full, [*s[:k], outer, world, s[k] // outer, *s[k + 1:]]), Replicate())
    perm = [k + 1] + [i for i in range(len(s) + 2) if i != k + 1]
    moved = add_op(graph, aten.permute.default, (split, perm), Replicate())
    flat = add_op(graph, aten.clone.default, (moved,), Replicate(), kwargs={"memory_format": torch.contiguous_format})
    return add_op(graph, aten.view.default, (flat, [world, *s]), Replicate())


def _keep_rows(graph: torch.fx.Graph, full: torch.fx.Node, dim: int, align: torch.fx.Node, ctx: PassContext
               ) -> torch.fx.Node:
    """This rank's interval of ``full`` on ``dim``: a rank slice aligned with ``align`` (made contiguous when
    ``dim`` is not the outermost: some ATen kernels read strided inputs wrongly, see insert_redistributes)."""
    after = full.next
    s = rank_slice(graph, full, dim, before=after, group_name=ctx.group_name)
    gmeta.set_rank_slice_align(s, align)
    if any(n > 1 for n in full.meta["val"].shape[:dim]):
        with graph.inserting_before(after):
            s = add_op(graph, aten.clone.default, (s,), Shard(dim), kwargs={"memory_format": torch.contiguous_format})
    return s


def _align_target(x: torch.fx.Node, node: torch.fx.Node, d: int) -> torch.fx.Node:
    """The node whose rows on ``d`` the shard of random op ``node`` (of input ``x``) must be: ``x``, or, when ``x``
    is used only to give ``node`` its shape (``empty_like`` before the ``bernoulli`` of dropout under vmap) and so
    disappears once the whole tensor is drawn instead, the nearest ancestor of the same rows that stays."""
    chain = {node}
    cur = x
    while cur.op == "call_function" and all(u in chain for u in cur.users):
        size = cur.meta["val"].shape[d]
        nxt = next((a for a in cur.all_input_nodes
                    if gmeta.get_placements(a) is not None and placement_of(a) == Shard(d)
                    and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].shape[d] == size), None)
        if nxt is None:
            break
        chain.add(cur)
        cur = nxt
    return cur


def _sharded_dim(p) -> int | None:
    ps = p if isinstance(p, tuple) else (p,)
    dims = {q.dim for q in ps if isinstance(q, Shard)}
    if not dims:
        return None
    assert len(dims) == 1, f"outputs of one random op sharded on different dims: {p}"
    return dims.pop()


def global_rng(gm: torch.fx.GraphModule, ctx: PassContext) -> tuple[torch.fx.GraphModule, bool]:
    """Make every random op with a sharded output draw the whole tensor and keep this rank's shard (module
    docstring); returns ``(gm, changed)``. Nothing to do unless ``ctx.rng == "global"``.

    Raises:
        UnsupportedOpError: a random op whose tensor inputs carry values (``bernoulli(probabilities)``,
            ``normal(mean, std)``, ...) on a sharded input, naming the node, op and shape.
    """
    if ctx.rng != "global" or ctx.axis_size == 1:
        return gm, False
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in RANDOM_OPS:
            continue
        d = _sharded_dim(placement_of(node))
        x = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if d is None:
            # replicated: every rank draws the same whole tensor from the same generator state; under the
            # backend, in the order one process on the whole batch draws it when its batch is not outermost
            loc = _eager_loc(node, 0)
            if loc is not None and x is not None and node.target in FILL_LIKE | DROPOUT:
                changed |= _redraw_replicated(graph, node, x, loc)
            continue
        if node.target in VALUED or x is None:
            raise UnsupportedOpError(
                f"node {node.name!r} ({node.target}, {gmeta.shape_str(node)}){gmeta.where_of(node)} draws random "
                f"numbers for a sharded value ({placement_of(node)!r} on mesh axis {ctx.mesh_axis}); rng='global' "
                "draws each random tensor whole on every rank, which this op cannot do from its shard. Use "
                "rng='per-rank' (--rng per-rank, adaptdist.backend(rng='per-rank')), or draw with torch.rand_like "
                "and compare instead")
        if node.target in DROPOUT:
            changed |= _rewrite_dropout(graph, node, x, d, ctx)
            continue
        loc = _eager_loc(node, d)
        with graph.inserting_before(node):
            if loc is not None:
                full = _whole_in_eager_order(graph, node.target, x.meta["val"], node.args[1:], node.kwargs, loc)
            elif node.target is aten.bernoulli.p and not node.kwargs:
                full = _bernoulli_whole(graph, x.meta["val"], node.args[1])
            else:
                whole = _whole(graph, x.meta["val"], contiguous=node.target is aten.bernoulli.p)
                full = add_op(graph, node.target, (whole, *node.args[1:]), Replicate(), kwargs=dict(node.kwargs))
                gmeta.mark_global_rng(full)
        local = _keep_rows(graph, full, d, _align_target(x, node, d), ctx)
        node.replace_all_uses_with(local)
        graph.erase_node(node)
        changed = True
    return gm, changed


def _redraw_replicated(graph: torch.fx.Graph, node: torch.fx.Node, x: torch.fx.Node, loc: tuple) -> bool:
    """A replicated random op of the backend's joint graph (``[W, *s]``, rank dim 0) whose batch rows are at
    ``loc`` of ``s``, not outermost: drawn whole in eager's order instead (:func:`_whole_in_eager_order`);
    returns whether it rewrote (a ``train=False`` dropout draws nothing)."""
    if node.target in DROPOUT:
        p1m = _dropout_keep(node)
        if p1m is None:
            return False
        with graph.inserting_before(node):
            mask_f = _whole_in_eager_order(graph, aten.bernoulli.p, x.meta["val"], (p1m,), {}, loc)
            out = add_op(graph, aten.mul.Tensor, (add_op(graph, aten.mul.Tensor, (x, mask_f), Replicate()),
                                                  0.0 if p1m == 0 else 1.0 / p1m), Replicate())
            mask = add_op(graph, aten.ne.Scalar, (mask_f, 0), Replicate())
        _replace_dropout(graph, node, out, mask)
        return True
    with graph.inserting_before(node):
        full = _whole_in_eager_order(graph, node.target, x.meta["val"], node.args[1:], node.kwargs, loc)
    node.replace_all_uses_with(full)
    graph.erase_node(node)
    return True


def _rewrite_dropout(graph: torch.fx.Graph, node: torch.fx.Node, x: torch.fx.Node, d: int, ctx: PassContext) -> bool:
    """``native_dropout(x, p, train)`` (sharded like ``x`` on ``d``) -> whole mask, this rank's rows, ``x * mask
    * scale``; returns whether it rewrote. A ``train=False`` dropout draws nothing and stays."""
    p1m = _dropout_keep(node)
    if p1m is None:
        return False
    scale = 0.0 if p1m == 0 else 1.0 / p1m
    sp = Shard(d)
    loc = _eager_loc(node, d)
    with graph.inserting_before(node):
        if loc is not None:
            full = _whole_in_eager_order(graph, aten.bernoulli.p, x.meta["val"], (p1m,), {}, loc)
        else:
            full = _bernoulli_whole(graph, x.meta["val"], p1m)
    mask_f = _keep_rows(graph, full, d, x, ctx)
    with graph.inserting_before(node):
        masked = add_op(graph, aten.mul.Tensor, (x, mask_f), sp)
        needs = gmeta.get_redistribute(node)  # the input's reshard (R -> S), if propagation recorded one
        if needs.get((0,)) is not None:
            gmeta.set_redistribute(masked, {(0,): needs[(0,)]})
        out = add_op(graph, aten.mul.Tensor, (masked, scale), sp)
        mask = add_op(graph, aten.ne.Scalar, (mask_f, 0), sp)
    _replace_dropout(graph, node, out, mask)
    return True


def _dropout_keep(node: torch.fx.Node) -> float | None:
    """``native_dropout(x, p, train)``'s keep probability ``1 - p``; None for ``train=False`` (it draws nothing)."""
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return None if train is False else 1.0 - float(node.args[1])


def _replace_dropout(graph: torch.fx.Graph, node: torch.fx.Node, out: torch.fx.Node, mask: torch.fx.Node) -> None:
    """Give ``native_dropout`` ``node``'s two outputs (read through getitem) to ``out`` and ``mask``; erase it."""
    for user in list(node.users):
        assert user.target is operator.getitem, f"native_dropout {node.name} used by {user.name} without getitem"
        user.replace_all_uses_with(out if user.args[1] == 0 else mask)
        graph.erase_node(user)
    graph.erase_node(node)
