"""nn.TransformerEncoderLayer(d_model=64, nhead=4, batch_first=True) x 2 + a head: the model of RESULTS.md's
"MultiheadAttention(batch_first=True) keeps the batch split" (`adaptdist plan/train benchmarks/mha_encoder_model.py:factory`)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

class Enc(nn.Module):
    def __init__(self, d=64, nhead=4, layers=2, vocab=32, n_out=8):
        super().__init__()
        self.emb = nn.Linear(16, d)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(d, nhead, dim_feedforward=128, dropout=0.0, batch_first=True) for _ in range(layers)])
        self.head = nn.Linear(d, n_out)
    def forward(self, x):
        h = self.emb(x)
        for l in self.layers:
            h = l(h)
        return self.head(h)

def factory(batch_size: int = 8, seq_len: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    m = Enc()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch_size, seq_len, 16, generator=g)
    y = torch.randint(0, 8, (batch_size, seq_len), generator=g)
    return m, (x, y), lambda out, t: F.cross_entropy(out.reshape(-1, 8), t.reshape(-1))
