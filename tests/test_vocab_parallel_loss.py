"""The vocab_parallel_loss pass: cross entropy over logits sharded by class, all ranks simulated."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from test_tensor_parallel import _check


@pytest.mark.parametrize("reduction,ignore_index", [("mean", 5), ("sum", -100), ("mean", -100)])
@pytest.mark.parametrize("world", [2, 3])
def test_vocabulary_parallel_cross_entropy(reduction, ignore_index, world):
    """Logits sharded by class (11 classes: 6+5 or 4+4+3 columns) meet the loss without being gathered;
    an ignore_index inside some rank's columns (5) is ignored everywhere, and the mean divides by
    the global count of kept targets."""
    torch.manual_seed(0)
    model = nn.Linear(8, 11)
    x = torch.randn(7, 8)
    y = torch.tensor([0, 5, 10, 5, 3, 7, 4])

    def loss_fn(out, t):
        return F.cross_entropy(out, t, reduction=reduction, ignore_index=ignore_index)

    progs = _check(model, (x, y), loss_fn, world, {"weight": "S(0)", "bias": "S(0)"})
    colls = progs[0].collectives()
    assert not any("all_gather" in c for c in colls), colls
    assert "nll_loss_forward" in progs[0].code and "masked_fill" in progs[0].code
