"""Pass: turn the global graph into one rank's local graph.

Sharded dims carry global sizes in shape arguments (``view``, ``expand``,
``new_zeros`` ...). For rank ``r``, each such size becomes the rank's own:
with the batch split by ``torch.chunk`` into local sizes ``b_r``, a sharded
dim of global size ``G`` (a multiple of the global batch ``B``, e.g. ``B*T``)
has local size ``G // B * b_r``. Rank slices inserted by redistribution get
this rank's bounds. Finally the local graph is re-run on fake inputs of local
shapes, which refreshes ``node.meta["val"]`` and checks every op.

Before/after (global batch 5 on 2 ranks, rank 1 holds 2 rows, T = 4)::

    view = aten.view(x, [20, 64])        # x: f32[5, 4, 64] S(0)
    # rank 1:
    view = aten.view(x, [8, 64])         # x: f32[2, 4, 64]
"""

from __future__ import annotations

import torch
import torch.fx

from .. import _torch_compat as compat
from .. import graph_meta as gmeta
from ..errors import UnsupportedOpError
from ..placement import Shard
from .context import PassContext
from .propagate_placements import placement_of

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
}

# Ops taking the batch size as an int argument: op -> arg position.
_BATCH_INT_ARG = {
    aten.native_group_norm.default: 3,
    aten.native_group_norm_backward.default: 5,
}


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A structural copy of ``gm`` whose nodes keep (shallow copies of) their meta."""
    g = torch.fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    g.output_node().meta.update(gm.graph.output_node().meta)
    new = torch.fx.GraphModule(gm, g)
    return new


def localize_shapes(gm: torch.fx.GraphModule, ctx: PassContext, rank: int) -> tuple[torch.fx.GraphModule, bool]:
    """Return a new GraphModule for ``rank`` with local shapes; ``gm`` is left untouched.

    Raises:
        UnsupportedOpError: a sharded dim's size is not a multiple of the batch
            size, or an op fails on the rank's local shapes (names the node).
    """
    B = ctx.batch_size
    b_r = ctx.shard_sizes()[rank]
    off_r = ctx.shard_offsets()[rank]
    local = copy_graph_module(gm)
    changed = False

    def local_size(node: torch.fx.Node, g: int) -> int:
        if B == 0 or g % B:
            raise UnsupportedOpError(
                f"node {node.name!r} ({node.target}, {gmeta.shape_str(node)}): its sharded dim has size {g}, "
                f"not a multiple of the global batch size {B}, so it cannot be split like the batch"
            )
        return g // B * b_r

    for node in local.graph.nodes:
        if node.op != "call_function":
            continue
        rs = gmeta.get_rank_slice(node)
        if rs is not None:
            dim, _axis = rs
            g = node.args[0].meta["val"].shape[dim]
            local_size(node, g)  # checks divisibility
            start = g // B * off_r
            node.args = (node.args[0], dim, start, start + local_size(node, g))
            changed = True
            continue
        if node.target in _BATCH_INT_ARG and isinstance(placement_of(node)[0], Shard):
            pos = _BATCH_INT_ARG[node.target]
            node.args = node.args[:pos] + (local_size(node, node.args[pos]),) + node.args[pos + 1:]
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
            size[p.dim] = local_size(node, size[p.dim])
            node.args = node.args[:pos] + (size,) + node.args[pos + 1:]
            changed = True
    local.recompile()
    _refresh_vals(local, ctx, rank)
    return local, changed


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


def _refresh_vals(gm: torch.fx.GraphModule, ctx: PassContext, rank: int) -> None:
    mode = compat.fake_tensor_mode(allow_constants=True)  # get_attr constants are real tensors
    b_r = ctx.shard_sizes()[rank]
    inputs = []
    for ph in gm.graph.find_nodes(op="placeholder"):
        v = ph.meta["val"]
        shape = list(v.shape)
        if isinstance(placement_of(ph), Shard):
            shape[placement_of(ph).dim] = b_r
        with mode:
            inputs.append(torch.empty(shape, dtype=v.dtype))
    with mode:
        _FakeProp(gm).run(*inputs)
