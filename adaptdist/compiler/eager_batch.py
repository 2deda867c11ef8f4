"""Where each random op's batch rows are, for the torch.compile backend's ``rng="global"``.

The backend's joint graph is every rank's forward under ``torch.vmap`` (:mod:`.dynamo_capture`): a random op
draws a ``[W, *s]`` tensor, rank ``r``'s ``s`` at row ``r``. One process on the whole batch (eager) draws the
tensor whose batch factor is ``W`` times larger, in its own order. When the batch is the outermost factor of
``s`` (dim 0, as for dropout on ``[B, D]``) the two orders agree and drawing ``[W, *s]`` whole is eager's draw;
when it is not (dropout on a ``[L, B, D]`` activation), the numbers land on other elements than eager's
(tester's report: losses 0.939 vs eager's 0.930 on the first step). :func:`annotate_eager_batch` finds, for each
random op, where the batch factor sits in one rank's shape, so the global-rng pass
(:mod:`adaptdist.passes.global_rng`) draws the tensor in eager's shape and moves the ranks' rows to dim 0.

How: one rank's Dynamo graph is traced into ATen ops (fake tensors) and the location of the batch factor is
followed from the user inputs' dim 0 (the backend's input contract: each rank passes its rows on dim 0) op by
op: a location is ``(dim, outer, rows)``, the batch's ``rows`` being a factor of ``dim`` with ``outer`` elements
outside it (``[L*B]`` with the batch inner: ``(0, L, B)``). Views split and merge factors, permutes move dims,
pointwise ops, matmuls on their row dim, convolutions and reductions over other dims keep it; any other op on a
batch value makes its location unknown. The per-rank random ops are matched to the joint graph's in draw order.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch
import torch.fx

from .. import _torch_compat as compat
from ..graph_meta import EAGER_BATCH, EAGER_ORDER  # noqa: F401 -- the node meta this module writes

log = logging.getLogger("adaptdist.compiler")
aten = torch.ops.aten

NO_BATCH = "no batch"  # a value the same for every rank's rows (parameters, constants)
UNKNOWN = None

_RANDOM_PACKETS = {"bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like",
                   "normal", "normal_", "normal_functional", "uniform", "uniform_", "exponential", "exponential_",
                   "geometric", "geometric_", "cauchy", "cauchy_", "log_normal", "log_normal_", "random", "random_",
                   "randperm", "native_dropout", "multinomial", "poisson", "binomial", "_standard_gamma",
                   "_sample_dirichlet", "rrelu_with_noise", "rrelu_with_noise_functional"}
_LIKE = {"empty_like", "zeros_like", "ones_like", "full_like"}
_VIEWS = {"view", "_unsafe_view", "reshape", "squeeze", "unsqueeze", "flatten", "view_as", "alias", "clone",
          "contiguous", "detach", "_to_copy", "to", "lift_fresh_copy", "expand"}


def _packet(node: torch.fx.Node) -> str:
    op = getattr(node.target, "overloadpacket", None)
    return getattr(op, "__name__", "") if op is not None else ""


def is_random(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls an ATen op that draws from the generator (dropout, bernoulli, rand*, normal, ...)."""
    return node.op == "call_function" and _packet(node) in _RANDOM_PACKETS


def _shape(n: Any) -> tuple[int, ...] | None:
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    v = v[0] if isinstance(v, (tuple, list)) and v else v  # native_dropout: (output, mask)
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def memory_order(v: torch.Tensor) -> tuple[int, ...]:
    """``v``'s dims from outermost to innermost in memory when it is non-overlapping and dense (what
    ``empty_like``'s preserve_format keeps), else the identity (``empty_like`` then makes it contiguous)."""
    size, stride = list(v.shape), list(v.stride())
    order = sorted(range(v.dim()), key=lambda i: (-stride[i] if size[i] != 1 else 0, i))
    order = [i for i in order if size[i] != 1]
    acc = 1
    for i in reversed(order):
        if stride[i] != acc:
            return tuple(range(v.dim()))
        acc *= size[i]
    # size-1 dims take any place; keep them where they are relative to the identity
    ones = [i for i in range(v.dim()) if size[i] == 1]
    out, it = [], iter(order)
    for i in range(v.dim()):
        out.append(i if i in ones else next(it))
    return tuple(out)


