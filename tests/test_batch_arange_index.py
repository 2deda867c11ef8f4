"""fold_batch_arange_index (adaptdist/compiler/batch_arange_index.py): a padding mask read as
``m[arange(B)[:, None, None, None], kv[None, None, None, :]]`` (transformers' masking_utils) keeps the batch split,
so pipeline microbatches run one program (HF BART under --plan pp was refused); learned positions expanded over
the batch take each rank's rows in the embedding backward instead of gathering the gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.compiler.batch_arange_index import fold_batch_arange_index
from adaptdist.compiler.capture import capture
from adaptdist.compiler.lowering import compile_model
from adaptdist.compiler.pipeline_lowering import PipelineOptions
from test_pipeline_lowering import check_against_eager, eager

aten = torch.ops.aten
V, D = 20, 8


class PaddedAttention(nn.Module):
    """Token and learned position embeddings, one attention layer whose mask is read as masking_utils reads a
    padding mask (indexed by arange over the batch), a head."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(16, D)
        self.q, self.k, self.out = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids, mask):
        b, t = ids.shape
        h = self.tok(ids) + self.pos(torch.arange(t).expand(b, -1) + 2)
        rows = torch.arange(b)[:, None, None, None]
        kv = torch.arange(t)[None, None, None, :]
        allowed = mask.bool()[rows, kv]  # [B, 1, 1, T]
        scores = (self.q(h) @ self.k(h).transpose(1, 2))[:, None]
        scores = scores.masked_fill(~allowed, -1e4).softmax(-1)[:, 0]
        return self.out(scores @ h)


def _batch(B=8, T=6):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for r in range(B):
        mask[r, T - r % 3:] = 0
    return ids, mask, torch.randint(0, V, (B, T), generator=g)


def lm(lg, y):
    return F.cross_entropy(lg.flatten(0, 1), y.flatten())


def test_the_mask_index_keeps_the_batch_dim():
    torch.manual_seed(0)
    cg = capture(PaddedAttention(), _batch(), lm)
    idx = [n for n in cg.gm.graph.nodes if n.target is aten.index.Tensor]
    assert len(idx) == 1 and idx[0].args[1][0] is None, [n.args for n in idx]
    assert fold_batch_arange_index(cg.gm) == 0  # nothing left to fold


def test_an_index_whose_other_index_varies_by_row_is_left_alone():
    def f(x, t):
        return x[torch.arange(x.shape[0]), t]

    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(f)(torch.randn(4, 5), torch.tensor([1, 0, 3, 2]))
    assert fold_batch_arange_index(gm) == 0
    assert [n for n in gm.graph.nodes if n.target is aten.index.Tensor][0].args[1][0] is not None


@pytest.mark.parametrize("microbatches", [2, 4])
def test_a_padding_mask_indexed_by_arange_lowers_under_pp_equal_to_eager(microbatches):
    """It was refused: 'the step's program differs between microbatches 0 and 1' (each microbatch cut its rows out
    of the whole-batch mask at its own offset)."""
    torch.manual_seed(0)
    model, batch = PaddedAttention(), _batch()
    expected = eager(model, batch, lm)
    progs = compile_model(model, batch, lm, 2, None, pipeline=PipelineOptions(stages=2, microbatches=microbatches))
    check_against_eager(progs, batch, expected)


@pytest.mark.slow
def test_hf_bart_with_a_padding_mask_under_pp_equals_eager():
    """HF BART (2 + 2 layers, hidden 32, a padding mask as an input) under pp with 2 microbatches (about 30 s)."""
    pytest.importorskip("transformers", reason="Hugging Face BART needs transformers (the test extras)")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import hf_pp_models

    model, batch, loss_fn = hf_pp_models.bart(8, 8)
    expected = eager(model, batch, loss_fn)
    progs = compile_model(model, batch, loss_fn, 2, None, pipeline=PipelineOptions(stages=2, microbatches=2))
    check_against_eager(progs, batch, expected)
