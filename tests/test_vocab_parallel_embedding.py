"""The vocab_parallel_embedding pass: a lookup in a table sharded by vocabulary, all ranks simulated."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from test_tensor_parallel import _check


def test_embedding_sharded_by_vocabulary_with_padding_idx():
    """11 rows over 2 ranks (6 + 5), padding_idx=8: every other token's gradient survives."""

    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(11, 4, padding_idx=8)

        def forward(self, idx):
            return self.emb(idx).sum(1)

    batch = (torch.tensor([[0, 8, 10], [5, 6, 8], [1, 2, 3]]), torch.randn(3, 4))
    progs = _check(Emb(), batch, F.mse_loss, 2, {"emb.weight": "S(0)"})
    assert [p.state["emb.weight"].shape[0] for p in progs.values()] == [6, 5]
    # vocabulary-parallel: a masked local lookup and one all_reduce of its output; the table is never gathered
    colls = progs[0].collectives()
    assert len(colls) == 1 and "all_reduce" in colls[0] and colls[0].endswith(f", {3 * 4})"), colls
    assert "embedding_dense_backward" in progs[1].code and "masked_fill" in progs[1].code
