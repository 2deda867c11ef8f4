"""decompose_addmm: addmm / baddbmm split into mm + add (bmm + add) only when parameters are sharded."""

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.passes.decompose_addmm import decompose_addmm
from adaptdist.placement import Shard
from models import mlp
from passutil import assert_untouched, apply_pass, captured_with_ctx, check_mesh_against_eager

aten = torch.ops.aten


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def test_sharded_parameters_split_every_addmm_and_keep_the_numbers():
    model, batch, loss_fn = mlp(7)
    cg, gm, ctx = captured_with_ctx((model, batch, loss_fn), 2)
    before = {t: _count(gm, t) for t in (aten.addmm.default, aten.mm.default, aten.add.Tensor)}
    assert before[aten.addmm.default] == 2  # fc1 and fc2
    inputs = [dict(model.named_parameters())[f].detach() for f in cg.input_fqns] + list(batch)
    want = gm(*inputs)
    ctx = dataclasses.replace(ctx, param_placements={"fc2.weight": Shard(1)})
    gm, changed = apply_pass(decompose_addmm, gm, ctx)
    assert changed
    assert _count(gm, aten.addmm.default) == 0
    assert _count(gm, aten.mm.default) == before[aten.mm.default] + 2
    assert _count(gm, aten.add.Tensor) == before[aten.add.Tensor] + 2
    for n in gm.graph.nodes:  # every new add has its fake value: shape of the old addmm
        if n.op == "call_function" and n.target == aten.add.Tensor and n.args[0].target == aten.mm.default:
            assert tuple(n.meta["val"].shape) == tuple(n.args[0].meta["val"].shape)
    got = gm(*inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_baddbmm_becomes_bmm_plus_add():
    class Batched(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 4, 5))
            self.b = nn.Parameter(torch.randn(3, 1, 5))

        def forward(self, x):
            return torch.baddbmm(self.b, x.transpose(0, 1), self.w).transpose(0, 1)

    torch.manual_seed(0)
    model = Batched()
    batch = (torch.randn(6, 3, 4), torch.randn(6, 3, 5))
    cg, gm, ctx = captured_with_ctx((model, batch, F.mse_loss), 2)
    bmms = _count(gm, aten.bmm.default)
    assert _count(gm, aten.baddbmm.default) == 1
    inputs = [dict(model.named_parameters())[f].detach() for f in cg.input_fqns] + list(batch)
    want = gm(*inputs)
    ctx = dataclasses.replace(ctx, param_placements={"w": Shard(1)})
    gm, changed = apply_pass(decompose_addmm, gm, ctx)
    assert changed and _count(gm, aten.baddbmm.default) == 0 and _count(gm, aten.bmm.default) == bmms + 1
    for g, w in zip(gm(*inputs), want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_untouched_without_sharded_parameters_or_with_one_rank():
    model, batch, loss_fn = mlp(7)
    for world, placements in ((2, {}), (1, {"fc2.weight": Shard(1)})):
        cg, gm, ctx = captured_with_ctx((model, batch, loss_fn), world)
        ctx = dataclasses.replace(ctx, param_placements=placements)
        gm = assert_untouched(decompose_addmm, gm, ctx)
        assert _count(gm, aten.addmm.default) == 2


def test_row_parallel_bias_is_added_once_after_the_partial_sum():
    """fc2 row-parallel: without the split every rank would add fc2.bias to its partial product."""
    model, batch, loss_fn = mlp(7)
    progs = check_mesh_against_eager(model, batch, loss_fn, "tp=2", _row_parallel_plan())
    p0 = progs[0].graph_module
    assert _count(p0, aten.addmm.default) < 2  # fc2's addmm was split (fc1 may keep its fused op)
    assert any("all_reduce" in c for c in progs[0].collectives())


def _row_parallel_plan():
    from adaptdist.annotations import ManualPlan

    return ManualPlan(name="row", mesh_axes=("tp",), batch_axis=None, params=(("fc2.weight", ("S(1)",)),))
