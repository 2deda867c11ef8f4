"""passes/gather_embedding_rows.py: under dp a large table's gradient is built from the batch's gathered rows
(replicated, out of the gradient bucket) instead of an all_reduce of the whole partial table; equal to eager
(loss, every gradient, the SGD-updated parameters) on simulated ranks, an uneven batch included; small tables,
or tables smaller than the batch's rows, keep the all_reduce."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.passes.gather_embedding_rows import MIN_TABLE_BYTES
from passutil import assert_sgd_equal, simulated_sgd
from reference import eager_sgd

LR, STEPS = 0.5, 2


class TwoTables(nn.Module):
    """A big table (above MIN_TABLE_BYTES: rows gathered), a small one (all-reduced) and a bag over the big one."""

    def __init__(self, big_rows: int = 1200, dim: int = 16):
        super().__init__()
        self.big = nn.Embedding(big_rows, dim)
        self.small = nn.Embedding(10, dim)
        self.fc = nn.Linear(2 * dim, 1)

    def forward(self, a, b):
        return self.fc(torch.cat([self.big(a), self.small(b)], dim=1)).squeeze(1)


def _batch(batch_size: int, big_rows: int = 1200):
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, big_rows, (batch_size,), generator=g), torch.randint(0, 10, (batch_size,), generator=g),
            torch.randn(batch_size, generator=g))


@pytest.mark.parametrize("batch_size,world", [(8, 2), (7, 3)])
def test_big_table_gathers_rows_and_equals_eager(batch_size, world):
    torch.manual_seed(0)
    model = TwoTables()
    assert model.big.weight.numel() * 4 >= MIN_TABLE_BYTES > model.small.weight.numel() * 4
    batch = _batch(batch_size)
    progs, hist, params, _ = simulated_sgd(model, batch, F.mse_loss, world, "dp", LR, STEPS)
    want_hist, want_params = eager_sgd(model, [batch], F.mse_loss, LR, STEPS)
    assert_sgd_equal(hist, params, want_hist, want_params)
    colls = progs[0].collectives()
    gathers = [c for c in colls if "all_gather" in c]
    assert len(gathers) == 1, colls  # the big table's gradient rows and its indices, in one (bucket_gathered_rows)
    reduced = sum(int(c.rsplit(", ", 1)[1].rstrip(")")) for c in colls if "all_reduce" in c)
    assert reduced < model.big.weight.numel(), colls  # the big table is not in any all_reduce


def test_pass_off_keeps_the_dense_all_reduce():
    torch.manual_seed(0)
    model = TwoTables()
    batch = _batch(8)
    progs, *_ = simulated_sgd(model, batch, F.mse_loss, 2, "dp", LR, 1, disabled_passes=("gather_embedding_rows",))
    colls = progs[0].collectives()
    assert not any("all_gather" in c for c in colls)
    assert sum(int(c.rsplit(", ", 1)[1].rstrip(")")) for c in colls) > model.big.weight.numel()


def test_a_batch_larger_than_the_table_keeps_the_all_reduce():
    """1200 rows x 16, batch 1500 ids: gathering the rows would move more than the table."""
    torch.manual_seed(0)
    model = TwoTables()
    batch = _batch(1500)
    progs, *_ = simulated_sgd(model, batch, F.mse_loss, 2, "dp", LR, 1)
    assert not any("all_gather" in c for c in progs[0].collectives())


class Tied(nn.Module):
    """A table tied to the output head: its gradient is the lookup's plus the head's, so it stays all-reduced."""

    def __init__(self, vocab: int = 1200, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.emb(x))


def test_a_tied_table_keeps_the_all_reduce_and_equals_eager():
    torch.manual_seed(0)
    model = Tied()
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 1200, (8,), generator=g), torch.randint(0, 1200, (8,), generator=g))
    progs, hist, params, _ = simulated_sgd(model, batch, F.cross_entropy, 2, "dp", LR, STEPS)
    assert not any("all_gather" in c for c in progs[0].collectives())
    want_hist, want_params = eager_sgd(model, [batch], F.cross_entropy, LR, STEPS)
    for (gl, _), (wl, _) in zip(hist, want_hist):
        assert abs(gl - wl) < 1e-5
    for f, p in want_params.items():
        torch.testing.assert_close(params[f], p, atol=1e-5, rtol=1e-5)


def test_the_planner_prices_the_gathered_rows_not_a_partial_table():
    """plan_auto on dp=2 never leaves the big table's gradient Partial over the split batch (the lowering would gather
    its rows instead, so an all_reduce of the table is not what runs): the big table's backward takes (R, R) -> R,
    its rows' gathers are priced (one bucketed all_gather: passes/bucket_gathered_rows.py); the small table keeps
    (S(0), S(0)) -> P, in the gradient bucket; dp=2 is predicted to move fewer bytes than the table's all_reduce."""
    from adaptdist.compiler.capture import capture
    from adaptdist.compiler.planner import plan_auto
    from adaptdist.cost_models.hardware import FixedCluster
    from adaptdist.mesh import Mesh
    from adaptdist.placement import Partial, Replicate, Shard

    torch.manual_seed(0)
    model = TwoTables()
    cg = capture(model, _batch(8), F.mse_loss)
    res = plan_auto(cg, FixedCluster.uniform([("h", 2)], "cpu"), mesh=Mesh.parse("dp=2"))
    nodes = cg.gm.graph.find_nodes(op="call_function", target=torch.ops.aten.embedding_dense_backward.default)
    edb = {int(n.args[2]): n.name for n in nodes}
    chosen = res.chosen["dp"]
    assert chosen[edb[1200]].outputs == (Replicate(),) and chosen[edb[1200]].inputs[:2] == (Replicate(), Replicate())
    assert chosen[edb[10]].outputs == (Partial(),)
    problem = res.axes["dp"].problem
    split = (Shard(0), Shard(0))
    assert not any(s.inputs[:2] == split and isinstance(s.outputs[0], Partial) for s in problem.strat_of[edb[1200]])
    assert any(s.inputs[:2] == split and isinstance(s.outputs[0], Partial) for s in problem.strat_of[edb[10]])
    assert "all_gather" in problem.buckets(res.axes["dp"].choice)
    moved = problem.communication_bytes(res.axes["dp"].choice)
    assert moved < model.big.weight.numel() * 4  # an all_reduce of the table alone moves 2 (n-1)/n of it


