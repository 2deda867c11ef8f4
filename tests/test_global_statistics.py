"""Statistics, norms, diagonals and extrema over the split batch without gathering it (passes
``globalize_statistics`` and ``all_reduce_extrema``, issue 14 point 1 "opinfo90"): equal to eager (loss,
gradients, parameters after SGD steps) on 2 and 3 ranks (3: a rank holding none of the 4 rows), ties of a max
split as eager splits them, and no all_gather; the same programs on gloo (with a scatter by global row)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from adaptdist.compiler.lowering import compile_model
from adaptdist.placement import Shard
from adaptdist.runtime.simulate import simulate_ranks
from passutil import collective_nodes, simulated_sgd
from reference import eager_sgd

LR, STEPS, TOL = 0.05, 2, 1e-5


class _Stats(nn.Module):
    """Reductions over the batch dim of the hidden rows: var/std (unbiased, over dim 0 and over everything),
    var_mean, amax/amin over dim 0, max/min of everything, vector norms (2, 3, inf, 1), dist, trace and
    diagonal of the square [4, 4] hidden, renorm by slices along dim 1."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, x):
        h = self.lin(x)  # [4, 4]
        v, m = torch.var_mean(h, 0)
        out = h.var(0).sum() + h.std() + v.sum() * m.sum() + torch.amax(h, 0).sum() - torch.amin(h, 0).sum()
        out = out + h.max() * h.min() + torch.linalg.vector_norm(h) + torch.linalg.vector_norm(h, 3, dim=0).sum()
        out = out + torch.linalg.vector_norm(h, float("inf")) + h.norm(1) + torch.dist(h, 2 * h.detach())
        out = out + torch.trace(h) + torch.diagonal(h).pow(2).sum() + torch.renorm(h, 2, 1, 1.0).sum()
        return out


class _Ties(nn.Module):
    """``y = x[:, :3] * p + x[:, 3:] * q`` with rows 0 and 2 giving the same maximum (on different ranks):
    eager's amax / max give each of the tied rows half of the gradient (so ``p`` and ``q`` get half each)."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.ones(3))
        self.q = nn.Parameter(torch.ones(3))

    def forward(self, x):
        y = x[:, :3] * self.p + x[:, 3:] * self.q
        return torch.amax(y, 0).sum() + y.max() + y.norm(float("inf"))


class _Diagonals(nn.Module):
    """Diagonals of the square [4, 4] hidden, split by rows: offsets 0 (aligned with the rows), 1 and -2 (not:
    a Partial sum), of the transposed dims, diagonal_scatter of a parameter, diag_embed of a split vector."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.d = nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = self.lin(x)  # [4, 4]
        out = torch.diagonal(h).pow(2).sum() + torch.diagonal(h, 1).pow(2).sum() + torch.diagonal(h, -2).exp().sum()
        out = out + torch.diagonal(h, 1, 1, 0).pow(3).sum()
        out = out + torch.diagonal_scatter(h, self.d, 1).pow(2).sum() + torch.diag_embed(h[:, 0]).pow(2).sum()
        return out


