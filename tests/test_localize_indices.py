"""gather / scatter / scatter_add / scatter_reduce along the split batch dim with replicated indices, lowered by
each rank's own rows (sharding_rules.index_along_shard + the localize_indices pass, issue 14 point 1 "opinfo90"):
equal to eager (loss, gradients, parameters after SGD steps) on 2 and 3 ranks (3: a rank holding none of the 4
rows), without gathering the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from passutil import collective_nodes, simulated_sgd
from reference import eager_sgd

LR, STEPS, TOL = 0.05, 2, 1e-5


class _Indexed(nn.Module):
    """Rows of the batch read and written by global row index: ``many`` (a buffer) sends two updates to one row in
    every column and none to row 2 (reductions of several updates, untouched rows); ``once`` (for the plain
    scatter, whose winner among duplicates is unspecified) one per row and column."""

    def __init__(self, reduce: str):
        super().__init__()
        self.reduce = reduce
        self.lin = nn.Linear(3, 3)
        self.src = nn.Parameter(torch.randn(3, 3))
        self.register_buffer("many", torch.tensor([[0, 3, 1], [0, 3, 3], [1, 0, 3]]))
        self.register_buffer("once", torch.tensor([[0, 3, 1], [3, 0, 0], [1, 1, 3]]))

    def forward(self, x):
        h = self.lin(x)  # [4, 3], split by rows
        out = h.scatter_reduce(0, self.many, self.src, self.reduce, include_self=self.reduce != "mean")
        out = out + h.scatter_add(0, self.many, self.src).pow(2) + h.scatter(0, self.once, self.src * 2)
        return (out * out).sum() + (torch.gather(h, 0, self.many) * self.src).sum()


def _loss(out, target):
    return out + 0.0 * target.sum()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
def test_scatter_and_gather_by_global_row_equal_eager(reduce, world):
    torch.manual_seed(0)
    model = _Indexed(reduce)
    batch = (torch.randn(4, 3), torch.zeros(4))
    progs, hist, params, _ = simulated_sgd(model, batch, _loss, world, "dp", LR, STEPS)
    assert progs[0].batch_slice[1] == 2  # the batch is split
    for p in progs.values():
        assert not collective_nodes(p.graph_module, "all_gather"), "a rank gathers the batch"
    want_hist, want_params = eager_sgd(model, [batch], _loss, LR, STEPS)
    for (loss, grads), (want_loss, want_grads) in zip(hist, want_hist):
        assert loss == pytest.approx(want_loss, rel=TOL, abs=TOL)
        for f, g in want_grads.items():
            torch.testing.assert_close(grads[f], g, atol=TOL, rtol=TOL, msg=f"grad {f}")
    for f, p in want_params.items():
        torch.testing.assert_close(params[f], p, atol=TOL, rtol=TOL, msg=f"param {f}")