class BagTable(nn.Module):
    """builtin:dlrm's form: an EmbeddingBag over bags of one length (passes/embedding_bag.py rewrites it into an
    embedding, whose backward gather_embedding_rows then gathers)."""

    def __init__(self, rows: int = 1200, dim: int = 16):
        super().__init__()
        self.bag = nn.EmbeddingBag(rows, dim, mode="mean")
        self.fc = nn.Linear(dim, 1)

    def forward(self, a):
        return self.fc(self.bag(a)).squeeze(1)


def test_the_planner_prices_an_embedding_bag_backward_as_gathered_and_it_equals_eager():
    from adaptdist.compiler.capture import capture
    from adaptdist.compiler.planner import plan_auto
    from adaptdist.cost_models.hardware import FixedCluster
    from adaptdist.mesh import Mesh
    from adaptdist.placement import Replicate

    torch.manual_seed(0)
    model = BagTable()
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 1200, (8, 1), generator=g), torch.randn(8, generator=g))
    cg = capture(model, batch, F.mse_loss)
    res = plan_auto(cg, FixedCluster.uniform([("h", 2)], "cpu"), mesh=Mesh.parse("dp=2"))
    (bwd,) = cg.gm.graph.find_nodes(op="call_function", target=torch.ops.aten._embedding_bag_backward.default)
    assert res.chosen["dp"][bwd.name].outputs == (Replicate(),)
    progs, hist, params, _ = simulated_sgd(model, batch, F.mse_loss, 2, res.plan, LR, STEPS)
    # the lowering follows the planner's (R, ..., R): no all_reduce of the table. On this 8-row toy the planner also
    # runs the linear layer and the loss on the whole batch, so the program gathers three different tensors: the
    # bag's output and the target in forward, the ids in backward (not the offsets, nor one tensor three times)
    colls = progs[0].collectives()
    assert any("all_gather" in c for c in colls), colls
    assert sum(int(c.rsplit(", ", 1)[1].rstrip(")")) for c in colls if "all_reduce" in c) < 1200 * 16, colls
    want_hist, want_params = eager_sgd(model, [batch], F.mse_loss, LR, STEPS)
    for (gl, _), (wl, _) in zip(hist, want_hist):
        assert abs(gl - wl) < 1e-5
    for f, p in want_params.items():
        torch.testing.assert_close(params[f], p, atol=1e-5, rtol=1e-5)
