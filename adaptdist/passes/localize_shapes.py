"""Pass: turn the global graph into one rank's local graph.

Sharded dims carry global sizes in shape arguments (``view``, ``expand``,
``new_zeros`` ...). For rank ``r`` every sharded value gets its interval
``[start, end)`` of the sharded dim (``torch.chunk`` semantics at the inputs -- batch inputs take
the plan's uneven rows instead when ``ctx.batch_rows`` gives them --
rescaled by views that merge or split that dim), and each such size becomes
``end - start``; rank slices inserted by redistribution get the interval of the
operand they align with. Finally the local graph is re-run on fake inputs of
local shapes, which refreshes ``node.meta["val"]`` and checks every op.

Before/after (global batch 5 on 2 ranks, rank 1 holds 2 rows, T = 4)::

    view = aten.view(x, [20, 64])        # x: f32[5, 4, 64] S(0)
    # rank 1:
    view = aten.view(x, [8, 64])         # x: f32[2, 4, 64]
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx

from .. import _torch_compat as compat
from .. import graph_meta as gmeta
from ..errors import UnsupportedOpError
from ..fx_constants import constant_value
from ..placement import Shard, chunk_interval
from .infra import copy_graph_module, padded_numel
from .sharding_rules import tensor_args
from .context import PassContext
from .infra import placement_of

aten = torch.ops.aten

_SHAPE_ARG = {
    aten.view.default: 1,
    aten._unsafe_view.default: 1,
    aten.reshape.default: 1,
    aten.expand.default: 1,
    aten.new_zeros.default: 1,
    aten.new_ones.default: 1,
    aten.new_empty.default: 1,
    aten.new_full.default: 1,
    aten.zeros.default: 0,
    aten.ones.default: 0,
    aten.empty.memory_format: 0,
    aten.full.default: 0,
    aten.slice_backward.default: 1,
    aten.select_backward.default: 1,
    aten.expand_copy.default: 1,  # (opinfo2)
    aten.view_copy.default: 1,  # (opinfo2)
    aten.unfold_backward.default: 1,  # (opinfo2)
    aten.masked_scatter_backward.default: 2,  # (opinfo2)
}

# Ops taking the batch size as an int argument: op -> arg position.
_BATCH_INT_ARG = {
    aten.native_group_norm.default: 3,
    aten.native_group_norm_backward.default: 5,
}


def localize_shapes(gm: torch.fx.GraphModule, ctx: PassContext, rank: int) -> tuple[torch.fx.GraphModule, bool]:
    """Return a new GraphModule for ``rank`` with local shapes; ``gm`` is left untouched.

    Every sharded value carries this rank's interval ``[start, end)`` of its sharded
    dim, in global indices: placeholders get their ``torch.chunk`` interval, ops pass
    their input's interval on (views rescale it when they merge or split the sharded
    dim), rank slices take the interval of the sharded operand they are aligned with.
    Shape arguments then become ``end - start`` on the sharded dim.

    Raises:
        UnsupportedOpError: a view splits a shard at a point that is not a multiple of
            the inner size, sharded operands disagree, or an op fails on the local
            shapes (names the node).
    """
    local = copy_graph_module(gm)
    intervals = _intervals(local, ctx, rank)
    largest = _largest_intervals(local, ctx, rank, intervals)
    changed = False
    for node in local.graph.nodes:
        if node.op != "call_function":
            continue
        pads = gmeta.get_coalesced(node, ctx.group_name)
        if pads is not None:
            by_name = {n.name: n for n in local.graph.nodes}
            sizes = []
            for name in pads:
                pad = by_name[name]
                s0, e0 = largest[pad]
                sizes.append(padded_numel(pad, e0 - s0))
            node.args = (node.args[0], sizes, node.args[2])
            changed = True
            continue
        pad_dim = gmeta.get_gather_pad(node, ctx.group_name)
        if pad_dim is not None:
            (s, e), (s0, e0) = intervals[node], largest[node]
            nd = node.meta["val"].dim()
            pad = [0, 0] * nd
            pad[2 * (nd - 1 - pad_dim) + 1] = (e0 - s0) - (e - s)
            node.args = (node.args[0], pad, node.args[2])
            changed = True
            continue
        rs_dim = gmeta.get_rank_slice(node, ctx.group_name)
        if rs_dim is not None:
            s, e = intervals[node]
            if _rows_alike(node.args[0], rs_dim) or _constant_rows_alike(node.args[0], rs_dim):
                # every row the same: any rows do, and one program serves all ranks (and microbatches)
                s, e = 0, e - s
            node.args = (node.args[0], rs_dim, s, e)
            changed = True
            continue
        vocab = gmeta.get_vocab_bounds(node, ctx.group_name)
        if vocab is not None:
            kind, table = vocab
            s, e = intervals[_nodes_by_name(local)[table]]
            if kind == "start":
                node.args = (node.args[0], s)
            elif kind == "rows":
                node.args = (node.args[0], e - s)
            else:  # embedding_dense_backward(grad, indices, num_weights, padding_idx, scale)
                pad = node.args[3]
                local_pad = pad - s if pad is not None and s <= pad < e else -1
                node.args = (node.args[0], node.args[1], e - s, local_pad, *node.args[4:])
            changed = True
            continue
        if gmeta.get_rank0_flag(node, ctx.group_name):  # "local" BatchNorm: rank 0's running statistics
            node.args = (node.args[0], 1.0 if rank == 0 else 0.0)
            changed = True
            continue
        trim = gmeta.get_scatter_trim(node, ctx.group_name)
        if trim is not None:
            s, e = intervals[node]
            node.args = (node.args[0], trim[0], 0, e - s)
            changed = True
            continue
        if node.target in _BATCH_INT_ARG and isinstance(placement_of(node)[0], Shard):
            pos = _BATCH_INT_ARG[node.target]
            s, e = intervals[node][0]
            node.args = node.args[:pos] + (e - s,) + node.args[pos + 1:]
            changed = True
            continue
        pos = _SHAPE_ARG.get(node.target)
        if pos is None:
            continue
        p = placement_of(node)
        if not isinstance(p, Shard):
            continue
        size = list(node.args[pos])
        if size[p.dim] != -1:
            s, e = intervals[node]
            size[p.dim] = e - s
            gv = node.meta.get("val")  # (opinfo2) global: a -1 elsewhere is ambiguous on a rank holding no rows
            if e == s and isinstance(gv, torch.Tensor) and gv.dim() == len(size):
                size = [int(gv.shape[k]) if v == -1 and k != p.dim else v for k, v in enumerate(size)]
            node.args = node.args[:pos] + (size,) + node.args[pos + 1:]
            changed = True
    local.recompile()
    _refresh_vals(local, intervals)
    return local, changed


Interval = tuple[int, int]


def _largest_intervals(gm: torch.fx.GraphModule, ctx: PassContext, rank: int, mine: dict) -> dict:
    """Each value's interval on the rank holding the most of it (what padded gathers pad to): rank 0's under
    torch.chunk; with uneven batch rows (``ctx.batch_rows``) the longest over every rank, node by node."""
    if ctx.batch_rows is None:
        return mine if rank == 0 else _intervals(gm, ctx, 0)
    per_rank = [mine if r == rank else _intervals(gm, ctx, r) for r in range(ctx.axis_size)]

    def length(iv: Any) -> int:
        return iv[1] - iv[0] if isinstance(iv, tuple) and len(iv) == 2 and isinstance(iv[0], int) else -1

    for node in mine:
        if gmeta.get_gather_pad(node, ctx.group_name) is None:
            continue
        # a padded gather keeps the first n rows of the concatenated blocks padded to the longest: right only
        # when every pad comes after all the data (lengths M, ..., M, m <= M, 0, ..., 0), as torch.chunk's are
        got = [ivs.get(node) for ivs in per_rank]
        lengths = [length(iv) if iv is not None else 0 for iv in got]
        top = max(lengths)
        short = next((k for k, n in enumerate(lengths) if n < top), len(lengths))
        if any(n != 0 for n in lengths[short + 1:]):
            raise UnsupportedOpError(
                f"node {node.name!r} gathers a value split over the batch by the uneven rows {list(ctx.batch_rows)} "
                f"(ranks' rows {[iv for iv in got]}); a gather of uneven blocks is not supported yet: split the batch "
                "evenly (--batch-split even) or use a plan that keeps the batch split through the step")
    return {node: max((ivs[node] for ivs in per_rank if node in ivs), key=length) for node in mine}


def _nodes_by_name(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def _intervals(gm: torch.fx.GraphModule, ctx: PassContext, rank: int) -> dict[torch.fx.Node, Any]:
    """This rank's interval of the sharded dim of every sharded value (tuples for multi-output ops)."""
    ivs: dict[torch.fx.Node, Any] = {}
    for node in gm.graph.nodes:
        p = placement_of(node) if node.op != "output" else None
        if not _has_shard(p):
            continue
        if node.op == "placeholder":
            if gmeta.get_role(node) == "batch":
                off, size = ctx.shard_offsets()[rank], ctx.shard_sizes()[rank]
                ivs[node] = (off, off + size)
            else:
                ivs[node] = chunk_interval(node.meta["val"].shape[p.dim], ctx.axis_size, rank)
        elif _in_reduce_scatter(node, ctx.group_name):
            continue  # a padded block, consumed only by the trim below
        elif gmeta.get_scatter_trim(node, ctx.group_name) is not None:
            ivs[node] = chunk_interval(gmeta.get_scatter_trim(node, ctx.group_name)[1], ctx.axis_size, rank)
        elif gmeta.get_vocab_bounds(node, ctx.group_name) is not None:
            ivs[node] = ivs[_nodes_by_name(gm)[gmeta.get_vocab_bounds(node, ctx.group_name)[1]]]  # the table's rows
        elif gmeta.get_rank_slice(node, ctx.group_name) is not None:
            ivs[node] = _aligned_interval(node, ivs, ctx, rank)
        elif node.target is operator.getitem:
            src = ivs[node.args[0]]
            ivs[node] = src[node.args[1]] if isinstance(src, tuple) and isinstance(src[0], tuple) else src
        else:
            ivs[node] = _op_interval(node, p, ivs, ctx)
    return ivs


