"""Fold multiplications by the scalar 1 out of a captured joint graph (at the backend's all-ranks capture).

``torch.vmap``'s batching rule for ``addmm`` (every biased ``nn.Linear`` on a batched input, under the
backend's capture of all ranks at once) computes ``beta * bias + mm(...)`` with ``beta = 1``: the bias reaches
its ``add`` through ``aten.mul.Scalar(bias, 1)``, and its gradient leaves through another. ``x * 1`` is ``x``
bit for bit (IEEE 754: exact for every finite value, infinities, zeros with their sign; NaN stays NaN), but it
hides the parameter from the lowering: under a sharded plan (fsdp) the all_gather of such a bias reads the
``mul``, not the parameter, and ``passes/bucket_param_allgather`` buckets only gathers of parameters, so each
bias was gathered on its own. TransformerEncoderLayer(64, 4, batch_first) x2 + a head under fsdp on 2 ranks:
10 all_gathers per step, 8 of them one bias each, where ``adaptdist train`` (no vmap) has 2 bucketed ones.

A ``mul.Scalar`` / ``mul.Tensor`` node by the Python number 1 whose output has the dtype, shape and strides of
its input is replaced by its input. Anything else (a multiplication by a tensor holding 1, a type promotion:
``int_tensor * 1.0``) is left alone.

Before/after (a vmapped ``nn.Linear(64, 256)`` on 2 ranks' rows)::

    mul_4 = aten.mul.Scalar(bias, 1)                   # f32[256]
    add_4 = aten.add.Tensor(mul_4, _unsafe_view_11)    # f32[2, 64, 256]
    # becomes
    add_4 = aten.add.Tensor(bias, _unsafe_view_11)
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

_MULS = (aten.mul.Scalar, aten.mul.Tensor)


def _is_unit(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input ``x`` of ``node`` when ``node`` is ``x * 1`` with the output laid out as ``x``, else None."""
    if node.op != "call_function" or node.target not in _MULS or node.kwargs or len(node.args) != 2:
        return None
    x, s = node.args
    if not isinstance(x, torch.fx.Node) and isinstance(s, torch.fx.Node):
        x, s = s, x
    if not isinstance(x, torch.fx.Node) or isinstance(s, bool) or not isinstance(s, (int, float)) or s != 1:
        return None
    xv, ov = x.meta.get("val"), node.meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(ov, torch.Tensor):
        return None
    if xv.dtype != ov.dtype or tuple(xv.shape) != tuple(ov.shape) or tuple(xv.stride()) != tuple(ov.stride()):
        return None
    return x


def fold_unit_scalings(gm: torch.fx.GraphModule) -> int:
    """Replace every ``x * 1`` of ``gm`` (module docstring) by ``x``, in place; returns how many were folded
    (``gm`` is recompiled if any)."""
    folded = 0
    for node in list(gm.graph.nodes):
        x = _is_unit(node)
        if x is None or (x.op == "placeholder" and any(u.op == "output" for u in node.users)):
            continue  # (an input returned as it is: left as a copy)
        node.replace_all_uses_with(x)
        gm.graph.erase_node(node)
        folded += 1
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded
