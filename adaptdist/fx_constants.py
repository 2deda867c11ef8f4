"""The value of a graph node computed from no input: a constant a captured graph builds from positions
(``arange``, comparisons, ``cumsum``...), such as Hugging Face's causal masks and the ``torch.arange(batch)``
that its padding masks are indexed with. Evaluated once on CPU with real tensors; a node with any placeholder,
``get_attr``, random draw or non-ATen op in its ancestry has none."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

MAX_NUMEL = 1 << 22
"""The largest constant (in elements, each node of its ancestry) :func:`constant_value` computes."""


def constant_value(x: Any, max_numel: int = MAX_NUMEL) -> torch.Tensor | None:
    """The tensor node ``x`` computes when its whole ancestry is ATen ops of no input (no placeholder, no
    ``get_attr``, nothing drawing random numbers), each of at most ``max_numel`` elements; else None (also when
    an op fails to run on CPU here). Cost: one CPU evaluation of the ancestry per call."""
    if not isinstance(x, torch.fx.Node):
        return None
    order: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = set()
    stack = [x]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        v = n.meta.get("val")
        tags = getattr(n.target, "tags", None)  # ATen ops only (they carry tags), none that draws random numbers
        if (n.op != "call_function" or tags is None or torch.Tag.nondeterministic_seeded in tags
                or not isinstance(v, torch.Tensor) or v.numel() > max_numel):
            return None
        order.append(n)
        stack.extend(n.all_input_nodes)
    position = {n: i for i, n in enumerate(x.graph.nodes)}
    env: dict[torch.fx.Node, Any] = {}

    def on_cpu(a: Any) -> Any:
        return torch.device("cpu") if isinstance(a, torch.device) else a

    try:
        for n in sorted(order, key=position.__getitem__):
            args = torch.fx.node.map_arg(n.args, env.__getitem__)
            kwargs = {k: on_cpu(v) for k, v in torch.fx.node.map_arg(n.kwargs, env.__getitem__).items()}
            env[n] = n.target(*args, **kwargs)
    except Exception:  # an op that does not run on CPU here: no known value
        return None
    t = env[x]
    return t if isinstance(t, torch.Tensor) else None