def _view_loc(loc: tuple, src: tuple[int, ...], dst: tuple[int, ...]) -> Any:
    """The batch factor's location after viewing ``src`` as ``dst`` (row-major), or UNKNOWN when a dim of
    ``dst`` cuts through it."""
    dim, outer, rows = loc
    inner = math.prod(src[dim + 1:]) * (src[dim] // (outer * rows))  # elements inside one batch row
    for j in range(len(dst)):
        below = math.prod(dst[j + 1:])  # elements inside one index of dst's dim j
        if below and inner % below == 0 and (dst[j] * below) % (inner * rows) == 0:
            return (j, dst[j] * below // (inner * rows), rows)
    return UNKNOWN


def _loc_of(node: torch.fx.Node, locs: dict) -> Any:
    ins = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    got = [locs.get(a, UNKNOWN) for a in ins]
    batched = [(a, g) for a, g in zip(ins, got) if g != NO_BATCH]
    if not batched:
        return NO_BATCH
    if any(g is UNKNOWN for _, g in batched):
        return UNKNOWN
    out = _shape(node)
    name = _packet(node)
    first, loc = batched[0]
    src = _shape(first)
    if name == "native_layer_norm":  # (out, mean, rstd): getitem keeps out's location when the rows stay
        return loc if first is node.args[0] else UNKNOWN
    if name == "embedding" and first is node.args[1]:  # rows of indices -> rows of vectors
        return loc if len(batched) == 1 else UNKNOWN
    if name in ("split", "split_with_sizes") and first is node.args[0]:  # pieces along another dim keep the rows
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        return loc if dim % len(src) != loc[0] else UNKNOWN
    if name == "cat":  # along another dim, of pieces with the rows at one place (an empty past: skipped, as torch does)
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(out)
        pieces = [a for a in node.args[0] if isinstance(a, torch.fx.Node)]
        if dim != loc[0] and all(locs.get(a) == loc or (locs.get(a) == NO_BATCH and math.prod(_shape(a) or (1,)) == 0)
                                 for a in pieces) and len(out) == len(src):
            return loc
        return UNKNOWN
    if name in _RANDOM_PACKETS or name in _LIKE:
        return loc if first is node.args[0] else UNKNOWN
    if out is None:
        return UNKNOWN
    if name in ("permute", "t", "transpose", "numpy_T"):
        if name == "permute":
            order = [d % len(src) for d in node.args[1]]
        else:
            order = list(range(len(src)))
            a, b = ((0, 1) if name == "t" else (node.args[1] % len(src), node.args[2] % len(src)))
            order[a], order[b] = order[b], order[a]
        return (order.index(loc[0]), loc[1], loc[2])
    if name == "expand":
        shift = len(out) - len(src)
        return (loc[0] + shift, *loc[1:]) if out[loc[0] + shift] == src[loc[0]] else UNKNOWN
    if name in _VIEWS:
        return _view_loc(loc, src, out) if len(batched) == 1 else UNKNOWN
    if name in ("bmm", "baddbmm") and loc[0] == 0 and all(g == loc for _, g in batched):
        return loc  # q @ k^T of attention: both operands' rows on dim 0
    if name in ("_softmax", "_safe_softmax", "_log_softmax", "softmax", "log_softmax") and len(batched) == 1:
        return loc if node.args[1] % len(src) != loc[0] else UNKNOWN
    if name in ("mm", "bmm", "addmm", "baddbmm", "convolution"):
        lhs = {"mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1, "convolution": 0}[name]
        keep = {"mm": (0,), "bmm": (0, 1), "addmm": (0,), "baddbmm": (0, 1), "convolution": (0,)}[name]
        if len(batched) == 1 and first is node.args[lhs] and loc[0] in keep:
            return loc
        return UNKNOWN
    tags = getattr(node.target, "tags", ())
    if torch.Tag.pointwise in tags:
        for a, g in batched:  # every batched input broadcast onto the output at the same place
            s = _shape(a)
            d = g[0] + len(out) - len(s)
            if (d, *g[1:]) != (loc[0] + len(out) - len(src), *loc[1:]) or out[d] != s[g[0]]:
                return UNKNOWN
        return (loc[0] + len(out) - len(src), *loc[1:])
    if name in ("sum", "mean", "amax", "amin", "var", "std") and len(batched) == 1 and len(node.args) > 1:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = sorted(d % len(src) for d in dims)
        if loc[0] in dims:
            return UNKNOWN  # reduced over the rows: per rank, not eager's
        keep = len(out) == len(src)
        return (loc[0] - (0 if keep else sum(d < loc[0] for d in dims)), *loc[1:])
    return UNKNOWN


def batch_locations(traced: torch.fx.GraphModule, user_input: Sequence[bool]) -> list[Any]:
    """For each random op of one rank's ATen graph ``traced``, in graph order, its batch location
    ``(dim, outer, rows)``, NO_BATCH or UNKNOWN; ``user_input[k]``: placeholder ``k`` holds rows on dim 0."""
    locs: dict = {}
    for ph, is_user in zip(traced.graph.find_nodes(op="placeholder"), user_input):
        s = _shape(ph)
        locs[ph] = (0, 1, s[0]) if is_user and s else NO_BATCH
    out = []
    for node in traced.graph.nodes:
        if node.op == "get_attr":
            locs[node] = NO_BATCH  # a constant (a causal mask): the same for every rank's rows
        if node.op != "call_function":
            continue
        if node.target is __import__("operator").getitem:
            src = locs.get(node.args[0], UNKNOWN)
            keeps = _packet(node.args[0]) in ("native_dropout", "split", "split_with_sizes") or (
                _packet(node.args[0]) == "native_layer_norm" and node.args[1] == 0 and isinstance(src, tuple)
                and src[0] < len(_shape(node.args[0])) - len(node.args[0].args[1]))
            locs[node] = src if (src is NO_BATCH or keeps) else UNKNOWN
            continue
        try:
            locs[node] = _loc_of(node, locs)
        except Exception:  # noqa: BLE001 (an op whose arguments this reading does not know: unknown)
            locs[node] = UNKNOWN
        if is_random(node):
            out.append(locs[node])
    return out


def annotate_eager_batch(gm: torch.fx.GraphModule, inputs: Sequence[Any], joint: torch.fx.Graph, world: int,
                         forward_nodes: set | None = None) -> int:
    """Set :data:`EAGER_BATCH` on each random op of the joint graph ``joint`` (every rank's step, rank dim 0) from
    one rank's Dynamo graph ``gm`` (its placeholders described by ``inputs``, GraphInput); returns how many got a
    known location. Ops that cannot be matched one to one (another count of random ops) get None."""
    joint_random = [n for n in joint.nodes if is_random(n) and (forward_nodes is None or n in forward_nodes)]
    for n in joint_random:
        n.meta[EAGER_BATCH] = UNKNOWN
    if not joint_random:
        return 0
    try:
        mode = compat.fake_tensor_mode(allow_constants=True)
        with mode:
            args = [torch.empty(i.global_shape, dtype=i.dtype, device=i.device) for i in inputs]
            traced = compat.retrace_aten(gm, args)
        locs = batch_locations(traced, [i.kind == "input" for i in inputs])
        per_rank = [n for n in traced.graph.nodes if n.op == "call_function" and is_random(n)]
        shapes = [_shape(n) for n in per_rank]
        firsts = [n.args[0].meta.get("val") if n.args and isinstance(n.args[0], torch.fx.Node) else None
                  for n in per_rank]
        orders = [memory_order(v) if isinstance(v, torch.Tensor) else None for v in firsts]
    except Exception as e:  # noqa: BLE001
        log.info("adaptdist: cannot trace one rank's graph to place its random draws: %s", e)
        return 0
    if len(locs) != len(joint_random):
        log.warning("adaptdist: rng='global': one rank's graph has %d random ops and the step's %d; each is drawn as "
                    "if its batch rows were its outermost dim, which differs from one process's numbers where they "
                    "are not", len(locs), len(joint_random))
        return 0
    known = 0
    for n, loc, s, order in zip(joint_random, locs, shapes, orders):
        js = _shape(n)
        if isinstance(loc, tuple) and js is not None and s is not None and js == (world, *s):
            n.meta[EAGER_BATCH] = loc
            n.meta[EAGER_ORDER] = order if order is not None else tuple(range(len(s)))
            known += 1
        elif loc is NO_BATCH:
            n.meta[EAGER_BATCH] = NO_BATCH
    unknown = [n.name for n in joint_random if n.meta[EAGER_BATCH] is UNKNOWN]
    if unknown:
        log.warning("adaptdist: rng='global': cannot tell where the batch rows are in the random draws %s; each is "
                    "drawn as if they were its outermost dim, which differs from one process's numbers where they are "
                    "not (adaptdist train --rng global follows them exactly)", ", ".join(unknown))
    return known