class _Bools(nn.Module):
    """all/any over the split rows (a min/max of bools; ``F.one_hot`` checks its labels so): the ``all`` is False
    only from row 3's first column and the ``any`` True only from row 0's second, which lie on different ranks;
    per column (all.dim, any.dim with keepdim) and over a list of dims (all.dims)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, x):
        h = self.lin(x)
        ok, some = (x[:, 0] > -1.5).all(), (x[:, 1] > 1.0).any()
        cols = (x > 0).all(0).float().sum() + (x > 0).any(dim=0, keepdim=True).float().sum()
        return (h.pow(2).sum() * torch.where(ok, 2.0, 3.0) + h.sum() * torch.where(some, 1.0, -1.0) + cols
                + h.mean() * (x > -3).all(dim=(0, 1)).float())


def _loss(out, target):
    return out + 0.0 * target.sum()


def _stats_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    return _Stats(), (torch.randn(4, 3, generator=g), torch.zeros(4)), _loss


def _diagonals_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    return _Diagonals(), (torch.randn(4, 3, generator=g), torch.zeros(4)), _loss


def _bools_case(seed=0):
    x = torch.tensor([[0.5, 2.0, 0.1], [0.2, 0.3, -0.4], [1.0, -0.1, 0.3], [-2.0, 0.4, 0.2]])
    torch.manual_seed(seed)
    return _Bools(), (x, torch.zeros(4)), _loss


def _ties_case(seed=0):
    x = torch.tensor([[1.0, 1, 1, 0, 0, 0], [0.1, 0.2, 0.3, 0, 0, 0], [0, 0, 0, 1, 1, 1], [0.3, 0.2, 0.1, 0, 0, 0]])
    torch.manual_seed(seed)
    return _Ties(), (x, torch.zeros(4)), _loss


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", [_stats_case, _ties_case, _diagonals_case, _bools_case])
def test_equal_eager_without_gathering_the_batch(case, world):
    model, batch, loss_fn = case()
    progs, hist, params, _ = simulated_sgd(model, batch, loss_fn, world, "dp", LR, STEPS)
    assert progs[0].batch_slice[1] == 2  # the batch is split
    for p in progs.values():
        assert not collective_nodes(p.graph_module, "all_gather"), "a rank gathers the batch"
        assert collective_nodes(p.graph_module, "all_reduce")
    want_hist, want_params = eager_sgd(model, [batch], loss_fn, LR, STEPS)
    for (loss, grads), (want_loss, want_grads) in zip(hist, want_hist):
        assert loss == pytest.approx(want_loss, rel=TOL, abs=TOL)
        for f, g in want_grads.items():
            torch.testing.assert_close(grads[f], g, atol=TOL, rtol=TOL, msg=f"grad {f}")
    for f, p in want_params.items():
        torch.testing.assert_close(params[f], p, atol=TOL, rtol=TOL, msg=f"param {f}")


def test_ties_split_evenly_like_eager():
    model, batch, loss_fn = _ties_case()
    loss = loss_fn(model(*batch[:-1]), batch[-1])
    loss.backward()
    assert torch.equal(model.p.grad, model.q.grad)  # what the lowered step must reproduce (test above)


def test_passes_leave_other_reductions_alone():
    """A max over a dim that is not sharded keeps the shard and needs no all_reduce of its own; the
    rewritten ops disappear only where their input is sharded on a reduced dim."""
    from passutil import lowered_until

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 4)

        def forward(self, x):
            h = self.lin(x)
            return torch.amax(h, 1).sum() + h.var(1).sum()

    g = torch.Generator().manual_seed(0)
    factory = (M(), (torch.randn(4, 3, generator=g), torch.zeros(4)), _loss)
    _, gm, _ = lowered_until(factory, 2, stop_before="bucket_grad_allreduce")
    from adaptdist.passes.infra import placement_of

    targets = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.var.correction in targets  # over dim 1: not rewritten
    assert placement_of(targets[torch.ops.aten.amax.default]) == Shard(0)
    assert not collective_nodes(gm, "all_gather")
    assert all(n.args[1] == "sum" for n in collective_nodes(gm, "all_reduce"))  # the loss's, no max


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_on_gloo_equal_eager(tmp_path):
    """The same programs on 2 gloo processes (all_reduce max/min/sum), and a scatter_reduce / gather by global
    row (localize_indices: per-rank index offsets): losses, gradients and parameters."""
    from adaptdist.program import save_programs
    from adaptdist.runtime.launch import launch_local
    from dist_workers import multi_case_sgd_worker
    from test_localize_indices import _Indexed

    def indexed_case():
        torch.manual_seed(0)
        return _Indexed("amax"), (torch.randn(4, 3), torch.zeros(4)), _loss

    prepared, cases = [], []
    for name, case in (("stats", _stats_case), ("ties", _ties_case), ("diagonals", _diagonals_case),
                       ("indexed", indexed_case)):
        model, batch, loss_fn = case()
        programs = compile_model(model, batch, loss_fn, 2, None)
        save_programs(programs, tmp_path / name)
        cases.append((str(tmp_path / name), [batch], None))
        prepared.append((name, model, batch, loss_fn, programs))
    results = launch_local(multi_case_sgd_worker, (cases, LR, STEPS), 2)
    for i, (name, model, batch, loss_fn, programs) in enumerate(prepared):
        history, final = eager_sgd(model, [batch], loss_fn, LR, STEPS)
        for r in range(2):
            res = results[r][i]
            for s, (loss, grads) in enumerate(history):
                assert res["losses"][s] == pytest.approx(loss, rel=TOL, abs=TOL), (name, r, s)
                for f, g in res["grads"][s].items():
                    torch.testing.assert_close(g, grads[f], atol=TOL, rtol=TOL, msg=f"{name}: rank {r} grad {f}")
            for f, p in res["params"].items():
                torch.testing.assert_close(p, final[f], atol=TOL, rtol=TOL, msg=f"{name}: rank {r} param {f}")


def test_simulator_reduces_min_and_max():
    import torch.fx

    from adaptdist import _torch_compat as compat

    def prog(op):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        ar = g.call_function(compat.functional_all_reduce_op(), (x, op, "adaptdist:dp"))
        g.output(g.call_function(compat.functional_wait_op(), (ar,)))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    a, b = torch.tensor([1.0, 5.0]), torch.tensor([3.0, 2.0])
    for op, want in (("max", torch.tensor([3.0, 5.0])), ("min", torch.tensor([1.0, 2.0]))):
        outs = simulate_ranks([prog(op), prog(op)], [[a], [b]])
        for o in outs:
            torch.testing.assert_close(o, want)