def _in_reduce_scatter(node: torch.fx.Node, group: str) -> bool:
    kind = gmeta.get_collective(node, group)
    return kind == "reduce_scatter" or (kind == "wait" and gmeta.get_collective(node.args[0], group) == "reduce_scatter")


def _has_shard(p: Any) -> bool:
    if isinstance(p, tuple):
        return any(isinstance(q, Shard) for q in p)
    return isinstance(p, Shard)


def _first_interval(node: torch.fx.Node, ivs: dict) -> tuple[torch.fx.Node, Interval]:
    found = [(a, ivs[a]) for _, a in tensor_args(node) if a in ivs and isinstance(placement_of(a), Shard)]
    if not found:
        raise AssertionError(f"sharded node {node.name} has no sharded input")
    for a, iv in found[1:]:
        if iv != found[0][1] and shape_at(a) == shape_at(found[0][0]):
            raise UnsupportedOpError(
                f"node {node.name!r} ({node.target}) combines shards that cover different rows on this rank: "
                f"{found[0][0].name} {found[0][1]} vs {a.name} {iv}"
            )
    return found[0]


def shape_at(a: torch.fx.Node) -> int:
    p = placement_of(a)
    return a.meta["val"].shape[p.dim]


def _op_interval(node: torch.fx.Node, p: Any, ivs: dict, ctx: PassContext | None = None) -> Any:
    src, (s, e) = _first_interval(node, ivs)
    if isinstance(p, tuple):
        # each output takes the interval of a sharded input of the same size on that dim
        # (attention backward: grad_k has the key's heads, not the query's)
        sharded = [(shape_at(a), ivs[a]) for _, a in tensor_args(node) if a in ivs and isinstance(placement_of(a), Shard)]
        out = []
        for q, v in zip(p, node.meta["val"]):
            if not isinstance(q, Shard) or not isinstance(v, torch.Tensor):
                out.append(None if not isinstance(q, Shard) else (s, e))
                continue
            size = v.shape[q.dim]
            out.append(next((iv for n, iv in sharded if n == size), (s, e)))
        return tuple(out)
    if node.target in _VIEWS:
        n_in, n_out = shape_at(src), node.meta["val"].shape[p.dim]
        if n_out >= n_in:
            k = n_out // max(n_in, 1)
            return (s * k, e * k)
        k = n_in // n_out
        if s % k or e % k:
            raise UnsupportedOpError(
                f"view node {node.name!r}{gmeta.where_of(node)} "
                f"splits a sharded dim of size {n_in} into {n_out} groups of {k} ({gmeta.shape_str(src)} -> "
                f"{gmeta.shape_str(node)}), but this rank's shard [{s}, {e}) does not hold whole groups. "
                + _whole_groups_advice(n_out, ctx, _shard_source(src, ivs)))
        return (s // k, e // k)
    return (s, e)


def _shard_source(node: torch.fx.Node, ivs: dict) -> torch.fx.Node | None:
    """The placeholder (a parameter or a batch input) whose shard ``node``'s interval comes from: the chain of
    first sharded inputs :func:`_first_interval` follows; None when it starts elsewhere (a rank slice)."""
    cur = node
    for _ in range(100_000):
        if cur.op == "placeholder":
            return cur
        nxt = next((a for _, a in tensor_args(cur) if a in ivs and isinstance(placement_of(a), Shard)), None)
        if nxt is None:
            return None
        cur = nxt
    return None


def _whole_groups_advice(groups: int, ctx: PassContext | None, source: torch.fx.Node | None = None) -> str:
    """What to try when a rank's shard does not hold whole groups of a view (``groups`` of them), by what
    sharded the dim (``source``, see :func:`_shard_source`): a parameter on the axis that splits the batch (fsdp's
    dim-0 shards used in place) names the parameter and the ways out; a shard of unknown source (a reduce-scatter,
    a local slice) on that axis says so; on a model axis (tensor parallelism: the groups are attention heads) a
    number of ranks dividing the heads, or a plan that does not shard them; the batch (a batch input), where the
    groups are rows, the batch size too."""
    axis = f"mesh axis {ctx.mesh_axis!r} ({ctx.axis_size} ranks)" if ctx is not None else "the mesh axis"
    fits = [d for d in range(2, groups + 1) if groups % d == 0]
    use = f"use {' or '.join(map(str, fits))} ranks there" if fits else f"no number of ranks above 1 divides {groups}"
    if source is not None and gmeta.get_role(source) != "batch" and gmeta.get_fqn(source):
        fqn, p = gmeta.get_fqn(source), placement_of(source)
        how = ("the plan shards it on the axis that also splits the batch (fsdp), and this step uses its shard in "
               "place" if ctx is not None and ctx.shard_batch else "the plan shards it there")
        return (f"The dim comes from parameter {fqn!r} ({gmeta.shape_str(source)}), placed {p!r} on {axis}: {how}. "
                f"Its {groups} groups must split whole over the ranks: {use}; or keep {fqn!r} replicated on that "
                f"axis (a plan file's params: R there), or --plan dp. Please report it too: the planner should "
                f"have gathered it before this view")
    if source is None and ctx is not None and ctx.shard_batch:
        return (f"The plan sharded this dim on {axis} (the axis that splits the batch) by a redistribution (a "
                f"reduce-scatter or a local slice), not by splitting the batch; its {groups} groups must split whole "
                f"over the ranks: {use}, or --plan dp. Please report it too: the planner should have gathered it "
                "before this view")
    if ctx is not None and ctx.shard_batch:
        return (f"{axis} splits the batch: each rank's rows must be whole groups; choose a batch size and a number of "
                f"ranks that split it into whole groups, or another plan")
    return (f"With tensor parallelism over attention heads the number of ranks on {axis} must divide the number "
            f"of heads ({groups} here)"
            + (f": use {' or '.join(map(str, fits))} ranks there" if fits else "")
            + ", or a plan that does not shard the heads (e.g. --plan dp or fsdp)")


_FILLS = {aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default,
          aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format,
          aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
          aten.scalar_tensor.default}


_ELEMENTWISE = {aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor,
                aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.neg.default, aten.rsub.Scalar,
                aten.rsub.Tensor,
                # masks built from positions (Hugging Face's causal and padding masks): comparisons, logic, where
                aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.masked_fill.Scalar,
                aten.masked_fill.Tensor, aten.lt.Tensor, aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar,
                aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar, aten.eq.Tensor, aten.eq.Scalar,
                aten.ne.Tensor, aten.ne.Scalar, aten.logical_and.default, aten.logical_or.default,
                aten.logical_not.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_not.default,
                aten.minimum.default, aten.maximum.default}


def _constant_rows_alike(x: Any, dim: int) -> bool:
    """Whether ``x``, a value computed from no input, parameter or random draw (Hugging Face's causal and
    packed-sequence masks, built from positions and expanded over the batch), holds the same values at every index
    along ``dim``: computed once on CPU (:func:`~adaptdist.fx_constants.constant_value`) and compared (the
    structural :func:`_rows_alike` cannot follow ``index``/``cumsum`` chains). The result is cached on the node."""
    if not isinstance(x, torch.fx.Node):
        return False
    cache = x.meta.setdefault("adaptdist_constant_rows_alike", {})
    if dim not in cache:
        t = constant_value(x)
        cache[dim] = (t is not None and t.dim() > dim and t.shape[dim] > 0
                      and torch.equal(t, t.narrow(dim, 0, 1).expand_as(t)))
    return cache[dim]


def _rows_alike(x: Any, dim: int, depth: int = 8) -> bool:
    """Whether every index of ``x`` along ``dim`` holds the same values, from how ``x`` is made: a constant fill,
    or an expand of a size-1 (or absent) dim (the backward of a sum/mean), through clones and dtype copies, and
    through elementwise ops (arithmetic, comparisons, logic, ``where``) whose other operands are numbers or
    broadcast along ``dim`` (the backward of a mean: that expand divided by the row count; a mask built from
    positions), through a ``repeat`` of a size-1 (or new leading) dim, and through an embedding or a
    one-index ``table[idx]`` of such indices (positions repeated over the batch: Whisper's decoder). Then
    a rank slice of ``x`` along ``dim`` may take rows [0, n) on every rank (the pipeline's microbatches run one
    program: their slices must not depend on the microbatch's offset)."""
    if not isinstance(x, torch.fx.Node) or x.op != "call_function" or depth == 0:
        return False
    if x.target in _FILLS:
        return True
    if x.target in (aten.expand.default, aten.expand_copy.default):
        src = x.args[0]
        v = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        if not isinstance(v, torch.Tensor):
            return False
        lead = x.meta["val"].dim() - v.dim()
        return dim < lead or v.shape[dim - lead] == 1 or _rows_alike(src, dim - lead, depth - 1)
    if x.target in (aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default):
        return _rows_alike(x.args[0], dim, depth - 1)
    if x.target is aten.embedding.default:  # [*indices, D]: a row of indices' dims is a row of the output
        idx = x.args[1]
        v = idx.meta.get("val") if isinstance(idx, torch.fx.Node) else None
        return (isinstance(v, torch.Tensor) and dim < v.dim()
                and (_rows_alike(idx, dim, depth - 1) or _constant_rows_alike(idx, dim)))
    if x.target is aten.index.Tensor:  # table[idx] (Whisper's decoder positions): [*idx, *table.shape[1:]]
        indices = x.args[1]
        if len(indices) != 1 or not isinstance(indices[0], torch.fx.Node):
            return False
        v = indices[0].meta.get("val")
        return (isinstance(v, torch.Tensor) and dim < v.dim()
                and (_rows_alike(indices[0], dim, depth - 1) or _constant_rows_alike(indices[0], dim)))
    if x.target is aten.repeat.default:  # src.repeat(reps): leading new dims repeat src whole
        src, reps = x.args[0], x.args[1]
        v = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        if not isinstance(v, torch.Tensor):
            return False
        lead = len(reps) - v.dim()
        return dim < lead or v.shape[dim - lead] == 1 or _rows_alike(src, dim - lead, depth - 1)
    if x.target in _ELEMENTWISE:
        out_rank = x.meta["val"].dim()
        tensors = [a for a in x.args if isinstance(a, torch.fx.Node)]
        for a in tensors:
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor):
                return False
            lead = out_rank - v.dim()  # broadcasting aligns trailing dims
            if not (dim < lead or v.shape[dim - lead] == 1 or _rows_alike(a, dim - lead, depth - 1)):
                return False
        return bool(tensors)
    return False


