"""Small models for tests: each a factory returning (model, batch, loss_fn)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.models.gpt import GPT, GPTConfig, lm_loss


def tiny_gpt(batch_size: int = 5, seq_len: int = 8, seed: int = 0, num_heads: int = 2, num_layers: int = 2):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(dim=32, num_layers=num_layers, num_heads=num_heads, max_seq_len=seq_len))
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


def wide_mlp(batch_size: int = 4, seq_len: int = 1, seed: int = 0):
    """Linear(256, 1024), Tanh, Linear(1024, 1024), Tanh, Linear(1024, 4) with cross-entropy: 5 MiB of float32
    gradients, several of the default 2 MiB gradient buckets (each over 256 KiB but the last layer's).
    ``seq_len`` is unused (the CLI's factory signature)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 4))
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(batch_size, 256, generator=g), torch.randint(0, 4, (batch_size,), generator=g)), \
        F.cross_entropy


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


class PairwiseDistances(nn.Module):
    """A linear layer, then the distances between every pair of samples: an op (cdist) with no sharding rule
    of ours nor DTensor's for a split batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.cdist(h, h)


def pairwise_distances(batch_size: int = 6, seed: int = 0):
    """(model, (x [B, 4], target [B, B]), mse loss)."""
    torch.manual_seed(seed)
    return PairwiseDistances(), (torch.randn(batch_size, 4), torch.randn(batch_size, batch_size)), F.mse_loss


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


class TinyViT(nn.Module):
    """ViT's parameters whose dim 0 has one row: the class token [1, 1, D] and position embedding
    [1, N + 1, D] (FSDP cannot split dim 0 over 2 ranks)."""

    def __init__(self, dim: int = 8, patches: int = 4, patch_dim: int = 6, classes: int = 3):
        super().__init__()
        self.patch = nn.Linear(patch_dim, dim)
        self.cls_token = nn.Parameter(0.1 * torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(0.1 * torch.randn(1, patches + 1, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):  # x: [B, patches, patch_dim]
        h = self.patch(x)
        h = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), h], dim=1) + self.pos_embed
        return self.head(self.norm(h)[:, 0])


def tiny_vit(batch_size: int = 5, seed: int = 0):
    torch.manual_seed(0)
    model = TinyViT()
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(batch_size, 4, 6, generator=g), torch.randint(0, 3, (batch_size,), generator=g)), \
        F.cross_entropy


class _HFViT(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=8, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=16, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="eager")
        self.vit = ViTForImageClassification(cfg)

    def forward(self, pixels):
        return self.vit(pixel_values=pixels).logits


def hf_vit(batch_size: int = 5, seed: int = 0):
    """Hugging Face ViT from a config (random weights, no download): cls_token [1, 1, 8], position
    embeddings [1, 5, 8]."""
    torch.manual_seed(0)
    model = _HFViT()
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(batch_size, 3, 8, 8, generator=g), torch.randint(0, 3, (batch_size,), generator=g)), \
        F.cross_entropy


class _HFLlama(nn.Module):
    def __init__(self, attn: str = "eager"):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=16, use_cache=False, attn_implementation=attn)
        self.model = LlamaForCausalLM(cfg)

    def forward(self, ids):
        return self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


HF_LLAMA_TP_PLAN = {"model.model.layers.*.self_attn.k_proj.weight": "S(0)"}  # GQA: 2 kv heads for 4 query heads


def hf_llama(batch_size: int = 4, seq_len: int = 8, seed: int = 0):
    """Hugging Face LLaMA from a config (GQA, eager attention; random weights, no download)."""
    torch.manual_seed(0)
    model = _HFLlama()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, 32, (batch_size, seq_len), generator=g)
    y = torch.randint(0, 32, (batch_size, seq_len), generator=g)
    return model, (x, y), lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten())


class _TransformerEncoder(nn.Module):
    """nn.TransformerEncoderLayer(batch_first=True) x 2 and a head: nn.MultiheadAttention merges [T, B, D] into rows."""

    def __init__(self, d: int = 16, nhead: int = 2):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(d, nhead, dim_feedforward=2 * d, dropout=0.0,
                                                                batch_first=True) for _ in range(2)])
        self.head = nn.Linear(d, 6)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class _SelfAttention(nn.Module):
    """A plain nn.MultiheadAttention(batch_first=True) between two Linears (its [T, B, D] merged into rows)."""

    def __init__(self, d: int = 16, nhead: int = 2):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.mha = nn.MultiheadAttention(d, nhead, batch_first=True)
        self.head = nn.Linear(d, 6)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.mha(h, h, h, need_weights=False)
        return self.head(a)


def _token_classifier(cls, batch_size: int, seq_len: int, seed: int, d_model: int, nhead: int):
    """``cls(d_model, nhead)`` from ``seed``, a [B, T, 8] batch with [B, T] targets of 6 classes, cross entropy."""
    torch.manual_seed(seed)
    model = cls(d_model, nhead)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch_size, seq_len, 8, generator=g)
    y = torch.randint(0, 6, (batch_size, seq_len), generator=g)
    return model, (x, y), lambda o, t: F.cross_entropy(o.reshape(-1, 6), t.reshape(-1))


def self_attention(batch_size: int = 4, seq_len: int = 5, seed: int = 0, d_model: int = 16, nhead: int = 2):
    return _token_classifier(_SelfAttention, batch_size, seq_len, seed, d_model, nhead)


def transformer_encoder(batch_size: int = 4, seq_len: int = 5, seed: int = 0, d_model: int = 16, nhead: int = 2):
    return _token_classifier(_TransformerEncoder, batch_size, seq_len, seed, d_model, nhead)
