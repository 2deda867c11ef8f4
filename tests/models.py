"""Small models for tests: each a factory returning (model, batch, loss_fn)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.models.gpt import GPT, GPTConfig, lm_loss


def tiny_gpt(batch_size: int = 5, seq_len: int = 8, seed: int = 0, num_heads: int = 2):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(dim=32, num_layers=2, num_heads=num_heads, max_seq_len=seq_len))
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, 256, (batch_size, seq_len), generator=g)
    y = torch.randint(0, 256, (batch_size, seq_len), generator=g)
    y[0, :3] = -1  # some ignored targets: ignore_index must count globally
    return model, (x, y), lm_loss


class MLP(nn.Module):
    def __init__(self, d_in=12, d_hidden=24, d_out=5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def mlp(batch_size: int = 7, loss: str = "mean", seed: int = 0):
    torch.manual_seed(seed)
    model = MLP()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch_size, 12, generator=g)
    if loss == "mse":
        y = torch.randn(batch_size, 5, generator=g)
        return model, (x, y), lambda out, t: F.mse_loss(out, t)
    y = torch.randint(0, 5, (batch_size,), generator=g)
    if loss == "sum":
        return model, (x, y), lambda out, t: F.cross_entropy(out, t, reduction="sum")
    if loss == "manual_mean":
        return model, (x, y), lambda out, t: (out.log_softmax(-1).gather(1, t[:, None]).squeeze(1) * -1).mean()
    return model, (x, y), lambda out, t: F.cross_entropy(out, t)


class ConvNet(nn.Module):
    def __init__(self, batch_norm: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4) if batch_norm else nn.GroupNorm(2, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.norm(self.conv(x))), 2)
        return self.head(h.mean(dim=(2, 3)))


def convnet(batch_size: int = 5, batch_norm: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    model = ConvNet(batch_norm)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch_size, 3, 8, 8, generator=g)
    y = torch.randint(0, 3, (batch_size,), generator=g)
    return model, (x, y), F.cross_entropy


def tiny_llama(batch_size: int = 5, seq_len: int = 8, seed: int = 0):
    from adaptdist.models.llama import Llama, LlamaConfig

    torch.manual_seed(seed)
    model = Llama(LlamaConfig(dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48, max_seq_len=seq_len))
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, 256, (batch_size, seq_len), generator=g)
    y = torch.randint(0, 256, (batch_size, seq_len), generator=g)
    return model, (x, y), lm_loss


class TwoShards(nn.Module):
    """Two [rows, cols] weights summed: planned one S(1) and one S(0), the sum needs an all_to_all."""

    def __init__(self, rows: int = 9, cols: int = 7):
        super().__init__()
        self.a = nn.Parameter(0.1 * torch.randn(rows, cols))
        self.b = nn.Parameter(0.1 * torch.randn(rows, cols))

    def forward(self, x):
        return x @ (self.a * 2 + self.b)


def two_shards(batch_size: int = 3, rows: int = 9, cols: int = 7, seed: int = 0):
    torch.manual_seed(seed)
    model = TwoShards(rows, cols)
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(batch_size, rows, generator=g), torch.randn(batch_size, cols, generator=g)), F.mse_loss
