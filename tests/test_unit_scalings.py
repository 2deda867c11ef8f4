"""compiler/unit_scalings.py: ``x * 1`` (vmap's addmm rule writes ``beta * bias``) folded into ``x`` at the backend's
capture; other multiplications left alone."""

from __future__ import annotations

import torch
import torch.fx

from adaptdist.compiler.unit_scalings import fold_unit_scalings
from adaptdist._torch_compat import fake_tensor_mode

aten = torch.ops.aten


def _graph(build):
    """A graph from ``build(graph, x_float, i_int)`` with fake ``val``s (x: f32[4, 3], i: i64[4]); returns gm."""
    g = torch.fx.Graph()
    x, i = g.placeholder("x"), g.placeholder("i")
    with fake_tensor_mode(allow_constants=True) as mode:
        x.meta["val"] = torch.empty(4, 3)
        i.meta["val"] = torch.empty(4, dtype=torch.long)
        outs = build(g, x, i)
        for n in g.nodes:
            if n.op == "call_function":
                n.meta["val"] = n.target(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in n.args])
    g.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_mul_by_one_is_folded_bit_for_bit():
    def build(g, x, i):
        a = g.call_function(aten.mul.Scalar, (x, 1))
        b = g.call_function(aten.mul.Tensor, (x, 1.0))
        return [g.call_function(aten.add.Tensor, (a, b))]

    gm = _graph(build)
    x = torch.tensor([[1.5, -0.0, float("inf")], [float("nan"), 3e-39, -2.0], [0.0, 1e38, -1e-7], [7.0, 8.0, 9.0]])
    want = gm(x, torch.zeros(4, dtype=torch.long))[0]
    assert fold_unit_scalings(gm) == 2
    assert not [n for n in gm.graph.nodes if n.target in (aten.mul.Scalar, aten.mul.Tensor)]
    add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    assert [a.name for a in add.args] == ["x", "x"]
    torch.testing.assert_close(gm(x, torch.zeros(4, dtype=torch.long))[0], want, rtol=0, atol=0, equal_nan=True)


def test_other_multiplications_are_left_alone():
    def build(g, x, i):
        return [g.call_function(aten.mul.Scalar, (x, 2)),          # not 1
                g.call_function(aten.mul.Tensor, (i, 1.0)),        # i64 * 1.0 -> f32: a type promotion
                g.call_function(aten.mul.Scalar, (x, True)),       # a bool, not the number 1
                g.call_function(aten.mul.Tensor, (x, x)),          # no scalar
                g.call_function(aten.mul.Scalar, (x, 1))]          # returned as it is: a copy of the input, kept

    gm = _graph(build)
    assert fold_unit_scalings(gm) == 0
    assert len([n for n in gm.graph.nodes if n.op == "call_function"]) == 5
