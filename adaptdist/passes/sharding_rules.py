"""Per-op sharding rules along one mesh axis.

A rule sees one node and the placement of each tensor argument along one mesh
axis, and answers with the placement of each output and the placements it
*needs* for arguments whose current placement it cannot consume (the
redistribution pass later inserts the collective that converts them).

Semantics follow DTensor (``torch/distributed/tensor/_ops``): a reduction over a
sharded dim yields ``Partial("sum")``; a matmul contracting two sharded dims
yields ``Partial``; ops linear in a ``Partial`` input keep it ``Partial``.
Shards may be uneven (``torch.chunk``), so a ``mean`` over a sharded dim is not
``Partial("avg")`` here: the globalize-reductions pass rewrites it as a sum
divided by the global count.

Where a known op cannot consume a sharded input as it is (a view that splits the
shard, a softmax or max over the sharded dim, a concatenation along it), the rule
asks for every input replicated (:func:`gather_all`): correct, at the price of an
all_gather. An op without a rule of ours takes DTensor's strategy that moves the least
(:func:`dtensor_choice`, the strategies the planner lists too). Only ops with neither are refused:
:class:`~adaptdist.errors.UnsupportedOpError` names the op, node, shapes and
placements, and says what to try.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx

from .. import _torch_compat as compat
from .. import graph_meta as gmeta
from ..errors import UnsupportedOpError
from ..placement import Partial, Placement, Replicate, Shard
from ..strategy import Strategy

log = logging.getLogger("adaptdist.passes")
aten = torch.ops.aten
R = Replicate()
P = Partial("sum")

ArgPath = tuple  # (i,) = args[i]; (i, j) = args[i][j]; ("name",) = kwargs["name"] (in needs only)


@dataclass
class RuleResult:
    """Output placement(s) and the placements needed for some arguments."""

    out: Placement | tuple[Placement, ...]
    needs: dict[ArgPath, Placement] = field(default_factory=dict)


PlacementOf = Callable[[torch.fx.Node], Placement]


def tensor_args(node: torch.fx.Node) -> list[tuple[ArgPath, torch.fx.Node]]:
    """The fx.Node arguments of ``node`` with their positions (lists flattened one level)."""
    out = []
    for i, a in enumerate(node.args):
        if isinstance(a, torch.fx.Node):
            out.append(((i,), a))
        elif isinstance(a, (list, tuple)):
            out.extend(((i, j), b) for j, b in enumerate(a) if isinstance(b, torch.fx.Node))
    return out


def shape(n: Any) -> tuple[int, ...]:
    v = gmeta.val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def unsupported(node: torch.fx.Node, pl: PlacementOf, why: str) -> UnsupportedOpError:
    """The UnsupportedOpError for ``node``, naming op, node, module, input shapes and placements."""
    args = ", ".join(f"{a.name}: {gmeta.shape_str(a)} {pl(a)!r}" for _, a in tensor_args(node)
                     if "val" in a.meta or a.op != "get_attr")  # not torch.cond's branches (subgraphs)
    return UnsupportedOpError(
        f"op {node.target} at node {node.name!r}{gmeta.where_of(node)} has no sharding rule for "
        f"inputs ({args}): {why}. Rewrite that part of the model with supported ops, or pass "
        "--replicate-fallback to gather its inputs and run it whole on every rank (see "
        f"adaptdist/passes/sharding_rules.py).{_grouped_mm_hint(node)}"
    )


def _grouped_mm_hint(node: torch.fx.Node) -> str:
    """For ``aten._grouped_mm``: Hugging Face MoE blocks (Mixtral, Qwen2-MoE) built from a config call it under
    their default ``experts_implementation``; ``batched_mm`` runs every expert on every token with static shapes,
    which lowers equal to eager (see capture.py's ``_hf_experts_hint``)."""
    if "grouped_mm" not in str(node.target):
        return ""
    return (" A Hugging Face MoE (Mixtral, Qwen2-MoE) calls this op under its default experts implementation: build "
            "the model with experts_implementation='batched_mm' in its config (static shapes: every expert on every "
            "token), which lowers under auto, dp, fsdp and ep.")


def gather_all(node: torch.fx.Node, pl: PlacementOf, why: str) -> RuleResult:
    """Fallback for a known op whose sharded inputs it cannot consume as they are: replicate
    every tensor input (all_gather / all_reduce) and compute the whole op on every rank.
    Correct, but it moves the whole tensor; ``why`` is logged."""
    log.debug("node %s (%s): %s; gathering its inputs", node.name, node.target, why)
    v = gmeta.val(node)
    out = tuple(R for _ in v) if isinstance(v, (tuple, list)) else R
    return RuleResult(out, {path: R for path, a in tensor_args(node) if not isinstance(pl(a), Replicate)})


def _arg(node: torch.fx.Node, i: int, name: str, default: Any = None) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _norm_dims(dims: Any, ndim: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d % ndim if ndim else 0 for d in dims)


# ---------------------------------------------------------------- elementwise

_LINEAR_ALL_PARTIAL = {aten.add.Tensor, aten.sub.Tensor}
_LINEAR_UNARY = {aten.neg.default, aten.clone.default, aten._to_copy.default, aten.alias.default,
                 aten.detach.default, aten.mul.Scalar, aten.div.Scalar, aten.contiguous.default}


def _partial_is_linear(node: torch.fx.Node, pls: list[tuple[ArgPath, torch.fx.Node, Placement]]) -> bool:
    partial = [a for _, a, p in pls if isinstance(p, Partial)]
    others = [p for _, a, p in pls if not isinstance(p, Partial)]
    if node.target in _LINEAR_ALL_PARTIAL:
        # adding a constant to a partial value would add it once per rank
        scalars = [a for a in node.args if not isinstance(a, torch.fx.Node)]
        return not others and not scalars
    if node.target in _LINEAR_UNARY:
        return True
    if node.target == aten.mul.Tensor:
        return len(partial) == 1 and all(isinstance(p, Replicate) for p in others)
    if node.target == aten.div.Tensor:
        return len(partial) == 1 and pls[0][2] == P and all(isinstance(p, Replicate) for p in others)
    return False


def _keep_first_partial(node: torch.fx.Node, pls: list[tuple[ArgPath, torch.fx.Node, Placement]]) -> dict | None:
    """mul/div with several Partial args: keep arg 0 Partial, make the others Replicate."""
    if node.target not in (aten.mul.Tensor, aten.div.Tensor) or pls[0][2] != P:
        return None
    if any(isinstance(p, Shard) for _, _, p in pls):
        return None
    return {path: R for path, _, p in pls[1:] if isinstance(p, Partial)}


def _broadcast_shard(pls: list[tuple[ArgPath, torch.fx.Node, Placement]], out_nd: int
                     ) -> tuple[int, dict[ArgPath, Placement]] | None:
    """For broadcasting elementwise inputs (right-aligned to ``out_nd`` output dims): the output dim to shard and
    what each input needs for it, or None when no input is sharded. Inputs sharded on different output dims keep
    the largest input's shard (the activation) and regather the others (e.g. a FSDP-sharded bias) to match; an
    input of size 1 on that dim broadcasts, replicated."""
    sharded = [(math.prod(shape(a)), p.dim + out_nd - len(shape(a))) for _, a, p in pls if isinstance(p, Shard)]
    if not sharded:
        return None
    d = max(sharded)[1]
    needs: dict[ArgPath, Placement] = {}
    for path, a, p in pls:
        ad = d - (out_nd - len(shape(a)))
        if isinstance(p, Shard) and p.dim == ad:
            continue
        if ad >= 0 and shape(a)[ad] != 1:
            needs[path] = Shard(ad)
        elif not isinstance(p, Replicate):
            needs[path] = R
    return d, needs


def pointwise(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """Broadcasting elementwise ops: all sharded inputs must shard the same output dim."""
    pls = [(path, a, pl(a)) for path, a in tensor_args(node)]
    split = _broadcast_shard(pls, len(shape(node)))
    if split is not None:
        return RuleResult(Shard(split[0]), split[1])
    if any(isinstance(p, Partial) for _, _, p in pls):
        if _partial_is_linear(node, pls):
            return RuleResult(P)
        keep = _keep_first_partial(node, pls)
        if keep is not None:
            return RuleResult(P, keep)
        return RuleResult(R, {path: R for path, _, p in pls if isinstance(p, Partial)})
    return RuleResult(R)


def like_factory(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """``ones_like`` & co: the layout of the input, but values do not depend on it (Partial -> R)."""
    p = pl(node.args[0])
    return RuleResult(p if isinstance(p, Shard) else R)


def identity(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """clone/_to_copy/alias/detach: the input's placement, Partial included (they are linear)."""
    return RuleResult(pl(node.args[0]))


def _split_dim(node: torch.fx.Node) -> int:
    """The dim a random op splits a replicated input on: dim 0 where it has more than one row (the batch dim,
    or the backend's rank dim, so the draws line up with the split of the batch and nothing is gathered back:
    HF GPT-2 with dropout went from 25 all_gathers and an all_to_all per step to 4 all_gathers, RESULTS.md), else
    its largest."""
    s = shape(node.args[0])
    if s and s[0] > 1:
        return 0
    return max(range(len(s)), key=lambda d: (s[d], -d)) if s else 0


def random_like(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """``rand_like``/``randn_like``/``bernoulli.p``: random numbers laid out like the input when it is sharded
    (each rank draws its own elements). A replicated (or Partial) input is split first: if every rank of
    the group drew the whole tensor, each would draw different numbers for what the graph calls one
    replicated value; split, each element is drawn once, and a consumer needing it whole gathers it."""
    p = pl(node.args[0])
    if isinstance(p, Shard) or not shape(node.args[0]) or gmeta.is_global_rng(node):
        # rng="global" (passes/global_rng.py): every rank draws the whole tensor from the same generator state,
        # so a replicated (or Partial: only its shape is read) input gives a replicated output
        return RuleResult(p if isinstance(p, Shard) else R)
    d = _split_dim(node)
    return RuleResult(Shard(d), {(0,): Shard(d)} if isinstance(p, Replicate) else {(0,): R})


def dropout(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """native_dropout(x) -> (out, mask), both laid out like x when x is sharded; a replicated input is split
    first (its mask is random: see :func:`random_like`), a Partial one reduced."""
    p = pl(node.args[0])
    if isinstance(p, Shard):
        return RuleResult((p, p))
    if isinstance(p, Partial) or not shape(node.args[0]) or gmeta.is_global_rng(node):  # global: see random_like
        return RuleResult((R, R), {(0,): R}) if isinstance(p, Partial) else RuleResult((R, R))
    d = _split_dim(node)
    return RuleResult((Shard(d), Shard(d)), {(0,): Shard(d)})


# ---------------------------------------------------------------- views


def _view_out_dim(in_shape: tuple[int, ...], out_shape: tuple[int, ...], d: int) -> int | None:
    """The output dim that carries sharded input dim ``d``: the outermost dim of its merged
    group (``[B, T] -> [B*T]``) or of its split (``[B*T] -> [B, T]``; :func:`view` keeps the
    shard there only when every rank's shard holds whole groups)."""
    prefix = math.prod(in_shape[:d])
    n = in_shape[d]
    for od in range(len(out_shape)):
        if math.prod(out_shape[:od]) != prefix or (out_shape[od] == 1 and n != 1):
            continue
        if out_shape[od] % max(n, 1) == 0 or n % out_shape[od] == 0:
            return od
    return None


_SPLITTING_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default)


def shard_origin(a: torch.fx.Node, pl: PlacementOf, limit: int = 10_000) -> list[torch.fx.Node] | None:
    """The chain of sharded values ``a``'s shard comes from, as lowering gives it its rows
    (``localize_shapes``: every op takes the interval of its first sharded input, views rescale it):
    from a placeholder (a parameter, chunked like ``torch.chunk``, or the batch) to ``a``. None when the
    chain does not start at a placeholder under ``pl`` (the planner's listing, which places only the
    node's own inputs; or a value made sharded from whole inputs)."""
    chain = [a]
    cur = a
    while cur.op != "placeholder":
        if len(chain) > limit:
            return None
        src = cur
        if cur.target is operator.getitem and isinstance(cur.args[0], torch.fx.Node) \
                and isinstance(pl(cur.args[0]), (tuple, list)):
            src = cur.args[0]  # an output of a multi-output op (layer norm's): its rows are its first sharded input's
        nxt = next((x for _, x in tensor_args(src) if isinstance(pl(x), Shard)), None)
        if nxt is None:
            return None
        chain.append(nxt)
        cur = nxt
    return chain[::-1]


def shard_boundaries(a: torch.fx.Node, pl: PlacementOf, mesh_size: int) -> list[tuple[int, int]] | None:
    """Every rank's ``[start, end)`` of ``a``'s sharded dim over ``mesh_size`` ranks, as lowering will give
    them (:func:`shard_origin`; the batch taken as split like ``torch.chunk``); None when unknown."""
    from ..placement import chunk_interval

    chain = shard_origin(a, pl)
    if chain is None or any(not isinstance(pl(n), Shard) for n in chain):
        return None
    origin = chain[0]
    n0 = shape(origin)[pl(origin).dim]
    ivs = [chunk_interval(n0, mesh_size, r) for r in range(mesh_size)]
    prev = n0
    for n in chain[1:]:
        size = shape(n)[pl(n).dim]
        if n.target in _SPLITTING_VIEWS and size != prev:
            if size > prev:
                k = size // max(prev, 1)
                ivs = [(s * k, e * k) for s, e in ivs]
            else:
                k = prev // size
                if any(s % k or e % k for s, e in ivs):
                    return None  # already split unevenly upstream (its own rule gathers it)
                ivs = [(s // k, e // k) for s, e in ivs]
        prev = size
    return ivs


def view(node: torch.fx.Node, pl: PlacementOf, mesh_size: int | None = None) -> RuleResult:
    """view/reshape: a shard survives when the sharded dim is the outermost of a merged group, or when the
    view splits it into groups (``[B*T] -> [B, T]``, ``[.., H*D] -> [.., H, D]``) of which every rank's shard
    over ``mesh_size`` ranks holds whole ones (:func:`shard_boundaries`: e.g. a packed q/k/v projection's
    ``3E`` outputs chunked over 2 ranks do not split into 3 groups of ``E``); else the input is gathered."""
    p = pl(node.args[0])
    if not isinstance(p, Shard):
        return RuleResult(p)
    in_shape = shape(node.args[0])
    od = _view_out_dim(in_shape, shape(node), p.dim)
    if od is None:
        return gather_all(node, pl, f"the view splits sharded dim {p.dim} into several dims")
    n_in, n_out = in_shape[p.dim], shape(node)[od]
    if mesh_size and mesh_size > 1 and n_out < n_in:
        k = n_in // max(n_out, 1)
        # a merge of a leading dim (the batch) with inner dims of k elements splits back into whole groups
        # whatever rows each rank holds of that dim; else the rows lowering will give each rank, or, where
        # those are unknown (the planner's listing places only this node's input), a shard chunked on this dim
        ivs = [] if _merged_from_batch_like(node.args[0], p.dim, k) else shard_boundaries(node.args[0], pl, mesh_size)
        if ivs is None:
            from ..placement import chunk_interval

            ivs = [chunk_interval(n_in, mesh_size, r) for r in range(mesh_size)]
        if any(s % k or e % k for s, e in ivs):
            return gather_all(node, pl, f"the view splits sharded dim {p.dim} (size {n_in}) into {n_out} groups of "
                                        f"{k}, and the ranks' shards {ivs} over {mesh_size} ranks do not hold whole "
                                        "groups")
    return RuleResult(Shard(od))


view.takes_mesh_size = True


def _merged_from_batch_like(a: torch.fx.Node, dim: int, k: int) -> bool:
    """Whether ``a``'s dim ``dim`` is, by the graph's own views, a merge of a leading dim with inner dims
    of ``k`` (or a multiple of ``k``) elements each (``[B, T, D] -> [B*T, D]``, through ops that keep the
    shape): then its shard, whatever rows each rank holds of the leading dim, splits back into whole
    groups of ``k``."""
    cur, d = a, dim
    for _ in range(64):
        if cur.op != "call_function":
            return False
        if cur.target in _SPLITTING_VIEWS:
            src = cur.args[0]
            if not isinstance(src, torch.fx.Node):
                return False
            src_shape, out_shape = shape(src), shape(cur)
            prefix = math.prod(out_shape[:d])
            # the input dims merged into output dim d
            acc, j = 1, 0
            while j < len(src_shape) and acc < prefix:
                acc *= src_shape[j]
                j += 1
            if acc != prefix or j >= len(src_shape):
                return False
            inner = out_shape[d] // max(src_shape[j], 1)
            if src_shape[j] * inner == out_shape[d] and inner > 1:
                return inner % k == 0
            if src_shape[j] == out_shape[d]:
                cur, d = src, j
                continue
            return False
        ins = [x for _, x in tensor_args(cur) if len(shape(x)) > d and shape(x)[d] == shape(cur)[d]]
        if not ins:
            return False
        cur = ins[0]
    return False


def transpose(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """t/transpose/permute: the shard moves with its dim."""
    p = pl(node.args[0])
    if not isinstance(p, Shard):
        return RuleResult(p)
    nd = len(shape(node.args[0]))
    if node.target == aten.t.default:
        perm = [1, 0] if nd == 2 else [0]
    elif node.target == aten.permute.default:
        perm = [d % nd for d in node.args[1]]
    else:
        a, b = node.args[1] % nd, node.args[2] % nd
        perm = list(range(nd))
        perm[a], perm[b] = perm[b], perm[a]
    return RuleResult(Shard(perm.index(p.dim)))


def unsqueeze(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """unsqueeze: the shard's dim shifts up past the new dim."""
    p = pl(node.args[0])
    if not isinstance(p, Shard):
        return RuleResult(p)
    d = node.args[1] % (len(shape(node.args[0])) + 1)
    return RuleResult(Shard(p.dim + 1 if d <= p.dim else p.dim))


def squeeze(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """squeeze: the shard's dim shifts down past removed size-1 dims."""
    p = pl(node.args[0])
    if not isinstance(p, Shard):
        return RuleResult(p)
    in_shape = shape(node.args[0])
    dims = _arg(node, 1, "dim", None)
    dims = [i for i, s in enumerate(in_shape) if s == 1] if dims is None else _norm_dims(dims, len(in_shape))
    dims = [d for d in dims if in_shape[d] == 1]
    if p.dim in dims:
        return gather_all(node, pl, "it squeezes the sharded dim")
    return RuleResult(Shard(p.dim - sum(1 for d in dims if d < p.dim)))


def expand(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """expand: the shard keeps its dim, shifted by new leading dims."""
    p = pl(node.args[0])
    if not isinstance(p, Shard):
        return RuleResult(p)
    return RuleResult(Shard(p.dim + len(shape(node)) - len(shape(node.args[0]))))


def select_like(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """select/slice/narrow/index_select along a dim other than the sharded one."""
    p = pl(node.args[0])
    if not isinstance(p, Shard):
        return RuleResult(p)
    nd = len(shape(node.args[0]))
    dim = _arg(node, 1, "dim", 0) % nd
    if dim == p.dim:
        if node.target == aten.slice.Tensor and _is_full_slice(node):
            return RuleResult(p)
        return gather_all(node, pl, f"it indexes the sharded dim {p.dim}")
    if node.target == aten.select.int:
        return RuleResult(Shard(p.dim - (1 if dim < p.dim else 0)))
    if node.target == aten.index_select.default and not isinstance(pl(node.args[2]), Replicate):
        return RuleResult(p, {(2,): R})
    return RuleResult(p)


def slice_select_backward(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """slice_backward/select_backward(grad, input_sizes, dim, ...): zeros of ``input_sizes`` with
    ``grad`` written at the slice; a shard on another dim carries over."""
    p = pl(node.args[0])
    if not isinstance(p, Shard):
        return RuleResult(p if isinstance(p, Partial) else R)
    out_nd = len(node.args[1])
    dim = node.args[2] % out_nd
    if node.target == aten.select_backward.default:
        d = p.dim + (1 if dim <= p.dim else 0)
    else:
        d = p.dim
        if dim == d and not (node.args[3] in (0, None) and node.args[4] >= node.args[1][dim]
                             and _arg(node, 5, "step", 1) == 1):  # (opinfo2) a full slice: identity
            return gather_all(node, pl, "the slice is along the sharded dim")
    return RuleResult(Shard(d))


def _is_full_slice(node: torch.fx.Node) -> bool:
    size = shape(node.args[0])[_arg(node, 1, "dim", 0) % len(shape(node.args[0]))]
    start = _arg(node, 2, "start", 0) or 0
    end = _arg(node, 3, "end", None)
    step = _arg(node, 4, "step", 1)
    return start == 0 and (end is None or end >= size) and step == 1


def split(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """split/split_with_sizes/unbind along a dim other than the sharded one; else gather."""
    p = pl(node.args[0])
    n_out = len(gmeta.val(node))
    if not isinstance(p, Shard):
        return RuleResult((p,) * n_out)
    nd = len(shape(node.args[0]))
    dim = _arg(node, 2, "dim", 0) % nd
    if node.target == aten.unbind.int:
        dim = _arg(node, 1, "dim", 0) % nd
        if dim == p.dim:
            return gather_all(node, pl, "it unbinds the sharded dim")
        return RuleResult((Shard(p.dim - (1 if dim < p.dim else 0)),) * n_out)
    if dim == p.dim:
        return gather_all(node, pl, "it splits the sharded dim")
    return RuleResult((p,) * n_out)


def cat(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """cat/stack: sharded inputs must share the dim; replicated ones are sliced to match."""
    tensors = node.args[0]
    stack = node.target == aten.stack.default
    # cat skips legacy empty inputs (shape (0,): HF's DynamicCache starts from one): they neither set the rank
    # nor need a placement; dropping them keeps cat([empty, k], -2) a per-row op
    skip = set() if stack else {j for j, t in enumerate(tensors) if tuple(shape(t)) == (0,)}
    if len(skip) == len(tensors):
        skip = set()
    nd = len(shape(next(t for j, t in enumerate(tensors) if j not in skip)))
    dim = _arg(node, 1, "dim", 0)
    dim = dim % (nd + 1 if stack else nd)
    pls = [R if j in skip else pl(t) for j, t in enumerate(tensors)]
    shard_dims = {p.dim for p in pls if isinstance(p, Shard)}
    if len(shard_dims) > 1:
        return gather_all(node, pl, "inputs are sharded on different dims")
    if shard_dims:
        d = shard_dims.pop()
        if d == dim and not stack:
            return gather_all(node, pl, "it concatenates along the sharded dim")
        needs = {(0, j): Shard(d) for j, p in enumerate(pls) if not isinstance(p, Shard) and j not in skip}
        return RuleResult(Shard(d + 1 if stack and dim <= d else d), needs)
    if all(isinstance(p, Partial) for p in pls):
        return RuleResult(P)
    return RuleResult(R, {(0, j): R for j, p in enumerate(pls) if isinstance(p, Partial)})


def gather_scatter(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """gather(x, dim, index) and scatter/scatter_add(x, dim, index, src) along an unsharded dim."""
    acts = [(path, a) for path, a in tensor_args(node)]
    nd = len(shape(node.args[0]))
    dim = node.args[1] % max(nd, 1)
    pls = {path: pl(a) for path, a in acts}
    shards = {p.dim for p in pls.values() if isinstance(p, Shard)}
    if not shards:
        return RuleResult(R, {path: R for path, p in pls.items() if isinstance(p, Partial)})
    d = shards.pop()
    if shards or d == dim:
        return gather_all(node, pl, "it gathers/scatters along the sharded dim")
    return RuleResult(Shard(d), {path: Shard(d) for path, p in pls.items() if not isinstance(p, Shard)})


def new_factory(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """new_zeros & co: values do not depend on the input; the size argument is global."""
    return RuleResult(R)


def no_output(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """Checks that return nothing (``_assert_tensor_metadata``): any input layout is fine."""
    return RuleResult(R)


def getitem(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """getitem on a multi-output op: the placement of that output."""
    src = node.args[0]
    layout = pl(src)
    return RuleResult(layout[node.args[1]] if isinstance(layout, tuple) else layout)


# ---------------------------------------------------------------- reductions

_SUM_LIKE = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default}


def reduction(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """sum/mean over a sharded dim -> Partial; other reductions may not reduce the sharded dim."""
    p = pl(node.args[0])
    in_nd = len(shape(node.args[0]))
    if node.target in (aten.sum.default, aten.mean.default):
        dims, keepdim = list(range(in_nd)), False
    else:
        dims = _norm_dims(_arg(node, 1, "dim", None), in_nd)
        keepdim = bool(_arg(node, 2, "keepdim", False))
    if isinstance(p, Partial):
        if node.target in _SUM_LIKE:
            return RuleResult(P)
        return RuleResult(R, {(0,): R})
    if not isinstance(p, Shard):
        return RuleResult(R)
    if p.dim in dims:
        if node.target in _SUM_LIKE:
            return RuleResult(P)
        return gather_all(node, pl, "it reduces over the sharded batch dim with a non-sum reduction")
    return RuleResult(Shard(p.dim if keepdim else p.dim - sum(1 for d in dims if d < p.dim)))


def reduction_with_indices(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """max.dim/min.dim(x, dim, keepdim) -> (values, indices): sharded dim reduced -> gather."""
    p = pl(node.args[0])
    nd = len(shape(node.args[0]))
    dim = node.args[1] % max(nd, 1)
    keepdim = bool(_arg(node, 2, "keepdim", False))
    if not isinstance(p, Shard) or p.dim == dim:
        if isinstance(p, Replicate):
            return RuleResult((R, R))
        return gather_all(node, pl, "it reduces over the sharded dim")
    d = p.dim if keepdim or p.dim < dim else p.dim - 1
    return RuleResult((Shard(d), Shard(d)))


# ---------------------------------------------------------------- matmuls


def _mm_core(node: torch.fx.Node, pl: PlacementOf, a_path: ArgPath, b_path: ArgPath, batch: bool) -> RuleResult:
    a, b = node.args[a_path[0]], node.args[b_path[0]]
    pa, pb = pl(a), pl(b)
    off = 1 if batch else 0  # a: [.., m, k], b: [.., k, n]
    m_dim, ka, kb, n_dim = off, off + 1, off, off + 1
    if isinstance(pa, Partial) and isinstance(pb, Partial):
        return RuleResult(P, {b_path: R})
    if isinstance(pa, Partial):
        return RuleResult(P, {} if isinstance(pb, Replicate) else {b_path: R})
    if isinstance(pb, Partial):
        return RuleResult(P, {} if isinstance(pa, Replicate) else {a_path: R})
    sa = pa.dim if isinstance(pa, Shard) else None
    sb = pb.dim if isinstance(pb, Shard) else None
    if batch and (sa == 0 or sb == 0):
        needs = {}
        if sa != 0:
            needs[a_path] = Shard(0)
        if sb != 0:
            needs[b_path] = Shard(0)
        return RuleResult(Shard(0), needs)

    def table(sa, sb):
        if sa is None and sb is None:
            return R, {}
        if sa == m_dim and sb is None:
            return Shard(m_dim), {}
        if sa is None and sb == n_dim:
            return Shard(n_dim), {}
        if sa == ka and sb == kb:
            return P, {}
        if sa == ka and sb is None:
            return P, {b_path: Shard(kb)}
        if sa is None and sb == kb:
            return P, {a_path: Shard(ka)}
        return None

    res = table(sa, sb)
    if res is not None:
        return RuleResult(*res)
    # Both operands sharded incompatibly (e.g. a FSDP-sharded weight times a batch-sharded
    # activation): gather the parameter, as FSDP does where a weight is used; else the smaller.
    a_first = (_is_param(a), -gmeta.val(a).numel()) > (_is_param(b), -gmeta.val(b).numel())
    for path in ((a_path, b_path) if a_first else (b_path, a_path)):
        res = table(None, sb) if path == a_path else table(sa, None)
        if res is not None:
            out, needs = res
            needs = dict(needs)
            needs.setdefault(path, R)
            return RuleResult(out, needs)
    raise unsupported(node, pl, "this combination of sharded operand dims has no rule")


_LAYOUT_OPS = {aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default, aten._unsafe_view.default,
               aten.reshape.default, aten.expand.default, aten.clone.default, aten._to_copy.default,
               aten.detach.default, aten.alias.default}


def _is_param(n: torch.fx.Node) -> bool:
    """Whether ``n`` is a parameter seen through layout-only ops (t, view, ...)."""
    while n.op == "call_function" and n.target in _LAYOUT_OPS:
        n = n.args[0]
    return n.op == "placeholder" and gmeta.get_role(n) == "param"


def mm(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """mm(a [m, k], b [k, n]): S(m)xR -> S(0), RxS(n) -> S(1), S(k)xS(k) -> Partial."""
    return _mm_core(node, pl, (0,), (1,), batch=False)


def bmm(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """bmm(a [b, m, k], b [b, k, n]): the mm rules shifted by one, plus batch S(0)xS(0) -> S(0)."""
    return _mm_core(node, pl, (0,), (1,), batch=True)


def addmm(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """addmm/baddbmm(bias, a, b): the product's layout; the bias is sliced or must match."""
    batch = node.target == aten.baddbmm.default
    core = _mm_core(node, pl, (1,), (2,), batch=batch)
    needs = dict(core.needs)
    bias = node.args[0]
    pbias = pl(bias)
    out_nd = len(shape(node))
    if isinstance(core.out, Partial):
        if not isinstance(pbias, Partial):
            # a partial product cannot take a whole bias once: reshard the operands so that the product is whole
            # (fix-lower: a batch moved to the contracted dim, e.g. by DTensor's flip(0) strategy under dp)
            core, needs = _addmm_whole_product(node, pl, batch)
        else:
            return RuleResult(P, needs)
    if isinstance(core.out, Shard):
        ad = core.out.dim - (out_nd - len(shape(bias)))
        if ad >= 0 and shape(bias)[ad] != 1:
            if not (isinstance(pbias, Shard) and pbias.dim == ad):
                needs[(0,)] = Shard(ad)
        elif not isinstance(pbias, Replicate):
            needs[(0,)] = R
        return RuleResult(core.out, needs)
    if not isinstance(pbias, Replicate):
        needs[(0,)] = R
    return RuleResult(R, needs)


def _addmm_whole_product(node: torch.fx.Node, pl: PlacementOf, batch: bool) -> tuple[RuleResult, dict]:
    """(fix-lower) The product of addmm/baddbmm(bias, a, b) made whole, for a bias that is not Partial: a sharded
    ``a`` keeps its rows split (``S(k) -> S(m)``, an all_to_all: a batch moved to the contracted dim returns to
    its rows), a partial ``a`` is reduced, ``b`` is replicated. Returns the product's rule result and the needs."""
    a, b = node.args[1], node.args[2]
    m_dim = 1 if batch else 0
    pa = pl(a)
    want_a = Shard(m_dim) if isinstance(pa, Shard) else R
    want = {a: want_a, b: R}
    core = _mm_core(node, lambda x: want.get(x, pl(x)), (1,), (2,), batch=batch)
    needs = dict(core.needs)
    for path, x in (((1,), a), ((2,), b)):
        if pl(x) != want[x]:
            needs.setdefault(path, want[x])
    return core, needs


# ---------------------------------------------------------------- nn ops


def embedding(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """embedding(weight [V, C], indices [...]) -> [..., C].

    * a table sharded by vocabulary (``S(0)``) with replicated indices: each rank looks up the
      tokens it holds and zeroes the others: a ``Partial`` sum (Megatron's vocabulary-parallel
      embedding; the vocab_parallel_embedding pass rewrites the lookup with the mask);
    * a table sharded on the embedding dim (``S(1)``) with replicated indices: the output is
      sharded on its last dim;
    * otherwise the indices' layout carries over, and a sharded table is gathered (FSDP-like).
    """
    w, idx = node.args[0], node.args[1]
    pw, p = pl(w), pl(idx)
    nd_out = len(shape(node))
    if isinstance(p, Replicate) and pw == Shard(0) and not _arg(node, 3, "scale_grad_by_freq", False):
        return RuleResult(P)
    if isinstance(p, Replicate) and pw == Shard(1):
        return RuleResult(Shard(nd_out - 1))
    needs: dict[ArgPath, Placement] = {}
    if not isinstance(pw, Replicate):
        needs[(0,)] = R
    if isinstance(p, Partial):
        needs[(1,)] = R
        return RuleResult(R, needs)
    return RuleResult(p, needs)


def vocab_parallel_lookup(idx: torch.fx.Node, pl: PlacementOf) -> torch.fx.Node | None:
    """The forward embedding whose table is vocabulary-sharded and reads the indices ``idx``, if any."""
    for u in idx.users:
        if (u.target == aten.embedding.default and u.args[1] is idx and pl(u.args[0]) == Shard(0)
                and isinstance(pl(idx), Replicate) and not _arg(u, 3, "scale_grad_by_freq", False)):
            return u
    return None


def embedding_backward(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """embedding_dense_backward(grad [..., C], indices [...]) -> [V, C]: sharded rows sum to Partial (or, marked by
    ``passes/gather_embedding_rows.py``, the rows and indices are gathered and the gradient is replicated);
    for a vocabulary-parallel lookup each rank computes its own rows (``S(0)``); a gradient sharded
    on its last dim gives the table's gradient sharded on dim 1."""
    g, idx = node.args[0], node.args[1]
    pg, pi = pl(g), pl(idx)
    if isinstance(pi, Replicate) and vocab_parallel_lookup(idx, pl) is not None and not isinstance(pg, Shard):
        return RuleResult(Shard(0), {(0,): R} if isinstance(pg, Partial) else {})
    if isinstance(pg, Replicate) and isinstance(pi, Replicate):
        return RuleResult(R)
    if gmeta.gathers_rows(node) and isinstance(pg, Shard) and pg == pi and pg.dim == 0:
        # passes/gather_embedding_rows.py: the batch's rows gathered, the whole gradient on every rank
        return RuleResult(R, {(0,): R, (1,): R})
    if _arg(node, 4, "scale_grad_by_freq", False):
        return gather_all(node, pl, "scale_grad_by_freq counts words over the whole batch")
    if isinstance(pg, Shard) and isinstance(pi, Shard) and pg.dim == pi.dim:
        return RuleResult(P)
    if isinstance(pg, Shard) and pg.dim == len(shape(g)) - 1 and isinstance(pi, Replicate):
        return RuleResult(Shard(1))
    if isinstance(pg, Partial) and isinstance(pi, Replicate):
        return RuleResult(P)
    if (isinstance(pg, Shard) and isinstance(pi, Replicate) and pg.dim < len(shape(idx))
            and shape(idx)[pg.dim] == shape(g)[pg.dim]):
        # replicated indices over the split rows (learned positions expanded over the batch: HF BART, OPT): each
        # rank takes its rows of them (a local slice) rather than gathering the gradient
        return RuleResult(P, {(1,): pg})
    return gather_all(node, pl, "gradient and indices are laid out differently")


# EmbeddingBag (issue 14, point 4)


_BAG_SUM, _BAG_MEAN = 0, 1
_ARANGE = (aten.arange.start_step, aten.arange.default, aten.arange.start)


def embedding_bag_length(indices: Any, offsets: Any) -> int | None:
    """``L`` when ``offsets`` is ``arange(0, len(indices), L)`` (bags of ``L`` indices each), else None."""
    if not (isinstance(offsets, torch.fx.Node) and offsets.op == "call_function" and offsets.target in _ARANGE):
        return None
    a = list(offsets.args)
    if offsets.target == aten.arange.default:
        start, end, step = 0, a[0], 1
    elif offsets.target == aten.arange.start:
        start, end, step = a[0], a[1], 1
    else:
        start, end, step = a[0], a[1], a[2] if len(a) > 2 else offsets.kwargs.get("step", 1)
    t = tuple(indices.meta["val"].shape) if isinstance(indices, torch.fx.Node) else ()
    if start != 0 or len(t) != 1 or not isinstance(step, int) or step < 1 or end != t[0] or t[0] % step:
        return None
    return step


def embedding_bag_rewritable(fwd: torch.fx.Node) -> int | None:
    """``L`` if the forward ``_embedding_bag`` node is over bags of ``L`` indices (a 2-D input), in sum or mean mode,
    without padding_idx, include_last_offset or scale_grad_by_freq: the form ``passes/embedding_bag.py`` rewrites."""
    w, idx, off = fwd.args[:3]
    mode = _arg(fwd, 4, "mode", _BAG_SUM)
    if (mode not in (_BAG_SUM, _BAG_MEAN) or _arg(fwd, 7, "include_last_offset", False)
            or _arg(fwd, 8, "padding_idx", -1) not in (-1, None) or _arg(fwd, 3, "scale_grad_by_freq", False)):
        return None
    return embedding_bag_length(idx, off)


def embedding_bag(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """_embedding_bag(weight [V, D], indices [T], offsets [B], ...) -> (out [B, D], offset2bag, bag_size,
    max_indices) and its backward. Bags of one length (a 2-D input: offsets ``arange(0, T, L)``, sum/mean)
    keep the batch split: the lowering rewrites them into ``embedding`` and a sum over the bag
    (``passes/embedding_bag.py``), so this rule is what the planner sees of them; every other form (offsets
    of the user's, ``max``, ``padding_idx``) gathers its inputs and runs whole on every rank."""
    import operator

    backward = node.target != aten._embedding_bag.default
    if not backward:
        ok = embedding_bag_rewritable(node) is not None
        idx = node.args[1]
    else:
        idx = node.args[1]
        o2b = node.args[3]  # offset2bag: an output of the forward bag
        fwd = o2b.args[0] if isinstance(o2b, torch.fx.Node) and o2b.target is operator.getitem else None
        ok = (node.target == aten._embedding_bag_backward.default and isinstance(fwd, torch.fx.Node)
              and fwd.target == aten._embedding_bag.default and embedding_bag_rewritable(fwd) is not None
              and embedding_bag_length(idx, node.args[2]) is not None)
    p = pl(idx)
    if not ok or not isinstance(p, Shard):
        if all(isinstance(pl(a), Replicate) for _, a in tensor_args(node)):
            v = gmeta.val(node)
            return RuleResult(tuple(R for _ in v) if isinstance(v, (tuple, list)) else R)
        return gather_all(node, pl, "an EmbeddingBag whose bags are not all of one length (or in max mode, or "
                                    "with padding_idx) reads the whole batch's offsets")
    # the rewrite reads the ids, the weight, the per-sample weights ([T], aligned with the ids: split with them) and,
    # in backward, the gradient; never the offsets nor the forward's offset2bag, bag_size, max_indices (asking for
    # those replicated priced three all_gathers per table that no program runs, and made the split batch look dear)
    psw = (10,) if backward else (6,)
    unread = {(2,), (3,), (4,), (5,)} if backward else {(2,)}
    needs = {}
    for path, a in tensor_args(node):
        if a is idx or path in unread or (backward and path == (0,)):
            continue
        if path == psw:
            if pl(a) != p:
                needs[path] = p
        elif isinstance(pl(a), Shard):
            needs[path] = R
    if backward:
        if pl(node.args[0]) != Shard(0):
            needs[(0,)] = Shard(0)
        return RuleResult(P, needs)
    # offset2bag, bag_size, max_indices: read by no op once the bag is rewritten; claimed whole (a sum bag's are empty,
    # and an output split on a dim shorter than the ranks would drop the strategy: the bag would then run whole, its
    # per-sample weights gathered)
    return RuleResult((Shard(0),) + (R,) * (len(gmeta.val(node)) - 1), needs)


def layer_norm(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """native_layer_norm(x, normalized_shape, w, b, eps) -> (out, mean, rstd): any dim outside the
    normalized ones may be sharded; weight and bias are replicated."""
    x = node.args[0]
    k = len(node.args[1])
    p = pl(x)
    needs = {(i,): R for i in (2, 3) if isinstance(node.args[i], torch.fx.Node) and not isinstance(pl(node.args[i]), Replicate)}
    if isinstance(p, Partial):
        needs[(0,)] = R
        return RuleResult((R, R, R), needs)
    if isinstance(p, Shard):
        if p.dim >= len(shape(x)) - k:
            return gather_all(node, pl, "it normalizes over the sharded dim")
        return RuleResult((p, p, p), needs)
    return RuleResult((R, R, R), needs)


def layer_norm_backward(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """native_layer_norm_backward -> (grad_x: the activations' shard, grad_w: Partial, grad_b: Partial)."""
    acts = [0, 1, 3, 4]  # grad_out, input, mean, rstd
    pls = {i: pl(node.args[i]) for i in acts}
    shards = {p.dim for p in pls.values() if isinstance(p, Shard)}
    needs: dict[ArgPath, Placement] = {}
    for i in (5, 6):
        if isinstance(node.args[i], torch.fx.Node) and not isinstance(pl(node.args[i]), Replicate):
            needs[(i,)] = R
    if not shards:
        for i, p in pls.items():
            if isinstance(p, Partial):
                needs[(i,)] = R
        return RuleResult((R, R, R), needs)
    if len(shards) > 1:
        return gather_all(node, pl, "activations are sharded on different dims")
    d = shards.pop()
    if d >= len(shape(node.args[1])) - len(node.args[2]):
        return gather_all(node, pl, "it normalizes over the sharded dim")
    for i, p in pls.items():
        if not isinstance(p, Shard):
            needs[(i,)] = Shard(d)
    return RuleResult((Shard(d), P, P), needs)


def softmax(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """_softmax/_log_softmax (x, dim) and their backward (grad, out, dim): the dim must not be sharded."""
    is_bw = node.target in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
    x = node.args[0]
    dim = node.args[2 if is_bw else 1] % max(len(shape(x)), 1)
    acts = [0, 1] if is_bw else [0]
    pls = [pl(node.args[i]) for i in acts]
    shards = {p.dim for p in pls if isinstance(p, Shard)}
    if not shards:
        return RuleResult(R, {(i,): R for i, p in zip(acts, pls) if isinstance(p, Partial)})
    d = shards.pop()
    if d == dim and not shards and node.target in _VOCAB_PARALLEL_SOFTMAX and all(p == Shard(d) for p in pls):
        # log-softmax over a sharded (vocabulary) dim: the vocab_parallel_loss pass computes it with
        # an all_reduce of the max and one of the sum of exponentials
        return RuleResult(Shard(d))
    if d == dim or shards:
        return gather_all(node, pl, "softmax over the sharded dim")
    return RuleResult(Shard(d), {(i,): Shard(d) for i, p in zip(acts, pls) if not isinstance(p, Shard)})


_VOCAB_PARALLEL_SOFTMAX = {aten._log_softmax.default, aten._log_softmax_backward_data.default}


def vocab_parallel_nll(node: torch.fx.Node, pl: PlacementOf) -> bool:
    """Whether an nll_loss (forward or backward) reads log-probabilities ``[N, C]`` sharded by class
    (``S(1)``) with replicated targets and no class weights: each rank picks the targets it holds
    (the vocab_parallel_loss pass masks the others)."""
    bw = node.target == aten.nll_loss_backward.default
    x, tgt, w = (node.args[1], node.args[2], node.args[3]) if bw else (node.args[0], node.args[1], node.args[2])
    return (node.target in (aten.nll_loss_forward.default, aten.nll_loss_backward.default)
            and len(shape(x)) == 2 and pl(x) == Shard(1) and isinstance(pl(tgt), Replicate) and w is None
            and node.args[4 if bw else 3] in (1, 2))


def nll_loss_forward(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """nll_loss(self [N, C, ...], target [N, ...], weight, reduction, ignore_index) -> (out, total_weight)."""
    x, tgt = node.args[0], node.args[1]
    reduction = node.args[3]
    px, pt = pl(x), pl(tgt)
    if vocab_parallel_nll(node, pl):
        return RuleResult((P, R))  # a partial sum of the picked log-probabilities; the count is replicated
    needs: dict[ArgPath, Placement] = {}
    if isinstance(node.args[2], torch.fx.Node) and not isinstance(pl(node.args[2]), Replicate):
        needs[(2,)] = R
    if not isinstance(px, Shard) and not isinstance(pt, Shard):
        if isinstance(px, Partial):
            needs[(0,)] = R
        return RuleResult((R, R), needs)
    if len(shape(x)) < 2 or (isinstance(px, Shard) and px.dim != 0) or (isinstance(pt, Shard) and pt.dim != 0):
        return gather_all(node, pl, "only the batch dim (0) of the loss input may be sharded")
    if not isinstance(px, Shard):
        needs[(0,)] = Shard(0)
    if not isinstance(pt, Shard):
        needs[(1,)] = Shard(0)
    if reduction == 0:  # none
        return RuleResult((Shard(0), R), needs)
    # sum: both outputs are partial sums; mean: rewritten by globalize_reductions to a
    # partial sum divided by the all-reduced (replicated) total weight.
    return RuleResult((P, P if reduction == 2 else R), needs)


def nll_loss_backward(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """nll_loss_backward(grad_out, self, target, weight, reduction, ignore_index, total_weight)."""
    g, x, tgt, w, reduction, _, tw = node.args[:7]
    px, pt = pl(x), pl(tgt)
    if vocab_parallel_nll(node, pl):
        needs = {(i,): R for i in (0, 6) if not isinstance(pl(node.args[i]), Replicate)}
        return RuleResult(Shard(1), needs)
    needs: dict[ArgPath, Placement] = {}
    if isinstance(w, torch.fx.Node) and not isinstance(pl(w), Replicate):
        needs[(3,)] = R
    if not isinstance(px, Shard) and not isinstance(pt, Shard):
        for i in (0, 1, 6):
            if isinstance(pl(node.args[i]), Partial):
                needs[(i,)] = R
        return RuleResult(R, needs)
    if len(shape(x)) < 2:
        return gather_all(node, pl, "only the batch dim (0) of the loss input may be sharded")
    # the gradient is laid out by sample (dim 0), as the forward's sharded loss input: log-probabilities
    # sharded by class (S(1)) with batch-sharded targets are moved to the batch dim first
    if px != Shard(0):
        needs[(1,)] = Shard(0)
    if pt != Shard(0):
        needs[(2,)] = Shard(0)
    if reduction == 0:
        if pl(g) != Shard(0):
            needs[(0,)] = Shard(0)
    elif not isinstance(pl(g), Replicate):
        needs[(0,)] = R
    if reduction == 1 and not isinstance(pl(tw), Replicate):
        needs[(6,)] = R
    return RuleResult(Shard(0), needs)


@dataclass(frozen=True)
class _BatchMajor:
    """Ops whose listed tensor args all carry the batch on dim 0 (attention, conv, pooling).

    ``batch_args``: argument positions carrying the batch; other tensor args must be
    replicated (weights). ``partial_outputs``: outputs that are weight gradients.
    """

    batch_args: tuple[int, ...]
    num_outputs: int = 1
    partial_outputs: tuple[int, ...] = ()

    def __call__(self, node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
        needs: dict[ArgPath, Placement] = {}
        sharded = False
        for path, a in tensor_args(node):
            p = pl(a)
            if path[0] in self.batch_args:
                if isinstance(p, Shard) and p.dim == 0:
                    sharded = True
        for path, a in tensor_args(node):
            p = pl(a)
            if path[0] in self.batch_args and sharded:
                if not (isinstance(p, Shard) and p.dim == 0):
                    if shape(a) and shape(a)[0] != 1:
                        needs[path] = Shard(0)
                    elif not isinstance(p, Replicate):
                        needs[path] = R
                continue
            if isinstance(p, Shard) and not sharded:
                return gather_all(node, pl, "only the batch dim (0) of activations may be sharded")
            if not isinstance(p, Replicate):
                needs[path] = R
        if not sharded:
            outs = tuple(R for _ in range(self.num_outputs))
        else:
            outs = tuple(P if i in self.partial_outputs else Shard(0) for i in range(self.num_outputs))
        return RuleResult(outs if self.num_outputs > 1 else outs[0], needs)


@dataclass(frozen=True)
class _Attention:
    """Scaled-dot-product attention (and its backward) over [B, H, T, hd] tensors: sharded on the
    batch (dim 0) or on heads (dim 1) alike for every activation argument; outputs follow."""

    num_acts: int
    num_outputs: int

    def __call__(self, node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
        acts = [((i,), node.args[i]) for i in range(self.num_acts) if isinstance(node.args[i], torch.fx.Node)]
        dims = [pl(a).dim for _, a in acts if isinstance(pl(a), Shard)]
        mask = node.kwargs.get("attn_mask")
        if not dims:
            needs = {p: R for p, a in acts if isinstance(pl(a), Partial)}
            if isinstance(mask, torch.fx.Node) and not isinstance(pl(mask), Replicate):
                needs[("attn_mask",)] = R  # whole activations need the whole mask
            return RuleResult((R,) * self.num_outputs, needs)
        d = dims[0]
        if d not in (0, 1):
            if isinstance(mask, torch.fx.Node):  # gather_all reaches positional arguments only
                raise unsupported(node, pl, "attention with a mask is split by batch or heads only")
            return gather_all(node, pl, "attention can be split by batch or heads only")
        needs = {p: Shard(d) for p, a in acts if pl(a) != Shard(d)}
        if isinstance(mask, torch.fx.Node):
            # the mask [B|1, H|1, T, S] follows the split: sharded alike, or of size 1 on that dim (it broadcasts)
            # and replicated, or replicated whole and sliced here (no communication)
            mshape, mp = shape(mask), pl(mask)
            broadcast = len(mshape) < 4 - d or mshape[d - 4] == 1
            if isinstance(mp, Replicate) and not broadcast and len(mshape) == 4:
                needs[("attn_mask",)] = Shard(d)
            elif not ((mp == Shard(d) and len(mshape) == 4) or (isinstance(mp, Replicate) and broadcast)):
                raise unsupported(node, pl, f"its attention mask {list(mshape)} ({mp!r}) does not follow the "
                                  f"split of dim {d}")
        return RuleResult((Shard(d),) * self.num_outputs, needs)


def batch_norm_training(node: torch.fx.Node, pl: PlacementOf) -> RuleResult | None:
    """BatchNorm with batch statistics (training mode) and its backward, DDP's semantics ("local", the
    ``--batch-norm`` default): over a batch split on dim 0 each rank normalizes its rows with their own
    statistics; the saved mean/invstd and updated running statistics are per-rank values, labelled
    replicated (only the backward and the running-stats pass ``batch_norm.keep_rank0_running_stats``
    read them); the backward gives the input's gradient on the shard and the weight's and bias's as
    partial sums. ``--batch-norm sync`` rewrites these nodes into sums before propagation
    (``batch_norm.sync_batch_norm``), so this rule never sees them then. Replicated inputs and
    eval-mode backward are per-sample; a split of another dim is gathered. The backward of BatchNorm
    without running statistics is left to DTensor's strategies (None), like its forward."""
    if node.target == aten.native_batch_norm_backward.default and node.args[7] is False:
        # eval-mode BatchNorm: running statistics, nothing depends on other samples
        return _BatchMajor((0, 1), 3, partial_outputs=(1, 2))(node, pl)
    if node.target == aten.native_batch_norm_backward.default and node.args[3] is None:
        # no running statistics (track_running_stats=False; its forward is ``_native_batch_norm_legit.no_stats``,
        # which has no rule of ours): DTensor's strategies, channels sharded or all replicated, keep the
        # statistics over the whole batch
        return None
    backward = node.target == aten.native_batch_norm_backward.default
    batch_args = (0, 1) if backward else (0,)
    pls = [pl(node.args[i]) for i in batch_args]
    n_out = len(gmeta.val(node)) if isinstance(gmeta.val(node), (tuple, list)) else 1
    if not any(isinstance(p, Shard) for p in pls):
        # the whole batch on every rank: weights or statistics split by channel are gathered too
        needs = {path: R for path, a in tensor_args(node) if not isinstance(pl(a), Replicate)}
        return RuleResult((R,) * n_out if n_out > 1 else R, needs)
    if any(isinstance(p, Shard) and p.dim != 0 for p in pls):
        return gather_all(node, pl, "BatchNorm's statistics are per channel over the batch: only the batch "
                                    "dim (0) may be split")
    if backward:
        return _BatchMajor((0, 1), 3, partial_outputs=(1, 2))(node, pl)
    needs = {path: R for path, a in tensor_args(node) if path[0] != 0 and not isinstance(pl(a), Replicate)}
    return RuleResult((Shard(0),) + (R,) * (n_out - 1), needs)


def loss_with_reduction(reduction_pos: int, backward: bool) -> Callable:
    """mse_loss, smooth_l1_loss, huber_loss, binary_cross_entropy(_with_logits) and their backward."""

    def rule(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
        reduction = _arg(node, reduction_pos, "reduction", 1)
        acts = [i for i in range(min(reduction_pos, len(node.args))) if isinstance(node.args[i], torch.fx.Node)]
        grad_pos = 0 if backward else None
        act_pls = {i: pl(node.args[i]) for i in acts if i != grad_pos}
        out_nd = max((len(shape(node.args[i])) for i in act_pls), default=0)
        shards = {p.dim + out_nd - len(shape(node.args[i])) for i, p in act_pls.items() if isinstance(p, Shard)}
        needs: dict[ArgPath, Placement] = {}
        if not shards:
            for i in acts:
                if isinstance(pl(node.args[i]), Partial):
                    needs[(i,)] = R
            return RuleResult(R, needs)
        if len(shards) > 1:
            return gather_all(node, pl, "inputs are sharded on different dims")
        d = shards.pop()
        for i, p in act_pls.items():
            ad = d - (out_nd - len(shape(node.args[i])))  # broadcasting aligns the trailing dims (a weight)
            if isinstance(p, Shard) and p.dim == ad:
                continue
            if ad >= 0 and shape(node.args[i])[ad] != 1:
                needs[(i,)] = Shard(ad)
            elif not isinstance(p, Replicate):
                needs[(i,)] = R
        if backward:
            g = pl(node.args[0])
            if reduction == 0 and not isinstance(g, Shard):
                needs[(0,)] = Shard(d)
            elif reduction != 0 and not isinstance(g, Replicate):
                needs[(0,)] = R
            return RuleResult(Shard(d), needs)
        return RuleResult(Shard(d) if reduction == 0 else P, needs)

    return rule


def constant_pad(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """constant_pad_nd(x, pad, value): a shard of an unpadded dim carries through; padding with 0
    is linear (Partial stays Partial); a padded sharded dim is gathered first."""
    p = pl(node.args[0])
    pad = list(node.args[1])
    nd = len(shape(node.args[0]))
    padded = {nd - 1 - i // 2 for i, v in enumerate(pad) if v}
    value = _arg(node, 2, "value", 0.0)
    if isinstance(p, Shard) and p.dim in padded:
        return gather_all(node, pl, "it pads the sharded dim")
    if isinstance(p, Partial) and value != 0:
        return RuleResult(R, {(0,): R})
    return RuleResult(p)


# ---------------------------------------------------------------- mixture of experts (issue 14, part 3: moe)
# index_add / scatter_add combines. Each keeps a shard of a dim the op does not index (a batch split of
# tokens, the expert dim of an expert-parallel weight), and each is linear in its ``self`` and ``source``
# together, so Partial sums stay Partial where ``self`` is zeros. The routers' topk (over the experts, the
# last dim) keeps a batch shard through DTensor's strategies (dtensor_choice).

_ZEROS = {aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default}


def _is_zeros(n: Any) -> bool:
    """``n`` is a tensor of zeros made in the graph (``torch.zeros``, ``new_zeros``, ``zeros_like``,
    ``full(..., 0)``): adding it once per rank adds nothing, so it may join a Partial sum."""
    if not isinstance(n, torch.fx.Node) or n.op != "call_function":
        return False
    if n.target in _ZEROS:
        return True
    if n.target in (aten.full.default, aten.new_full.default, aten.full_like.default, aten.fill.Scalar):
        return n.args[-1] == 0 if n.target != aten.full.default else n.args[1] == 0
    return False


def index_add(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """index_add(self, dim, index, source, alpha=1): ``self`` with ``source[i]`` added at ``index[i]`` of ``dim``.

    ``self``/``source`` ``[.., N_dim, ..]`` / ``[.., len(index), ..]``, ``index`` int64 ``[len(index)]``, kept
    whole. A shard of another dim (tokens of a batch split, experts of an expert-parallel weight) carries
    through, the other operand sliced to match; Partial ``self`` and ``source`` (or zeros and a Partial
    ``source``) give a Partial sum; a shard of ``dim`` itself is gathered first (the indices are global).
    """
    self_, dim, index, src = node.args[:4]
    nd = max(len(shape(self_)), 1)
    dim = dim % nd
    ps, pq, pi = pl(self_), pl(src), pl(index)
    needs: dict[ArgPath, Placement] = {} if isinstance(pi, Replicate) else {(2,): R}
    shards = {p.dim for p in (ps, pq) if isinstance(p, Shard)}
    if shards:
        d = shards.pop()
        if shards or d == dim:
            return gather_all(node, pl, "it adds along the sharded dim (or its inputs shard different dims)")
        for path, p in (((0,), ps), ((3,), pq)):
            if not isinstance(p, Shard):
                needs[path] = Shard(d)
        return RuleResult(Shard(d), needs)
    partial_s, partial_q = isinstance(ps, Partial), isinstance(pq, Partial)
    if partial_q and (partial_s or _is_zeros(self_)):
        return RuleResult(P, needs)
    if partial_s:  # a replicated source would be added once per rank: reduce self first
        return RuleResult(R, {**needs, (0,): R})
    if partial_q:  # self is not zeros: it must not join the sum once per rank
        return RuleResult(R, {**needs, (3,): R})
    return RuleResult(R, needs)


def scatter_add(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """scatter_add(self, dim, index, src): as :func:`gather_scatter` (a shard of another dim carries through),
    and linear like :func:`index_add`: a Partial ``src`` into Partial or zero ``self`` (index replicated)
    stays Partial."""
    self_, _, index, src = node.args[:4]
    ps, pi, pq = pl(self_), pl(index), pl(src)
    if isinstance(pq, Partial) and (isinstance(ps, Partial) or _is_zeros(self_)) and isinstance(pi, Replicate):
        return RuleResult(P)
    return gather_scatter(node, pl)
# ---------------------------------------------------------------- issue 14, part "capture" (point 8: HF T5)


def fill_tensor(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """``fill(self, value)`` with a 0-d tensor ``value`` (HF T5's ``shifted[..., 0] = decoder_start_token_id``):
    ``self``'s layout, every element ``value``; a Partial ``value`` is summed first (Partial self -> R).

    Before/after, batch split on 2 ranks: ``fill(select: int64[4] S(0), c: int64[] R) -> int64[4] S(0)``
    (each rank fills its 2 rows)."""
    p, v = pl(node.args[0]), pl(node.args[1])
    return RuleResult(p if isinstance(p, Shard) else R, {} if isinstance(v, Replicate) else {(1,): R})


# ---------------------------------------------------------------- collectives of other mesh axes


def other_axis_collective(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """A collective inserted when another mesh axis was lowered, seen along this axis.

    All of them are linear, so Partial stays Partial. ``all_reduce`` and ``wait_tensor`` are
    elementwise. ``all_gather`` concatenates, and ``reduce_scatter`` splits, dim 0 (the other
    axis's sharded dim, moved there): a shard of any other dim carries through; a shard of
    dim 0 along this axis too is gathered first.
    """
    p = pl(node.args[0])
    if node.target in (compat.functional_all_gather_op(), compat.functional_reduce_scatter_op(),
                       compat.functional_all_to_all_op()):
        if isinstance(p, Shard) and p.dim == 0:
            return gather_all(node, pl, "another mesh axis gathers or scatters the same dim")
    return RuleResult(p)


# ---------------------------------------------------------------- the table

RULES: dict[Any, Callable[[torch.fx.Node, PlacementOf], RuleResult]] = {
    aten.view.default: view,
    aten._unsafe_view.default: view,
    aten.reshape.default: view,
    aten.t.default: transpose,
    aten.transpose.int: transpose,
    aten.permute.default: transpose,
    aten.unsqueeze.default: unsqueeze,
    aten.squeeze.dim: squeeze,
    aten.squeeze.dims: squeeze,
    aten.squeeze.default: squeeze,
    aten.expand.default: expand,
    aten.select.int: select_like,
    aten.slice.Tensor: select_like,
    aten.narrow.default: select_like,
    aten.index_select.default: select_like,
    aten.split.Tensor: split,
    aten.split_with_sizes.default: split,
    aten.unbind.int: split,
    aten.cat.default: cat,
    aten.stack.default: cat,
    aten.sum.dim_IntList: reduction,
    aten.sum.default: reduction,
    aten.mean.dim: reduction,
    aten.mean.default: reduction,
    aten.amax.default: reduction,
    aten.amin.default: reduction,
    aten.var.correction: reduction,
    aten.max.dim: reduction_with_indices,
    aten.min.dim: reduction_with_indices,
    aten.prod.dim_int: reduction,
    aten.mm.default: mm,
    aten.bmm.default: bmm,
    aten.addmm.default: addmm,
    aten.baddbmm.default: addmm,
    aten.embedding.default: embedding,
    aten.embedding_dense_backward.default: embedding_backward,
    # EmbeddingBag (issue 14, point 4)
    aten._embedding_bag.default: embedding_bag,
    aten._embedding_bag_backward.default: embedding_bag,
    aten.native_layer_norm.default: layer_norm,
    aten.native_layer_norm_backward.default: layer_norm_backward,
    aten._softmax.default: softmax,
    aten._safe_softmax.default: softmax,  # the math attention of the torch.compile backend
    aten._log_softmax.default: softmax,
    aten._softmax_backward_data.default: softmax,
    aten._log_softmax_backward_data.default: softmax,
    aten.nll_loss_forward.default: nll_loss_forward,
    aten.nll_loss2d_forward.default: nll_loss_forward,
    aten.nll_loss_backward.default: nll_loss_backward,
    aten.nll_loss2d_backward.default: nll_loss_backward,
    aten.gather.default: gather_scatter,
    aten.scatter.src: gather_scatter,
    aten.scatter.value: gather_scatter,
    aten.new_zeros.default: new_factory,
    aten.new_ones.default: new_factory,
    aten.new_empty.default: new_factory,
    aten.new_full.default: new_factory,
    aten.ones_like.default: like_factory,
    aten.fill.Scalar: like_factory,
    aten._assert_tensor_metadata.default: no_output,
    aten.slice_backward.default: slice_select_backward,
    aten.select_backward.default: slice_select_backward,
    aten.zeros_like.default: like_factory,
    aten.empty_like.default: like_factory,
    aten.full_like.default: like_factory,
    aten.rand_like.default: random_like,
    aten.bernoulli.p: random_like,  # dropout under torch.vmap (the torch.compile backend)
    aten.randn_like.default: random_like,
    aten._to_copy.default: identity,
    aten.clone.default: identity,
    aten.alias.default: identity,
    aten.detach.default: identity,
    aten.lift_fresh_copy.default: identity,
    aten.native_dropout.default: dropout,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _Attention(num_acts=3, num_outputs=2),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _Attention(num_acts=6, num_outputs=3),
    aten.convolution.default: _BatchMajor((0,)),
    aten.convolution_backward.default: _BatchMajor((0, 1), 3, partial_outputs=(1, 2)),
    aten.max_pool2d_with_indices.default: _BatchMajor((0,), 2),
    aten.max_pool2d_with_indices_backward.default: _BatchMajor((0, 1, 7)),
    aten.avg_pool2d.default: _BatchMajor((0,)),
    aten.avg_pool2d_backward.default: _BatchMajor((0, 1)),
    aten._adaptive_avg_pool2d.default: _BatchMajor((0,)),
    aten._adaptive_avg_pool2d_backward.default: _BatchMajor((0, 1)),
    aten._native_batch_norm_legit_no_training.default: _BatchMajor((0,), 3),
    aten.native_group_norm.default: _BatchMajor((0,), 3),
    aten.native_group_norm_backward.default: _BatchMajor((0, 1, 2, 3), 3, partial_outputs=(1, 2)),
    aten._native_batch_norm_legit_functional.default: batch_norm_training,
    aten._native_batch_norm_legit.default: batch_norm_training,
    aten.native_batch_norm.default: batch_norm_training,
    aten.native_batch_norm_backward.default: batch_norm_training,
    aten.mse_loss.default: loss_with_reduction(2, backward=False),
    aten.mse_loss_backward.default: loss_with_reduction(3, backward=True),
    aten.smooth_l1_loss.default: loss_with_reduction(2, backward=False),
    aten.smooth_l1_loss_backward.default: loss_with_reduction(3, backward=True),
    aten.huber_loss.default: loss_with_reduction(2, backward=False),
    aten.huber_loss_backward.default: loss_with_reduction(3, backward=True),
    aten.binary_cross_entropy.default: loss_with_reduction(3, backward=False),
    aten.binary_cross_entropy_backward.default: loss_with_reduction(4, backward=True),
    aten.binary_cross_entropy_with_logits.default: loss_with_reduction(4, backward=False),
    aten.constant_pad_nd.default: constant_pad,
    aten.copy.default: pointwise,  # copy(self, src): src broadcast to self, e.g. x[..., 1:] = y
    # mixture of experts (issue 14, part 3: moe)
    aten.index_add.default: index_add,
    aten.scatter_add.default: scatter_add,
    # issue 14, part "capture" (point 8: HF T5)
    aten.fill.Tensor: fill_tensor,
    compat.functional_all_reduce_op(): other_axis_collective,
    compat.functional_all_gather_op(): other_axis_collective,
    compat.functional_reduce_scatter_op(): other_axis_collective,
    compat.functional_all_to_all_op(): other_axis_collective,
    compat.functional_wait_op(): other_axis_collective,
}


# ---------------------------------------------------------------- op coverage (issue 14, part 1: "opinfo")
# Rules for ops of torch's OpInfo database that had none of ours nor DTensor's (tests/test_opinfo_sweep.py,
# benchmarks/bench_opinfo.py): the ``*_copy`` forms of views, matrix-vector products, diagonals. (``view_copy``/
# ``expand_copy`` too: localize_shapes rewrites their global size argument as the views'.) Rules marked
# (opinfo2): batches of matrices (linalg), unfold, diag_embed, prelu, bilinear, and others the sweep found.


class _AsOp:
    """``node`` seen as a call of ``target`` (the view a ``*_copy`` op copies), for a rule reading
    ``node.target``."""

    def __init__(self, node: torch.fx.Node, target: Any):
        self._node, self.target = node, target

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)


def as_op(target: Any, rule: Callable[[torch.fx.Node, PlacementOf], RuleResult]) -> Callable:
    """The rule of ``target`` applied to an op that computes the same values (``view_copy`` -> ``view``)."""
    def apply(node: torch.fx.Node, pl: PlacementOf, **kw: Any) -> RuleResult:
        return rule(_AsOp(node, target), pl, **kw)  # type: ignore[arg-type]

    apply.__doc__ = f"As {target}: {rule.__doc__}"
    apply.takes_mesh_size = getattr(rule, "takes_mesh_size", False)  # type: ignore[attr-defined]
    return apply


def contraction(spec: str, bias: bool = False) -> Callable[[torch.fx.Node, PlacementOf], RuleResult]:
    """A rule for a product written as an einsum ``spec`` over its tensor arguments in order (``"ij,j->i"``
    for ``mv``), after a ``bias`` argument shaped (broadcast) like the output when ``bias`` (``addmv``,
    ``addr``, ``addbmm``). A label sharded on one operand is sharded on all of them (a replicated operand is
    sliced to match): a label of the output gives that output dim's shard, a contracted one a Partial sum
    (no bias then: it would be added once per rank, so the inputs are gathered). One Partial operand times
    replicated ones (no bias) stays Partial. Anything else gathers."""
    ins_spec, out_spec = spec.split("->")
    labels = ins_spec.split(",")

    def rule(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
        args = tensor_args(node)
        b_arg, ops = (args[0], args[1:]) if bias else (None, args)
        if len(ops) != len(labels) or any(len(shape(a)) != len(lab) for (_, a), lab in zip(ops, labels)):
            return gather_all(node, pl, f"arguments do not match {spec}")
        pls = [pl(a) for _, a in ops]
        pb = pl(b_arg[1]) if b_arg else R
        partial = [i for i, p in enumerate(pls) if isinstance(p, Partial)]
        if partial:
            if (len(partial) == 1 and all(isinstance(p, Replicate) for i, p in enumerate(pls) if i != partial[0])
                    and not bias):
                return RuleResult(P)
            return gather_all(node, pl, "Partial operands")
        sharded = {lab[p.dim] for (_, a), lab, p in zip(ops, labels, pls) if isinstance(p, Shard)}
        if isinstance(pb, Shard):
            k = pb.dim + len(out_spec) - len(shape(b_arg[1]))
            if shape(b_arg[1])[pb.dim] != 1 and 0 <= k:
                sharded.add(out_spec[k])
        if len(sharded) != 1:
            if not sharded and not isinstance(pb, Partial):
                return RuleResult(R)
            return gather_all(node, pl, "operands sharded on different labels")
        label = sharded.pop()
        needs: dict[ArgPath, Placement] = {}
        for (path, a), lab, p in zip(ops, labels, pls):
            want = Shard(lab.index(label)) if label in lab else R
            if p != want:
                needs[path] = want
        if label not in out_spec:
            if bias:
                return gather_all(node, pl, "a contracted dim is sharded and a bias is added")
            return RuleResult(P, needs)
        od = out_spec.index(label)
        if b_arg:
            bshape = shape(b_arg[1])
            bd = od - (len(out_spec) - len(bshape))
            want = Shard(bd) if bd >= 0 and bshape[bd] != 1 else R
            if pb != want:
                needs[b_arg[0]] = want
        return RuleResult(Shard(od), needs)

    rule.__doc__ = f"{spec}{' plus a bias' if bias else ''}: see contraction()."
    return rule


def diagonal(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """diagonal(x, offset, dim1, dim2): a shard on another dim moves with it (the diagonal becomes the last dim)."""
    p = pl(node.args[0])
    if not isinstance(p, Shard):
        return RuleResult(p)
    nd = len(shape(node.args[0]))
    d1, d2 = _arg(node, 2, "dim1", 0) % nd, _arg(node, 3, "dim2", 1) % nd
    if p.dim in (d1, d2):
        return gather_all(node, pl, "the diagonal is taken over the sharded dim")
    rest = [d for d in range(nd) if d not in (d1, d2)]
    return RuleResult(Shard(rest.index(p.dim)))


def diagonal_backward(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """diagonal_backward(grad, input_sizes, offset, dim1, dim2): zeros of ``input_sizes`` with ``grad`` on the
    diagonal; a shard of grad's other dims carries over (its diagonal dim, the last, gathers)."""
    p = pl(node.args[0])
    if not isinstance(p, Shard):
        return RuleResult(p if isinstance(p, Partial) else R)
    nd = len(node.args[1])
    d1, d2 = node.args[3] % nd, node.args[4] % nd
    rest = [d for d in range(nd) if d not in (d1, d2)]
    if p.dim >= len(rest):
        return gather_all(node, pl, "the diagonal dim is sharded")
    return RuleResult(Shard(rest[p.dim]))


def keeps_other_dims(dims_of: Callable[[torch.fx.Node], list[int]]) -> Callable:
    """A rule for an op that mixes values only along the input dims ``dims_of(node)`` names (``tril`` along
    the last two, ``glu`` along ``dim``, ``rot90`` along ``dims``) and keeps the shape elsewhere: a shard on
    another dim stays; on one of those dims, gather. Its backward forms (grad first, same shape) too."""
    def rule(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
        pls = [(path, a, pl(a)) for path, a in tensor_args(node)]
        nd = len(shape(node.args[0]))
        shards = {p.dim for _, _, p in pls if isinstance(p, Shard)}
        if not shards:
            if any(isinstance(p, Partial) for _, _, p in pls):
                return gather_all(node, pl, "a Partial input")
            return RuleResult(R)
        d = shards.pop()
        if shards or d in [x % nd for x in dims_of(node)] or any(len(shape(a)) != nd for _, a, _ in pls):
            return gather_all(node, pl, "it mixes values along the sharded dim")
        return RuleResult(Shard(d), {path: Shard(d) for path, _, p in pls if p != Shard(d)})

    return rule


def pointwise_multi(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """An elementwise op with several outputs of its input's shape (``log_sigmoid_forward``'s output and
    buffer): every output laid out as :func:`pointwise` lays out one."""
    v = gmeta.val(node)
    if not all(isinstance(o, torch.Tensor) and tuple(o.shape) == tuple(v[0].shape) for o in v):
        return gather_all(node, pl, "its outputs differ in shape")
    pls = [(path, a, pl(a)) for path, a in tensor_args(node)]
    split = _broadcast_shard(pls, v[0].dim())
    if split is None:
        if any(not isinstance(p, Replicate) for _, _, p in pls):
            return gather_all(node, pl, "a Partial input of a nonlinear op")
        return RuleResult(tuple(R for _ in v))
    return RuleResult(tuple(Shard(split[0]) for _ in v), split[1])


# elementwise ops (broadcasting) that torch does not tag ``pointwise``: activations and their backward
_ELEMENTWISE = (
    "elu", "elu_backward", "hardsigmoid", "hardsigmoid_backward", "hardswish", "hardswish_backward",
    "hardtanh", "hardtanh_backward", "leaky_relu", "leaky_relu_backward", "log_sigmoid_backward",
    "softplus", "softplus_backward", "hardshrink", "hardshrink_backward", "softshrink", "softshrink_backward",
    "threshold", "threshold_backward", "gelu", "gelu_backward", "silu", "silu_backward", "mish",
    "mish_backward", "sigmoid_backward", "tanh_backward", "logit_backward", "relu", "celu", "selu",
    "floor_divide",
)


def _elementwise_rules() -> dict[Any, Callable[[torch.fx.Node, PlacementOf], RuleResult]]:
    out = {}
    for name in _ELEMENTWISE:
        packet = getattr(aten, name, None)
        overload = getattr(packet, "default", None) if packet is not None else None
        if overload is not None:
            out[overload] = pointwise
    return out


def pair_of(target: Any, rule: Callable[[torch.fx.Node, PlacementOf], RuleResult]) -> Callable:
    """Two outputs laid out as ``rule`` lays out ``target``'s one (``var_mean`` as ``var``, ``aminmax`` as
    ``amax``); a Partial result (a reduction over the sharded dim) gathers instead: the second output
    need not be linear."""
    def apply(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
        res = rule(_AsOp(node, target), pl)  # type: ignore[arg-type]
        out = res.out
        if isinstance(out, tuple) or isinstance(out, Partial):
            return gather_all(node, pl, "it reduces over the sharded dim")
        return RuleResult((out, out), res.needs)

    apply.__doc__ = f"Two outputs as {target}'s one."
    return apply


def _pools() -> dict[Any, Callable[[torch.fx.Node, PlacementOf], RuleResult]]:
    """Pooling and padding ops of 3-D/N-D inputs, their backward too: independent along dim 0 (the batch, or
    the channels of an unbatched input), as the 2-D ones in the table."""
    table = {
        "adaptive_max_pool2d": _BatchMajor((0,), 2), "adaptive_max_pool2d_backward": _BatchMajor((0, 1, 2)),
        "adaptive_max_pool3d": _BatchMajor((0,), 2), "adaptive_max_pool3d_backward": _BatchMajor((0, 1, 2)),
        "_adaptive_avg_pool3d": _BatchMajor((0,)), "_adaptive_avg_pool3d_backward": _BatchMajor((0, 1)),
        "avg_pool3d": _BatchMajor((0,)), "avg_pool3d_backward": _BatchMajor((0, 1)),
        "max_pool3d_with_indices": _BatchMajor((0,), 2), "max_pool3d_with_indices_backward": _BatchMajor((0, 1, 7)),
    }
    for kind in ("reflection", "replication"):
        for nd in (1, 2, 3):
            table[f"{kind}_pad{nd}d"] = _BatchMajor((0,))
            table[f"{kind}_pad{nd}d_backward"] = _BatchMajor((0, 1))
    out = {}
    for name, rule in table.items():
        overload = getattr(getattr(aten, name, None), "default", None)
        if overload is not None:
            out[overload] = rule
    return out


def batched_only(ndim: int, rule: Callable[[torch.fx.Node, PlacementOf], RuleResult]) -> Callable:
    """``rule`` where the first argument has ``ndim`` dims (a batch on dim 0); an unbatched input (dim 0 is
    channels, which ``pixel_shuffle`` mixes) gathers."""
    def apply(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
        if len(shape(node.args[0])) != ndim:
            return gather_all(node, pl, f"the input is not batched ({ndim} dims)")
        return rule(node, pl)

    apply.__doc__ = f"{rule.__doc__} (inputs of {ndim} dims only)"
    return apply


def _index_layout(node: torch.fx.Node, pl: PlacementOf) -> tuple[int, list[int]] | None:
    """For ``index(x, indices)`` & co: the dim ``x`` is sharded on if it comes before every indexed dim (its
    position in the output is then the same), and the positions of the index tensors; None otherwise."""
    p = pl(node.args[0])
    indices = node.args[1]
    pos = [i for i, t in enumerate(indices) if t is not None]
    if not isinstance(p, Shard) or not pos or p.dim >= min(pos):
        return None
    return p.dim, pos


def index_tensor(node: torch.fx.Node, pl: PlacementOf) -> RuleResult | None:
    """index/_unsafe_index(x, [None, ..., idx, ...]): a shard of ``x`` on a dim before every indexed one stays
    (``interpolate``'s gathers of rows by position); index tensors replicated. Other forms: None (DTensor's
    strategies)."""
    lay = _index_layout(node, pl)
    if lay is None:
        if isinstance(pl(node.args[0]), Shard):
            return gather_all(node, pl, "the sharded dim is indexed (or after an indexed one)")
        return None  # other forms (a replicated table indexed by sharded positions): DTensor's strategies
    d, pos = lay
    needs = {(1, j): R for j in pos if not isinstance(pl(node.args[1][j]), Replicate)}
    return RuleResult(Shard(d), needs)


def index_put_tensor(node: torch.fx.Node, pl: PlacementOf) -> RuleResult | None:
    """index_put/_unsafe_index_put(x, [None, ..., idx, ...], values, accumulate): with ``x`` and ``values``
    sharded on the same dim before every indexed one (``interpolate``'s backward), each rank puts its rows;
    index tensors replicated. Other forms: None (DTensor's strategies)."""
    x, values = node.args[0], node.args[2]
    px, pv = pl(x), pl(values)
    pos = [i for i, t in enumerate(node.args[1]) if t is not None]
    shard = px if isinstance(px, Shard) else pv if isinstance(pv, Shard) else None
    idx_nd = max((len(shape(node.args[1][j])) for j in pos), default=0)
    ok = (shard is not None and pos and shard.dim < min(pos)
          and len(shape(values)) == len(shape(x)) - len(pos) + idx_nd
          and all(isinstance(p, (Shard, Replicate)) for p in (px, pv)))
    if not ok:
        if isinstance(px, Shard):
            return gather_all(node, pl, "the sharded dim is indexed (or after an indexed one)")
        return _index_put_rows(node, pl)  # None for other forms: DTensor's strategies
    d = shard.dim
    needs: dict[ArgPath, Placement] = {}
    for path, p in (((0,), px), ((2,), pv)):
        if p != Shard(d):
            needs[path] = Shard(d)
    needs.update({(1, j): R for j in pos if not isinstance(pl(node.args[1][j]), Replicate)})
    return RuleResult(Shard(d), needs)


_ZERO_FILLS = {aten.new_zeros.default, aten.zeros.default, aten.zeros_like.default}


def _index_put_rows(node: torch.fx.Node, pl: PlacementOf) -> RuleResult | None:
    """index_put(zeros [V, ...], [idx], values [*idx, ...], accumulate=True), ``values`` sharded on an index dim
    ``k`` (the backward of ``table[idx]`` with positions repeated over the batch: Whisper's decoder): each rank
    adds its rows of ``values`` at its rows of ``idx`` (a local slice where ``idx`` is replicated), the sum over
    ranks is the whole gradient: ``Partial("sum")``. Needs the base to be zeros (else each rank would add it);
    other forms: None."""
    x, indices, values = node.args[0], node.args[1], node.args[2]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if (not accumulate or not isinstance(x, torch.fx.Node) or x.target not in _ZERO_FILLS
            or len(indices) != 1 or not isinstance(indices[0], torch.fx.Node)):
        return None
    idx = indices[0]
    px, pi, pv = pl(x), pl(idx), pl(values)
    nd = len(shape(idx))
    if (not isinstance(px, Replicate) or not isinstance(pv, Shard) or pv.dim >= nd
            or len(shape(values)) != nd + len(shape(x)) - 1 or shape(idx)[pv.dim] != shape(values)[pv.dim]):
        return None
    if pi == pv:
        return RuleResult(P)
    if isinstance(pi, Replicate):
        return RuleResult(P, {(1, 0): pv})
    return None


def batched_core(*cores: int) -> Callable[[torch.fx.Node, PlacementOf], RuleResult | None]:
    """(opinfo2) A rule for an op on a batch of matrices (``linalg.*``, ``cholesky``, ``_cdist_forward`` on
    ``[*, n, n]``): argument ``i`` (positional) has ``cores[i]`` trailing core dims (2 for a matrix, 1 for a
    vector of pivots or ``tau``; arguments past ``cores`` 2), the dims before them are batch dims that every
    tensor argument and every output shares, and the op computes each batch entry from that entry alone. A
    shard on a batch dim ``d`` then stays on ``d`` in every output (an empty output, such as ``_linalg_svd``'s
    U without ``compute_uv``, is replicated); every other tensor argument is sharded on ``d`` too, or
    replicated where it broadcasts (size 1) or is 0-dim. Other forms (a shard on a core dim, batch dims that
    differ in number, a Partial input): None (DTensor's strategies, else refused)."""
    def core_of(path: ArgPath) -> int:
        return cores[path[0]] if path[0] < len(cores) else 2

    def rule(node: torch.fx.Node, pl: PlacementOf) -> RuleResult | None:
        args = [(path, a, pl(a)) for path, a in tensor_args(node)]
        if any(isinstance(p, Partial) for _, _, p in args):
            return None
        nbs = {path: len(shape(a)) - core_of(path) for path, a, _ in args if shape(a)}
        if not nbs or min(nbs.values()) < 0:
            return None
        nb = max(nbs.values())  # batch dims broadcast right-aligned: arg ``path``'s dim k is batch dim k + lead
        shards = {p.dim + nb - nbs[path] for path, _, p in args if isinstance(p, Shard) and path in nbs}
        if not shards:
            if any(isinstance(p, Shard) for _, _, p in args):
                return None
            v = gmeta.val(node)
            return RuleResult(tuple(R for _ in v) if isinstance(v, (tuple, list)) else R)
        d = shards.pop()
        if shards or any(isinstance(p, Shard) and p.dim >= nbs[path] for path, _, p in args):
            return None
        size = next(shape(a)[p.dim] for _, a, p in args if isinstance(p, Shard))
        needs: dict[ArgPath, Placement] = {}
        for path, a, p in args:
            ad = d - (nb - nbs.get(path, 0))
            if path not in nbs or ad < 0 or shape(a)[ad] == 1:
                want: Placement = R
            elif shape(a)[ad] == size:
                want = Shard(ad)
            else:
                return None
            if p != want:
                needs[path] = want
        v = gmeta.val(node)
        outs = []
        for o in (v if isinstance(v, (tuple, list)) else [v]):
            if isinstance(o, torch.Tensor) and o.dim() > d and o.shape[d] == size:
                outs.append(Shard(d))
            elif not isinstance(o, torch.Tensor) or o.numel() == 0:
                outs.append(R)
            else:
                return None
        return RuleResult(tuple(outs) if isinstance(v, (tuple, list)) else outs[0], needs)

    rule.__doc__ = f"A batch of matrices (core dims per argument {cores}): see batched_core()."
    return rule


def unfold(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """(opinfo2) unfold(x, dim, size, step) and unfold_copy: windows along ``dim`` (its size becomes the
    window count, a trailing dim of ``size`` is added); a shard on another dim stays. Linear."""
    p = pl(node.args[0])
    if not isinstance(p, Shard):
        return RuleResult(p)
    nd = len(shape(node.args[0]))
    if nd and p.dim == node.args[1] % nd:
        return gather_all(node, pl, "it unfolds the sharded dim")
    return RuleResult(p)


def unfold_backward(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """(opinfo2) unfold_backward(grad, input_sizes, dim, size, step): a shard of grad on a dim of the input
    other than ``dim`` carries over (``input_sizes`` is localized). Linear."""
    p = pl(node.args[0])
    if not isinstance(p, Shard):
        return RuleResult(p)
    nd = len(node.args[1])
    if p.dim >= nd or (nd and p.dim == node.args[2] % nd):
        return gather_all(node, pl, "the unfolded dim (or the window dim) is sharded")
    return RuleResult(p)


def diag_embed(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """(opinfo2) diag_embed(x, offset, dim1, dim2): x's last dim becomes a diagonal on output dims
    ``dim1``/``dim2``, its other dims fill the rest in order; a shard on one of those moves with it. Linear."""
    p = pl(node.args[0])
    if not isinstance(p, Shard):
        return RuleResult(p)
    nd = len(shape(node.args[0]))
    out_nd = nd + 1
    d1, d2 = _arg(node, 2, "dim1", -2) % out_nd, _arg(node, 3, "dim2", -1) % out_nd
    if p.dim == nd - 1:
        return gather_all(node, pl, "the diagonal's dim is sharded")
    rest = [k for k in range(out_nd) if k not in (d1, d2)]
    return RuleResult(Shard(rest[p.dim]))


def masked_scatter_scalar(node: torch.fx.Node, pl: PlacementOf) -> RuleResult | None:
    """(opinfo2) masked_scatter(x, mask, source) with a 0-dim mask and ``source`` shaped as ``x``: the output
    is ``source`` (mask true) or ``x``, elementwise, so laid out as :func:`pointwise` over x and source (the
    mask replicated). Other forms (source elements taken in order across rows): None."""
    x, mask, src = node.args[0], node.args[1], node.args[2]
    if shape(mask) != () or shape(src) != shape(x) or not isinstance(pl(mask), Replicate):
        return None
    return pointwise(node, pl)


def masked_scatter_backward_scalar(node: torch.fx.Node, pl: PlacementOf) -> RuleResult | None:
    """(opinfo2) masked_scatter_backward(grad, mask, sizes) with a 0-dim mask and ``sizes`` grad's shape: grad
    (mask true) or zeros, laid out like grad (``sizes`` is localized). Other forms: None."""
    grad, mask = node.args[0], node.args[1]
    if shape(mask) != () or tuple(node.args[2]) != shape(grad) or not isinstance(pl(mask), Replicate):
        return None
    p = pl(grad)
    return RuleResult(p if not isinstance(p, Partial) else P)


def resize_as_same(node: torch.fx.Node, pl: PlacementOf) -> RuleResult | None:
    """(opinfo2) resize_as(x, template) where template has x's shape: x itself; the template (whose local
    shape gives the result's) laid out as x. Other forms: None."""
    x, t = node.args[0], node.args[1]
    if shape(x) != shape(t):
        return None
    p = pl(x)
    if isinstance(p, Partial):
        return None
    return RuleResult(p, {(1,): p} if pl(t) != p else {})


def trilinear(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """(opinfo2) _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim) (``bilinear``): each
    input unsqueezed at its ``expand`` dims, multiplied, summed over ``sumdim``. A dim sharded on every input
    that has it (not unsqueezed there) is sharded in the output (Partial if summed); the inputs unsqueezed
    there stay replicated. Anything else gathers."""
    ins = [node.args[k] for k in range(3)]
    expands = [sorted(node.args[3 + k]) for k in range(3)]
    sumdim = list(node.args[6])
    total = len(shape(ins[0])) + len(expands[0])

    def real_dims(k: int) -> list[int]:  # expanded position of each of input k's own dims
        return [e for e in range(total) if e not in expands[k]]

    pls = [pl(a) for a in ins]
    if any(isinstance(p, Partial) for p in pls):
        return gather_all(node, pl, "a Partial input")
    sharded = {real_dims(k)[p.dim] for k, p in enumerate(pls) if isinstance(p, Shard)}
    if not sharded:
        return RuleResult(R)
    if len(sharded) != 1:
        return gather_all(node, pl, "inputs sharded on different dims")
    e = sharded.pop()
    needs: dict[ArgPath, Placement] = {}
    for k, a in enumerate(ins):
        want = Shard(real_dims(k).index(e)) if e in real_dims(k) else R
        if want != R and shape(a)[want.dim] == 1:
            return gather_all(node, pl, "a sharded dim broadcasts")
        if pls[k] != want:
            needs[(k,)] = want
    if e in sumdim:
        return RuleResult(P, needs)
    return RuleResult(Shard(e - sum(1 for d in sumdim if d < e)), needs)


class _WithArgs(_AsOp):
    """``node`` seen as a call of ``target`` with positional ``args``."""

    def __init__(self, node: torch.fx.Node, target: Any, args: tuple):
        super().__init__(node, target)
        self.args = args


def norm_dim(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """(opinfo2) norm.ScalarOpt_dim(x, p, dim, keepdim): a (non-sum) reduction over ``dim``, as ``amax``."""
    args = (node.args[0], _arg(node, 2, "dim", None), _arg(node, 3, "keepdim", False))
    return reduction(_WithArgs(node, aten.amax.default, args), pl)  # type: ignore[arg-type]


def renorm(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """(opinfo2) renorm(x, p, dim, maxnorm): each slice along ``dim`` rescaled by its own norm: a shard on
    ``dim`` stays, on another dim gathers."""
    p = pl(node.args[0])
    if not isinstance(p, Shard):
        return RuleResult(R) if isinstance(p, Replicate) else gather_all(node, pl, "a Partial input")
    if p.dim != node.args[2] % len(shape(node.args[0])):
        return gather_all(node, pl, "each slice's norm spans the sharded dim")
    return RuleResult(p)


def chunk_cat(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """(opinfo2) _chunk_cat(tensors, dim, num_chunks): the dims before ``dim`` are kept (each tensor's chunks
    are concatenated behind them), so a shard there, on every tensor, stays. Otherwise gather."""
    tensors = node.args[0]
    nd = len(shape(tensors[0]))
    dim = node.args[1] % nd if nd else 0
    pls = [pl(t) for t in tensors]
    if all(isinstance(p, Replicate) for p in pls):
        return RuleResult(R)
    shards = {p.dim for p in pls if isinstance(p, Shard)}
    if len(shards) != 1 or any(isinstance(p, Partial) for p in pls) or shards.copy().pop() >= dim:
        return gather_all(node, pl, "a shard on the chunked dims")
    d = shards.pop()
    return RuleResult(Shard(d), {(0, j): Shard(d) for j, p in enumerate(pls) if p != Shard(d)})


# (opinfo2) ops on a batch of matrices: aten op name -> core dims per positional argument (batched_core)
_BATCHED_CORE = {
    "cholesky": (2,), "cholesky_inverse": (2,), "linalg_cholesky_ex": (2,), "_linalg_svd": (2,),
    "_linalg_eigh": (2,), "linalg_inv_ex": (2,), "linalg_ldl_factor_ex": (2,), "linalg_qr": (2,),
    "linalg_lu_factor_ex": (2,), "linalg_lu": (2,), "geqrf": (2,), "_linalg_slogdet": (2,), "_linalg_det": (2,),
    "linalg_matrix_exp": (2,), "lu_unpack": (2, 1), "linalg_householder_product": (2, 1),
    "linalg_solve_triangular": (2, 2), "triangular_solve": (2, 2), "cholesky_solve": (2, 2),
    "linalg_lu_solve": (2, 1, 2), "linalg_ldl_solve": (2, 1, 2), "ormqr": (2, 1, 2),
    "_cdist_forward": (2, 2), "_cdist_backward": (2, 2, 2, 0, 2), "linalg_pinv": (2, 0, 0),
}


def _batched_core_rules() -> dict[Any, Callable]:
    out = {}
    for name, cores in _BATCHED_CORE.items():
        packet = getattr(aten, name, None)
        for overload in (packet.overloads() if packet is not None else ()):
            out[getattr(packet, overload)] = batched_core(*cores)
    return out


_OPINFO_RULES: dict[Any, Callable[[torch.fx.Node, PlacementOf], RuleResult]] = {
    aten.index.Tensor: index_tensor,
    aten._unsafe_index.Tensor: index_tensor,
    aten.index_put.default: index_put_tensor,
    aten._unsafe_index_put.default: index_put_tensor,
    aten.pixel_shuffle.default: batched_only(4, _BatchMajor((0,))),
    aten.pixel_unshuffle.default: batched_only(4, _BatchMajor((0,))),
    aten.channel_shuffle.default: batched_only(4, _BatchMajor((0,))),
    aten.native_channel_shuffle.default: batched_only(4, _BatchMajor((0,))),
    **_elementwise_rules(),
    **_pools(),
    aten.rsub.Tensor: pointwise,
    aten.rsub.Scalar: pointwise,
    aten.zero.default: like_factory,
    aten.tril.default: keeps_other_dims(lambda n: [-1, -2]),
    aten.triu.default: keeps_other_dims(lambda n: [-1, -2]),
    aten.glu.default: keeps_other_dims(lambda n: [_arg(n, 1, "dim", -1)]),
    aten.glu_backward.default: keeps_other_dims(lambda n: [_arg(n, 2, "dim", -1)]),
    aten.rot90.default: keeps_other_dims(lambda n: list(_arg(n, 2, "dims", [0, 1]))),
    aten.var_mean.correction: pair_of(aten.var.correction, reduction),
    aten.std_mean.correction: pair_of(aten.var.correction, reduction),
    aten.aminmax.default: pair_of(aten.amax.default, reduction),
    aten.log_sigmoid_forward.default: pointwise_multi,
    # views, as copies
    aten.alias_copy.default: identity,
    aten.detach_copy.default: identity,
    aten.permute_copy.default: as_op(aten.permute.default, transpose),
    aten.transpose_copy.int: as_op(aten.transpose.int, transpose),
    aten.t_copy.default: as_op(aten.t.default, transpose),
    aten.unsqueeze_copy.default: as_op(aten.unsqueeze.default, unsqueeze),
    aten.squeeze_copy.dim: as_op(aten.squeeze.dim, squeeze),
    aten.squeeze_copy.dims: as_op(aten.squeeze.dims, squeeze),
    aten.squeeze_copy.default: as_op(aten.squeeze.default, squeeze),
    aten.select_copy.int: as_op(aten.select.int, select_like),
    aten.slice_copy.Tensor: as_op(aten.slice.Tensor, select_like),
    aten.narrow_copy.default: as_op(aten.narrow.default, select_like),
    aten.split_copy.Tensor: as_op(aten.split.Tensor, split),
    aten.split_with_sizes_copy.default: as_op(aten.split_with_sizes.default, split),
    aten.unbind_copy.int: as_op(aten.unbind.int, split),
    aten.unsafe_split.Tensor: as_op(aten.split.Tensor, split),
    aten.unsafe_split_with_sizes.default: as_op(aten.split_with_sizes.default, split),
    aten.diagonal.default: diagonal,
    aten.diagonal_copy.default: diagonal,
    aten.diagonal_backward.default: diagonal_backward,
    # products
    aten.mv.default: contraction("ij,j->i"),
    aten.addmv.default: contraction("ij,j->i", bias=True),
    aten.dot.default: contraction("i,i->"),
    aten.vdot.default: contraction("i,i->"),
    aten.outer.default: contraction("i,j->ij"),
    aten.addr.default: contraction("i,j->ij", bias=True),
    aten.addbmm.default: contraction("bij,bjk->ik", bias=True),
    # (opinfo2) ``new_empty_strided``'s size and strides are global and localize_shapes leaves them so: the
    # empty tensor is replicated (a consumer sharded slices it), never laid out like its input
    aten.new_empty_strided.default: new_factory,
    **_batched_core_rules(),
    aten.unfold.default: unfold,
    aten.unfold_copy.default: unfold,
    aten.unfold_backward.default: unfold_backward,
    aten.diag_embed.default: diag_embed,
    aten.expand_copy.default: as_op(aten.expand.default, expand),
    aten.view_copy.default: as_op(aten.view.default, view),
    aten._prelu_kernel.default: pointwise,
    aten._prelu_kernel_backward.default: pointwise_multi,
    aten.masked_scatter.default: masked_scatter_scalar,
    aten.masked_scatter_backward.default: masked_scatter_backward_scalar,
    aten.resize_as.default: resize_as_same,
    aten._trilinear.default: trilinear,
    aten.norm.ScalarOpt_dim: norm_dim,
    aten.renorm.default: renorm,
    aten._chunk_cat.default: chunk_cat,
}
RULES.update({op: rule for op, rule in _OPINFO_RULES.items() if op not in RULES})  # ours never replace others'


# ---------------------------------------------------------------- issue 14 point 1, "opinfo90": over the shard
# extrema (all_reduce_extrema), gathers/scatters by global row (localize_indices), statistics (globalize_statistics)


def as_strided(node: torch.fx.Node, pl: PlacementOf) -> RuleResult | None:
    """as_strided(x, size, stride, offset) / as_strided_scatter / as_strided_copy: they address the input's memory
    with explicit strides, which mean nothing on a shard. Capture rewrites the ones that are reshapes (a contiguous
    input read row-major: ``compiler/strided_views.py``); what is left runs only on replicated inputs (None:
    every rank computes the same value).

    Raises:
        UnsupportedOpError: a sharded or partial input; names the op, its size and strides and what to write."""
    if all(isinstance(pl(a), Replicate) for _, a in tensor_args(node)):
        return None
    names = ("size", "stride", "storage_offset") if node.target is not aten.as_strided_scatter.default else (
        "", "size", "stride", "storage_offset")
    view = ", ".join(f"{n} {_arg(node, i + 1, n)}" for i, n in enumerate(names) if n)
    err = unsupported(node, pl, f"it reads its input's memory with explicit strides ({view}), which mean nothing on "
                      "a shard; adaptdist turns it into a reshape only where it is one (a contiguous input read in "
                      "row-major order), and this one is not. Write the view with view/reshape/permute/transpose/"
                      "unfold/narrow, which keep the batch rows apart")
    err.no_strategy = True  # the replicate fallback may run it whole
    raise err


_WHOLE_EXTREMA = (aten.max.default, aten.min.default, aten.all.default, aten.any.default)  # over every dim


def extremum(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """(opinfo90) amax/amin(x, dims, keepdim), max/min(x) (all dims), all/any(x[, dims, keepdim]) (a min/max of
    bools): over the sharded dim each rank reduces its own rows and the output is replicated once the
    ``all_reduce_extrema`` pass all-reduces it (max/min) right after the op; otherwise as :func:`reduction` (a
    Partial input is reduced first)."""
    x = node.args[0]
    p = pl(x)
    nd = len(shape(x))
    whole = node.target in _WHOLE_EXTREMA
    dims = list(range(nd)) if whole else _norm_dims(_arg(node, 1, "dim", None), nd)
    if isinstance(p, Shard) and p.dim in dims:
        return RuleResult(R)
    if whole:
        return RuleResult(R, {} if isinstance(p, Replicate) else {(0,): R})
    return reduction(node, pl)


def whole_reduction(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """(opinfo90) trace(x), dist(a, b, p) (a scalar from every element), diagonal_scatter(x, src, offset, ..) of
    a matrix (a batch of them: DTensor's strategies): replicated inputs give a replicated value, others are
    gathered (the ``globalize_statistics`` pass first rewrites a sharded one into sums, or a masked ``where``)."""
    return gather_all(node, pl, "it reduces every element") if any(
        not isinstance(pl(a), Replicate) for _, a in tensor_args(node)) else RuleResult(R)


def scatter_reduce_other_dim(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """(opinfo90) scatter_reduce(x, dim, index, src, reduce) sharded on another dim: as :func:`gather_scatter`
    where x, index and src have the same size there (their shards then hold the same slices); else gathered."""
    d = next((p.dim for _, a in tensor_args(node) for p in [pl(a)] if isinstance(p, Shard)), None)
    if d is not None and len({shape(a)[d] if d < len(shape(a)) else -1 for _, a in tensor_args(node)}) != 1:
        return gather_all(node, pl, "its index is smaller than its input on the sharded dim")
    return gather_scatter(node, pl)


def index_along_shard(fallback: Callable | None) -> Callable[[torch.fx.Node, PlacementOf], RuleResult | None]:
    """(opinfo90) gather(x, dim, index) and scatter/scatter_add/scatter_reduce(x, dim, index, src) with ``x``
    sharded on ``dim`` itself and ``index`` replicated: each rank reads / writes the rows it holds (the
    ``localize_indices`` pass shifts the indices by the rank's first row and masks the others): a scatter keeps
    the shard (``src`` replicated: every rank sees every update and keeps those landing in its rows), a gather
    gives a Partial sum (the rows another rank holds read 0). Other forms: ``fallback`` (None: DTensor's)."""
    def rule(node: torch.fx.Node, pl: PlacementOf) -> RuleResult | None:
        self_, dim, index = node.args[:3]
        nd = max(len(shape(self_)), 1)
        ps = pl(self_)
        if isinstance(ps, Shard) and ps.dim == dim % nd and isinstance(pl(index), Replicate) and len(shape(index)) == nd:
            if node.target == aten.gather.default:
                return RuleResult(P)
            src = node.args[3] if len(node.args) > 3 else None
            needs = {(3,): R} if isinstance(src, torch.fx.Node) and not isinstance(pl(src), Replicate) else {}
            return RuleResult(Shard(dim % nd), needs)
        return fallback(node, pl) if fallback is not None else None

    return rule


def weight_norm_backward(node: torch.fx.Node, pl: PlacementOf) -> RuleResult | None:
    """``_weight_norm_interface_backward(grad_w, v, g, norms, dim) -> (grad_v, grad_g)``: for fixed ``v``, ``g``
    and ``norms`` both outputs are linear in ``grad_w`` (``grad_g = sum(grad_w * v) / norms`` over the dims other
    than ``dim``; ``grad_v = g / norms * (grad_w - v * grad_g / norms)``: Salimans & Kingma 2016, eq. 3), so a
    Partial ``grad_w`` (data parallelism's weight gradient) with the rest replicated gives Partial gradients,
    reduced with the others (HF Wav2Vec2's positional convolution). Other forms: DTensor's, else refused."""
    pw, *rest = (pl(a) for a in node.args[:4])
    dim = _weight_norm_kept_dim(node)
    if dim is not None and all(isinstance(p, Shard) and p.dim == dim for p in (pw, *rest)):
        return RuleResult((pw, pw))  # each rank's slices of the kept dim are whole norms: local
    if isinstance(pw, Partial):
        # linear in grad_w for fixed v, g, norms: those gathered (FSDP's gathered weight), grad_w left Partial
        return RuleResult((pw, pw), {(i,): R for i, p in enumerate(rest, start=1) if not isinstance(p, Replicate)})
    return None


def _weight_norm_kept_dim(node: torch.fx.Node) -> int | None:
    """The dim ``_weight_norm_interface[_backward]`` keeps (its norm is over every other dim); None for ``dim=-1``
    (torch's norm over every dim: ``norm_except_dim``)."""
    dim = _arg(node, 2 if node.target == aten._weight_norm_interface.default else 4, "dim", 0)
    return dim if isinstance(dim, int) and dim >= 0 else None


def weight_norm_forward(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """``_weight_norm_interface(v, g, dim) -> (w, norms)``, ``w = g * v / norms``, ``norms`` = the 2-norm of ``v``
    over every dim but ``dim`` (Salimans & Kingma 2016, eq. 2): ``v`` sharded on the kept ``dim`` holds whole norms,
    so it is local (``g`` sliced alike; outputs ``Shard(dim)``); replicated inputs give replicated outputs; ``v``
    sharded on a normed dim (FSDP's dim 0 of a conv's ``weight_norm(dim=2)``) is gathered first, as FSDP gathers
    every weight before its use (:func:`gather_all`)."""
    v, g = node.args[:2]
    pv, pg = pl(v), pl(g)
    dim = _weight_norm_kept_dim(node)
    if dim is not None and isinstance(pv, Shard) and pv.dim == dim and not isinstance(pg, Partial) \
            and shape(g)[dim] == shape(v)[dim]:
        return RuleResult((pv, pv), {} if pg == pv else {(1,): pv})
    if isinstance(pv, Replicate) and isinstance(pg, Replicate):
        return RuleResult((R, R))
    return gather_all(node, pl, "its input is sharded across the norm's reduced dims")


def diagonal_scatter_matrix(node: torch.fx.Node, pl: PlacementOf) -> RuleResult | None:
    """(opinfo90) diagonal_scatter of one matrix: :func:`whole_reduction`; of a batch of them: DTensor's."""
    return whole_reduction(node, pl) if len(shape(node.args[0])) == 2 else None


# (opinfo90) these replace the earlier entries for gather/scatter*/amax/amin (which they call for the other forms)
RULES[aten._weight_norm_interface_backward.default] = weight_norm_backward
RULES[aten._weight_norm_interface.default] = weight_norm_forward
RULES.update({
    aten.gather.default: index_along_shard(RULES[aten.gather.default]),
    aten.scatter.src: index_along_shard(RULES[aten.scatter.src]),
    aten.scatter.value: index_along_shard(RULES[aten.scatter.value]),
    aten.scatter_add.default: index_along_shard(RULES[aten.scatter_add.default]),
    aten.scatter_reduce.two: index_along_shard(RULES.get(aten.scatter_reduce.two, scatter_reduce_other_dim)),
    aten.trace.default: whole_reduction,
    aten.dist.default: whole_reduction,
    aten.diagonal_scatter.default: diagonal_scatter_matrix,
    aten.amax.default: extremum,
    aten.amin.default: extremum,
    aten.max.default: extremum,
    aten.min.default: extremum,
    aten.as_strided.default: as_strided,
    aten.as_strided_scatter.default: as_strided,
    aten.as_strided_copy.default: as_strided,
    # all/any (one_hot's check of its labels, `assert (y >= 0).all()`): a min/max of bools (issue 14)
    aten.all.default: extremum,
    aten.all.dim: extremum,
    aten.all.dims: extremum,
    aten.any.default: extremum,
    aten.any.dim: extremum,
    aten.any.dims: extremum,
})


# ---------------------------------------------------------------- DTensor's strategies, after ours


def _ours(p) -> Placement | None:
    """A DTensor placement as ours (None for placements adaptdist has no word for, e.g. Partial(max))."""
    if p is None:
        return None
    name = type(p).__name__
    if name == "Replicate":
        return R
    if name == "Shard":
        return Shard(p.dim)
    if name == "Partial" and p.reduce_op in ("sum", "avg"):
        return Partial(p.reduce_op)
    return None


def dtensor_node_strategies(node: torch.fx.Node, mesh_size: int) -> list[Strategy] | None:
    """DTensor's strategies for ``node`` along one mesh axis of ``mesh_size`` ranks, in our placements
    (through :func:`adaptdist._torch_compat.dtensor_strategies`); the all-replicated one first where
    DTensor leaves it implicit. None when DTensor has none for this op and these arguments."""
    def v(a):
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a

    if any("val" not in a.meta for _, a in tensor_args(node)):
        return None  # a subgraph argument (torch.cond's branches): not DTensor's (control_flow is the rule)
    args = torch.fx.node.map_arg(node.args, v)
    kwargs = torch.fx.node.map_arg(node.kwargs, v)
    rows = compat.dtensor_strategies(node.target, args, kwargs, mesh_size)
    n_in = len(tensor_args(node))
    if not rows or any(len(ins) != n_in for _, ins in rows):
        return None  # no strategy, or one that leaves its inputs unstated: use our rule
    out = []
    for outs, ins in rows:
        o, i = tuple(_ours(p) for p in outs), tuple(_ours(p) for p in ins)
        if any(p is None for p, q in zip(o + i, list(outs) + list(ins)) if q is not None):
            continue  # a placement we do not lower (Partial(max), strided shards)
        out.append(Strategy(i, o, "dtensor"))
    n_out = len(out[0].outputs) if out else 1
    if out and not any(all(isinstance(p, Replicate) or p is None for p in s.inputs + s.outputs) for s in out):
        val = gmeta.val(node)
        outs = tuple(None if isinstance(val, (tuple, list)) and not isinstance(val[k], torch.Tensor) else R
                     for k in range(n_out))
        out.insert(0, Strategy((R,) * n_in, outs, "dtensor"))  # DTensor adds all-replicate implicitly
    return out or None


def _reshard_bytes(src: Placement, dst: Placement, nbytes: int, n: int) -> float | None:
    """Bytes one rank receives to turn ``src`` into ``dst`` over ``n`` ranks (None: impossible, nothing
    turns a value into a partial sum); a ranking only, the planner has the real costs."""
    if src == dst or (isinstance(src, Replicate) and isinstance(dst, Shard)):
        return 0.0  # nothing / a local slice
    if isinstance(dst, Partial):
        return None
    if isinstance(src, Shard):
        return nbytes * (n - 1) / n * (1 if isinstance(dst, Replicate) else 1 / n)
    return nbytes * (n - 1) / n * (2 if isinstance(dst, Replicate) else 1)  # Partial: all_reduce / reduce_scatter


def dtensor_choice(node: torch.fx.Node, pl: PlacementOf, mesh_size: int) -> RuleResult | None:
    """The DTensor strategy for ``node`` that moves the fewest bytes from the placements its inputs have
    (ties: the one whose outputs stay sharded, then DTensor's order), as a rule result; None when DTensor
    has no strategy for it. An op that keeps samples apart (``topk`` on the last dim, an index by
    per-sample positions) keeps a batch shard this way; one that mixes them gathers or moves the shard."""
    strategies = dtensor_node_strategies(node, mesh_size)
    if not strategies:
        return None
    args = tensor_args(node)
    val = gmeta.val(node)
    outs_val = list(val) if isinstance(val, (tuple, list)) else [val]

    def too_small(p: Placement | None, v: Any) -> bool:  # a shard some rank would hold nothing of
        return isinstance(p, Shard) and isinstance(v, torch.Tensor) and (p.dim >= v.dim() or v.shape[p.dim] < mesh_size)

    best = None
    for k, s in enumerate(strategies):
        if any(too_small(p, v) for p, v in zip(s.outputs, outs_val)):
            continue
        if isinstance(val, (tuple, list)) and len(s.outputs) != len(outs_val):
            continue  # a strategy stating fewer outputs than the op has (linalg_qr's)
        needs: dict[ArgPath, Placement] = {}
        cost = 0.0
        for (path, a), want in zip(args, s.inputs):
            have = pl(a)
            if want is None or want == have:
                continue
            if too_small(want, gmeta.val(a)):
                break
            v = gmeta.val(a)
            nbytes = v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0
            c = _reshard_bytes(have, want, nbytes, mesh_size)
            if c is None:
                break
            needs[path] = want
            cost += c
        else:
            outs = tuple(R if p is None else p for p in s.outputs)
            key = (cost, sum(not isinstance(p, Shard) for p in outs), k)
            if best is None or key < best[0]:
                best = (key, RuleResult(outs if len(outs) > 1 or isinstance(gmeta.val(node), (tuple, list))
                                        else outs[0], needs))
    return best[1] if best else None


def rule_for(node: torch.fx.Node) -> Callable[[torch.fx.Node, PlacementOf], RuleResult] | None:
    """The rule for ``node``'s op: the table, then pointwise ops by torch's ``pointwise`` tag."""
    import operator

    if node.target is operator.getitem:
        return getitem
    rule = RULES.get(node.target)
    if rule is not None:
        return rule
    tags = getattr(node.target, "tags", ())
    if torch.Tag.pointwise in tags:
        return pointwise_multi if isinstance(gmeta.val(node), (tuple, list)) else pointwise  # frexp: 2 outputs
    return None


def call_rule(rule: Callable, node: torch.fx.Node, pl: PlacementOf, mesh_size: int | None) -> RuleResult | None:
    """``rule(node, pl)``, with ``mesh_size`` for the rules whose answer depends on how many ranks share the
    axis (``takes_mesh_size``: a view splitting a shard into groups)."""
    if getattr(rule, "takes_mesh_size", False):
        return rule(node, pl, mesh_size=mesh_size)
    return rule(node, pl)


def apply_rule(node: torch.fx.Node, pl: PlacementOf, mesh_size: int = 2) -> RuleResult:
    """Placement of ``node``'s output(s) along one mesh axis of ``mesh_size`` ranks given its inputs'.

    The sources, in order (the same ones :mod:`.list_strategies` offers the planner, so every plan
    lowers what the automatic one does): our rule for the op; DTensor's strategies for it
    (:func:`dtensor_choice`) where we have no rule or ours leaves this form to DTensor (returns None);
    ops with neither are fine while all their tensor inputs are replicated (then every rank computes
    the same value).

    Raises:
        UnsupportedOpError: neither source has a strategy and some input is sharded or partial.
    """
    if not tensor_args(node):
        # made from Python values alone, e.g. ``_to_copy(0.5, dtype=f32)`` for a scalar in the model's
        # arithmetic: the same on every rank
        v = gmeta.val(node)
        return RuleResult(tuple(R for _ in v) if isinstance(v, (tuple, list)) else R)
    rule = rule_for(node)
    if rule is not None:
        res = call_rule(rule, node, pl, mesh_size)
        if res is not None:
            return res
    ins = [pl(a) for _, a in tensor_args(node)]
    if all(isinstance(p, Replicate) for p in ins):
        v = gmeta.val(node)
        return RuleResult(tuple(R for _ in v) if isinstance(v, (tuple, list)) else R)
    res = dtensor_choice(node, pl, mesh_size)
    if res is not None:
        return res
    err = unsupported(node, pl, "no sharding rule is registered for this op, and DTensor has no strategy for it")
    err.no_strategy = True  # (opinfo2) a rule of ours that leaves this form to DTensor: the replicate fallback may run it
    raise err


def control_flow(node: torch.fx.Node, pl: PlacementOf) -> RuleResult:
    """``torch.cond`` (and the other control-flow higher-order ops: ``while_loop``, ``scan``, ``map``): their bodies
    are subgraphs (``get_attr`` nodes) that adaptdist does not shard inside. With every tensor input replicated
    (a predicate and operands computed from parameters alone) every rank runs the op as one process does; with a
    sharded or partial input the op is refused, and the replicate fallback (``err.no_strategy``) gathers its inputs
    (the predicate as well: every rank then takes the branch one process would take on the whole batch) and runs it
    whole on every rank.

    Raises:
        UnsupportedOpError: some tensor input is sharded or partial; names the op and what to do.
    """
    ins = [pl(a) for _, a in tensor_args(node) if a.op != "get_attr"]
    if all(isinstance(p, Replicate) for p in ins):
        v = gmeta.val(node)
        return RuleResult(tuple(R for _ in v) if isinstance(v, (tuple, list)) else R)
    name = getattr(node.target, "__name__", str(node.target))
    err = unsupported(node, pl, f"torch.{name} runs subgraphs (its branches or body), which adaptdist does not shard "
                                "inside, on inputs split over the ranks. Compute both branches and select with "
                                "torch.where(pred, a, b) so that every op gets its own rule (as one process would "
                                "compute it)")
    err.no_strategy = True  # the replicate fallback may run it whole
    raise err


RULES.update({op: control_flow for op in (getattr(torch.ops.higher_order, n, None)
                                           for n in ("cond", "while_loop", "scan", "map_impl")) if op is not None})
