"""A small LLaMA-style language model (our own): RMSNorm, rotary embeddings, SwiGLU, and
grouped-query attention through ``scaled_dot_product_attention``.

``factory(batch_size, seq_len)`` follows the adaptdist model contract (``(model,
(tokens, targets), loss_fn)``, byte-level vocabulary); ``data`` and ``sample`` are the
GPT's. Shapes in comments: B batch, T sequence, H query heads, K key/value heads,
D head dim, C = H * D model dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.models.gpt import data, generate, lm_loss, sample  # noqa: F401  (same contract as the GPT)

# `adaptdist train --plan tp`: q/k/v and the SwiGLU input projections column-parallel (by heads,
# by hidden units), attention-out and SwiGLU-out row-parallel.
TP_PLAN = {
    "tok_emb.weight": "S(0)",  # vocabulary-parallel embedding
    "head.weight": "S(0)",  # vocabulary-parallel output layer (logits sharded by vocabulary)
    "layers.*.attn.w[qkv].weight": "S(0)",
    "layers.*.attn.wo.weight": "S(1)",
    "layers.*.mlp.w[13].weight": "S(0)",
    "layers.*.mlp.w2.weight": "S(1)",
}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    max_seq_len: int = 256
    dim: int = 192
    num_layers: int = 4
    num_heads: int = 6
    num_kv_heads: int = 2
    ffn_dim: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each ``[max_seq_len, head_dim]`` (RoFormer, Su et al. 2021; half-split layout)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)  # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [B, heads, T, D]`` by position; ``cos, sin: [T, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.h, self.k = cfg.num_heads, cfg.num_kv_heads
        self.d = cfg.dim // cfg.num_heads
        self.wq = nn.Linear(cfg.dim, self.h * self.d, bias=False)
        self.wk = nn.Linear(cfg.dim, self.k * self.d, bias=False)
        self.wv = nn.Linear(cfg.dim, self.k * self.d, bias=False)
        self.wo = nn.Linear(self.h * self.d, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.h, self.d).transpose(1, 2)   # [B, H, T, D]
        k = self.wk(x).view(B, T, self.k, self.d).transpose(1, 2)   # [B, K, T, D]
        v = self.wv(x).view(B, T, self.k, self.d).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.h * self.d))


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)`` (Shazeer 2020)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Decoder-only LLaMA-style model; ``int64[B, T]`` tokens -> ``float32[B, T, vocab]`` logits."""

    def __init__(self, cfg: LlamaConfig = LlamaConfig()):
        super().__init__()
        if cfg.num_heads % cfg.num_kv_heads or cfg.dim % cfg.num_heads:
            raise ValueError(f"{cfg}: num_heads must divide dim and be a multiple of num_kv_heads")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.dim // cfg.num_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))

    def generate(self, prompt: torch.Tensor, num_tokens: int, temperature: float = 0.8,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``num_tokens`` more tokens after ``prompt`` (``int64[T]``)."""
        return generate(self, self.cfg.max_seq_len, prompt, num_tokens, temperature, generator)

def factory(batch_size: int, seq_len: int, config: LlamaConfig | None = None):
    """``(Llama, (tokens, targets), lm_loss)`` for ``int64[batch_size, seq_len]`` batches."""
    cfg = config or LlamaConfig(max_seq_len=max(seq_len, 1))
    model = Llama(cfg)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), generator=g)
    return model, (tokens, targets), lm_loss