def _aligned_interval(node: torch.fx.Node, ivs: dict, ctx: PassContext, rank: int) -> Interval:
    """A rank slice takes the interval of the sharded operand its consumer combines it with."""
    dim = gmeta.get_rank_slice(node, ctx.group_name)
    size = node.args[0].meta["val"].shape[dim]
    align = gmeta.get_rank_slice_align(node, ctx.group_name)
    if align is not None:  # a global draw of a random op keeps the rows of the op's input (passes/global_rng.py)
        other = _nodes_by_name(node.graph.owning_module).get(align)
        if other is not None and other in ivs:
            return ivs[other]
    # look through the contiguous copy redistribution puts after a slice of a non-leading dim
    mine = {node} | {u for u in node.users if u.target is aten.clone.default}
    for user in [c for m in mine for c in m.users]:
        for _, a in tensor_args(user):
            if a not in mine and a in ivs and isinstance(placement_of(a), Shard) and shape_at(a) == size:
                return ivs[a]
    return chunk_interval(size, ctx.axis_size, rank)


_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default}


class _FakeProp(torch.fx.Interpreter):
    def run_node(self, n: torch.fx.Node):
        try:
            result = super().run_node(n)
        except UnsupportedOpError:
            raise
        except Exception as e:
            raise UnsupportedOpError(
                f"node {n.name!r} ({n.target}) fails on the local shapes of this rank: {type(e).__name__}: "
                f"{str(e).splitlines()[0]}"
            ) from e
        n.meta["val"] = result
        return result


def _refresh_vals(gm: torch.fx.GraphModule, intervals: dict) -> None:
    mode = compat.fake_tensor_mode(allow_constants=True)  # get_attr constants are real tensors
    inputs = []
    for ph in gm.graph.find_nodes(op="placeholder"):
        v = ph.meta["val"]
        shape = list(v.shape)
        if isinstance(placement_of(ph), Shard):
            s, e = intervals[ph]
            shape[placement_of(ph).dim] = e - s
        with mode:
            inputs.append(torch.empty(shape, dtype=v.dtype))
    # a local shape that does not work is reported as UnsupportedOpError below; torch's fake-tensor
    # logger would print its own traceback first
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with mode:
            _FakeProp(gm).run(*inputs)
    finally:
        quiet.setLevel(level)
