"""The unit training throughput is counted in: tokens for a token-sequence model, samples for any other.

One rule for every front end (``adaptdist train`` on one host or several, ``estimate``, ``run`` and its torchrun
worker), so that the progress bar, the final line and ``summary.json``'s ``<unit>_per_s`` field agree::

    ids   int64[16, 128] into an nn.Embedding   -> ("tokens", 2048)   # 16 x 128 per step
    x     float32[16, 784]                      -> ("samples", 16)
    image uint8[16, 3, 32, 32]                  -> ("samples", 16)    # integer, but not [B, T]
    feats int64[16, 26], no nn.Embedding        -> ("samples", 16)    # categorical features, not a sequence
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

UNITS = ("tokens", "samples")


def is_token_batch(x0: torch.Tensor, model: nn.Module | None = None) -> bool:
    """Whether the first batch input ``x0`` is token ids: an integer (not bool) ``[B, T]`` tensor, and, when
    ``model`` is given, a model with an ``nn.Embedding`` to read them (``nn.EmbeddingBag`` tables read bags of
    categorical ids, not a sequence)."""
    if not isinstance(x0, torch.Tensor) or x0.dim() != 2:
        return False
    if x0.dtype == torch.bool or x0.is_floating_point() or x0.is_complex():
        return False
    return model is None or any(isinstance(m, nn.Embedding) for m in model.modules())


def throughput_unit(example: Sequence[torch.Tensor], model: nn.Module | None = None) -> tuple[str, int]:
    """``(unit, items_per_step)`` for a global batch ``example``: ``("tokens", B * T)`` when its first input is
    token ids (:func:`is_token_batch`), else ``("samples", B)`` (``B``: dim 0 of the first input, 1 for a 0-d
    one). ``model`` (when known) sharpens the token test."""
    x0 = example[0]
    if is_token_batch(x0, model):
        return "tokens", int(x0.numel())
    return "samples", int(x0.shape[0]) if isinstance(x0, torch.Tensor) and x0.dim() else 1


def short_unit(unit: str) -> str:
    """The unit as a rate label shows it: ``tok`` for tokens (``tok/s``), else the unit itself (``samples/s``)."""
    return "tok" if unit == "tokens" else unit


def manifest_unit(manifest: dict, example: Sequence[torch.Tensor]) -> tuple[str, int]:
    """:func:`throughput_unit` for compiled artifacts: the unit ``adaptdist compile`` recorded (its manifest's
    ``throughput_unit``, decided with the model at hand), else (artifacts from before that field) the example
    batch's alone; ``items_per_step`` from ``example``."""
    unit = manifest.get("throughput_unit")
    x0 = example[0]
    if unit == "tokens" and isinstance(x0, torch.Tensor) and x0.dim() >= 1:
        return "tokens", int(x0.numel())
    if unit == "samples":
        return "samples", int(x0.shape[0]) if isinstance(x0, torch.Tensor) and x0.dim() else 1
    return throughput_unit(example)
