"""adaptdist/compiler/strided_views.py: the ``as_strided`` ops that are reshapes (``nn.AdaptiveAvgPool1d``'s output
and the backward's view replay, as in Hugging Face Swin's pooler) are folded at capture, so a batch split lowers
them as views: equal to eager on 2 and 3 ranks, no gather of the batch. Any other ``as_strided`` on a sharded
input is refused by name (issue 14)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.annotations import ManualPlan
from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import compile_model
from adaptdist.compiler.strided_views import _is_row_major, row_major_strides
from adaptdist.errors import UnsupportedOpError
from passutil import collective_nodes, simulated_sgd
from reference import eager_sgd

LR, STEPS, TOL = 0.1, 2, 1e-5


class _Pooled(nn.Module):
    """Tokens ``[B, T, 6]`` -> linear -> mean over T by ``AdaptiveAvgPool1d(1)`` on ``[B, 8, T]`` -> head."""

    def __init__(self):
        super().__init__()
        self.lin, self.pool, self.head = nn.Linear(6, 8), nn.AdaptiveAvgPool1d(1), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.flatten(self.pool(self.lin(x).transpose(1, 2)), 1))


def _pooled(seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    return _Pooled(), (torch.randn(4, 5, 6, generator=g), torch.randint(0, 3, (4,), generator=g)), F.cross_entropy


def test_row_major_strides_ignore_size_one_dims():
    assert row_major_strides([4, 16, 1, 1]) == [16, 1, 1, 1]
    assert _is_row_major([4, 16, 1, 1], [16, 1, 16, 16]) and _is_row_major([4, 16], [16, 1])
    assert not _is_row_major([4, 2], [4, 2]) and not _is_row_major([4, 16], [1, 4])


def test_capture_folds_the_pool_and_its_backward_into_reshapes():
    cg = capture(*_pooled())
    targets = [n.target for n in cg.gm.graph.nodes]
    assert not [t for t in targets if "as_strided" in str(t)], targets
    assert torch.ops.aten.reshape.default in targets


@pytest.mark.parametrize("world", [2, 3])
def test_pool_under_a_batch_split_equals_eager_without_gathering(world):
    model, batch, loss_fn = _pooled()
    progs, hist, params, _ = simulated_sgd(model, batch, loss_fn, world, "dp", LR, STEPS)
    for p in progs.values():
        assert not collective_nodes(p.graph_module, "all_gather"), "a rank gathers the batch"
    want_hist, want_params = eager_sgd(model, [batch], loss_fn, LR, STEPS)
    for (loss, grads), (want_loss, want_grads) in zip(hist, want_hist):
        assert loss == pytest.approx(want_loss, rel=TOL, abs=TOL)
        for f, g in want_grads.items():
            torch.testing.assert_close(grads[f], g, atol=TOL, rtol=TOL, msg=f"grad {f}")
    for f, p in want_params.items():
        torch.testing.assert_close(params[f], p, atol=TOL, rtol=TOL, msg=f"param {f}")


class _EveryOtherColumn(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).as_strided((4, 2), (4, 2)).sum(1)  # columns 0 and 2: not a reshape


def test_other_as_strided_on_a_sharded_input_is_refused_by_name():
    torch.manual_seed(0)
    batch = (torch.randn(4, 4), torch.randn(4))
    with pytest.raises(UnsupportedOpError, match=r"(?s)aten.as_strided.default at node 'as_strided'.*explicit strides "
                                                 r"\(size \[4, 2\], stride \[4, 2\].*view/reshape/permute"):
        compile_model(_EveryOtherColumn(), batch, F.mse_loss, 2, ManualPlan.parse("dp"))
