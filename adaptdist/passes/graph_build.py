"""Small helpers passes use to add nodes that keep the pass invariants (a fake ``val``, placements)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx

from .. import graph_meta as gmeta
from .._torch_compat import tree_leaves


def set_fake_val(node: torch.fx.Node) -> None:
    """Fill ``node.meta["val"]`` by running its op on its inputs' fake values (in their FakeTensorMode)."""

    def v(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a

    args = torch.fx.node.map_arg(node.args, v)
    kwargs = torch.fx.node.map_arg(node.kwargs, v)
    fake = next((a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)), None)
    mode = getattr(fake, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["val"] = node.target(*args, **kwargs)


def add_op(graph: torch.fx.Graph, target: Any, args: tuple, placement: Any, *, kwargs: dict | None = None,
           collective: str | None = None, group: str | None = None) -> torch.fx.Node:
    """Add ``target(*args, **kwargs)`` at the graph's insertion point with its fake value, its
    placement on the mesh axis, and (optionally) a collective mark for mesh-axis group ``group``
    (see graph_meta)."""
    node = graph.call_function(target, tuple(args), kwargs or {})
    set_fake_val(node)
    gmeta.set_placements(node, (placement,))
    if collective:
        assert group is not None, "a collective mark needs its group"
        gmeta.mark_collective(node, collective, group)
    return node
