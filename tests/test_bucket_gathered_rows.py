"""passes/bucket_gathered_rows.py: the rows and ids of every table gather_embedding_rows marked travel in one
all_gather (ids as float32 values) instead of two per table; equal to eager (loss, every gradient, the
SGD-updated parameters) on simulated ranks, an uneven batch included; disabled, each keeps its own gathers."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.passes.bucket_gathered_rows import FLOAT32_EXACT_IDS, _carrier
from passutil import assert_sgd_equal, simulated_sgd
from reference import eager_sgd

LR, STEPS = 0.5, 2


class ThreeTables(nn.Module):
    """Two big tables (rows gathered) and a small one (all-reduced), as builtin:dlrm's users, movies and genres."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.users = nn.Embedding(1100, dim)
        self.movies = nn.Embedding(1300, dim)
        self.genres = nn.Embedding(10, dim)
        self.fc = nn.Linear(3 * dim, 1)

    def forward(self, u, m, g):
        return self.fc(torch.cat([self.users(u), self.movies(m), self.genres(g)], dim=1)).squeeze(1)


def _batch(batch_size: int):
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 1100, (batch_size,), generator=g), torch.randint(0, 1300, (batch_size,), generator=g),
            torch.randint(0, 10, (batch_size,), generator=g), torch.randn(batch_size, generator=g))


def _gathers(prog) -> list[str]:
    return [c for c in prog.collectives() if "all_gather" in c]


@pytest.mark.parametrize("batch_size,world", [(8, 2), (7, 3)])
def test_one_gather_for_every_table_and_equal_to_eager(batch_size, world):
    torch.manual_seed(0)
    model = ThreeTables()
    batch = _batch(batch_size)
    progs, hist, params, _ = simulated_sgd(model, batch, F.mse_loss, world, "dp", LR, STEPS)
    want_hist, want_params = eager_sgd(model, [batch], F.mse_loss, LR, STEPS)
    assert_sgd_equal(hist, params, want_hist, want_params)
    for prog in progs.values():
        assert len(_gathers(prog)) == 1, prog.collectives()
    reduced = sum(int(c.rsplit(", ", 1)[1].rstrip(")")) for c in progs[0].collectives() if "all_reduce" in c)
    assert reduced < model.users.weight.numel(), progs[0].collectives()


def test_disabled_each_table_keeps_two_gathers():
    torch.manual_seed(0)
    model = ThreeTables()
    batch = _batch(8)
    progs, hist, _, _ = simulated_sgd(model, batch, F.mse_loss, 2, "dp", LR, 1,
                                      disabled_passes=("bucket_gathered_rows",))
    assert len(_gathers(progs[0])) == 4, progs[0].collectives()
    want_hist, _ = eager_sgd(model, [batch], F.mse_loss, LR, 1)
    assert abs(hist[0][0] - want_hist[0][0]) < 1e-5


def _pad(dtype):
    return types.SimpleNamespace(meta={"val": torch.empty(0, dtype=dtype)})


def test_ids_ride_as_float32_only_where_exact():
    assert _carrier(_pad(torch.int64), FLOAT32_EXACT_IDS) == torch.float32
    assert float(torch.tensor(FLOAT32_EXACT_IDS - 1, dtype=torch.int64).float()) == FLOAT32_EXACT_IDS - 1
    assert _carrier(_pad(torch.int64), FLOAT32_EXACT_IDS + 1) == torch.int64  # 2**24 + 1 is not a float32
    assert _carrier(_pad(torch.float32), 10**9) == torch.float32
    assert _carrier(_pad(torch.bfloat16), 10) == torch.bfloat16
