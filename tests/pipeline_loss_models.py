"""Small models for pipeline tests of the loss and of stages without trainable parameters, each with exactly two
layers so that every two-stage cut is the same (factories ``(batch_size, seq_len) -> (model, batch, loss_fn)``, as
the CLI loads them; seeded)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class FeatPenalty(nn.Module):
    """``trunk`` then ``head``; returns the head's logits and the trunk's features: the loss's feature penalty is
    reduced on stage 0 (a partial loss term sent to the last stage)."""

    def __init__(self, d_in: int = 6, d: int = 16, ncls: int = 5):
        super().__init__()
        self.trunk = nn.Linear(d_in, d)
        self.head = nn.Linear(d, ncls)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return {"logits": self.head(h), "feat": h}


def feat_penalty_loss(out, y):
    return F.cross_entropy(out["logits"], y) + 0.1 * out["feat"].pow(2).mean()


def feat_penalty(batch_size: int = 6, seq_len: int = 0, seed: int = 0):
    torch.manual_seed(seed)
    m = FeatPenalty()
    g = torch.Generator().manual_seed(seed + 1)
    return m, (torch.randn(batch_size, 6, generator=g), torch.randint(0, 5, (batch_size,), generator=g)), \
        feat_penalty_loss


class FrozenEmbedding(nn.Module):
    """A frozen embedding (stage 0: no trainable parameter) then a trainable head."""

    def __init__(self, vocab: int = 20, d: int = 8, ncls: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.emb.weight.requires_grad_(False)
        self.head = nn.Linear(d, ncls)

    def forward(self, x):
        return self.head(self.emb(x).mean(1))


def frozen_embedding(batch_size: int = 6, seq_len: int = 5, seed: int = 0):
    torch.manual_seed(seed)
    m = FrozenEmbedding()
    g = torch.Generator().manual_seed(seed + 1)
    return m, (torch.randint(0, 20, (batch_size, seq_len), generator=g),
               torch.randint(0, 4, (batch_size,), generator=g)), F.cross_entropy
