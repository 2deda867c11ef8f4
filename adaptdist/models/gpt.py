"""A small GPT-style byte-level language model (our own, no downloads).

``factory(batch_size, seq_len)`` follows the adaptdist model contract: it returns
``(model, example_batch, loss_fn)`` with ``example_batch = (tokens, targets)``,
both ``int64[batch_size, seq_len]``, and ``loss_fn(logits, targets)`` the mean
cross-entropy over all tokens (targets equal to -1 are ignored).
``data(batch_size, seq_len, path=None, seed=0)`` yields global batches of that
shape from a UTF-8 text file, or from the embedded default corpus.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB_SIZE = 256  # bytes

# `adaptdist train --plan tp`: Megatron-style tensor parallelism. Column-parallel q, k, v
# (sharded by heads) and MLP-in; row-parallel attention-out and MLP-out; vocabulary-parallel
# token embedding, so the tied output head yields logits sharded by vocabulary, which the
# vocabulary-parallel cross entropy consumes as they are; the position embedding is replicated.
TP_PLAN = {
    "tok_emb.weight": "S(0)",  # vocabulary-parallel embedding; the tied output head is then vocab-sharded too
    "blocks.*.attn.[qkv].weight": "S(0)",
    "blocks.*.attn.[qkv].bias": "S(0)",
    "blocks.*.attn.proj.weight": "S(1)",
    "blocks.*.fc.weight": "S(0)",
    "blocks.*.fc.bias": "S(0)",
    "blocks.*.fc_out.weight": "S(1)",
}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = VOCAB_SIZE
    max_seq_len: int = 256
    dim: int = 192
    num_layers: int = 4
    num_heads: int = 6
    mlp_ratio: int = 4


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        # Separate projections (not one fused QKV) so that tensor parallelism can shard each by heads.
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, C]
        B, T, C = x.shape
        hd = C // self.num_heads
        q, k, v = (p(x).view(B, T, self.num_heads, hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, hd]
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.fc_out = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer; input ``int64[B, T]`` tokens, output ``float32[B, T, vocab]`` logits.

    The output head shares its weight with the token embedding.
    """

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("fc_out.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.num_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        pos = torch.arange(T, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def generate(self, prompt: torch.Tensor, num_tokens: int, temperature: float = 0.8,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``num_tokens`` more tokens after ``prompt`` (``int64[T]``); returns ``int64[T + num_tokens]``."""
        return generate(self, self.cfg.max_seq_len, prompt, num_tokens, temperature, generator)


@torch.no_grad()
def generate(model: nn.Module, max_seq_len: int, prompt: torch.Tensor, num_tokens: int, temperature: float = 0.8,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Autoregressive sampling from any ``[1, T] -> [1, T, vocab]`` language model, last ``max_seq_len`` tokens
    as context; ``prompt: int64[T]`` -> ``int64[T + num_tokens]``."""
    out = prompt.clone()
    for _ in range(num_tokens):
        logits = model(out[-max_seq_len:].unsqueeze(0))[0, -1] / temperature
        out = torch.cat([out, torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)])
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens; ``logits: [B, T, V]``, ``targets: int64[B, T]``, -1 ignored."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


def factory(batch_size: int, seq_len: int, config: GPTConfig | None = None):
    """The built-in model: ``(GPT, (tokens, targets), lm_loss)`` for ``[batch_size, seq_len]`` batches."""
    cfg = config or GPTConfig(max_seq_len=max(seq_len, 1))
    model = GPT(cfg)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), generator=g)
    return model, (tokens, targets), lm_loss


def data(batch_size: int, seq_len: int, path: str | None = None, seed: int = 0, start_step: int = 0):
    """Endless global batches ``(tokens, targets)`` of ``int64[batch_size, seq_len]`` from text, from the batch
    after ``start_step`` batches on (a resumed run's data position).

    Raises:
        DataError: the file is missing, empty, not UTF-8 text, or shorter than ``seq_len + 1`` bytes.
    """
    from adaptdist.data.text import ByteCorpus

    corpus = ByteCorpus.from_path(path) if path else ByteCorpus.embedded()
    return corpus.batches(batch_size, seq_len, seed=seed, start_step=start_step)


def sample(model: GPT, num_bytes: int, seed: int = 0, prompt: str = "def ") -> str:
    """Generate ``num_bytes`` bytes of text after ``prompt`` with the trained ``model``."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(list(prompt.encode("utf-8")), dtype=torch.long)
    out = model.generate(ids, num_bytes, generator=g)
    return bytes(out.tolist()).decode("utf-8", errors="replace")
