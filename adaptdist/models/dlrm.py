"""DLRM-style recommenders (Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and
Recommendation Systems"), and ``builtin:dlrm``: one that predicts movie ratings.

The model is two submodules, so that the embedding part and the dense part can be placed apart (the paper's
heterogeneous pipeline keeps the first on CPU ranks): :class:`SparseArch`, one embedding table per sparse feature
(``nn.EmbeddingBag``, the mean over a bag of ids), and :class:`DenseArch`, an optional bottom MLP over dense
features, the pairwise dot products of all feature vectors and a top MLP (the names are TorchRec's).

``builtin:dlrm`` follows the model-file contract of :mod:`adaptdist.model_spec`:
``factory(batch_size, seq_len, data_path=None)`` returns ``(model, (users, movies, genres, ratings), rating_loss)``
with ``users, movies: int64[B]``, ``genres: int64[B, G]`` (each rated movie's genres + 1, 0 pads) and
``ratings: float32[B]``; tables sized from the data (users, movies, genres + padding). ``data(batch_size,
seq_len, path=None, seed=0, start_step=0)`` yields shuffled training batches epoch after epoch, and
``evaluate(model, path=None, ...)`` gives the validation RMSE. ``seq_len`` is not used. ``path`` / ``data_path``:
a MovieLens folder (:mod:`adaptdist.data.movielens`); None: ``../shared/data/movielens-small`` where present, else
a generated data set of the same shape.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp(sizes: Sequence[int]) -> nn.Sequential:
    """Linear layers ``sizes[0] -> sizes[1] -> ...`` with a ReLU between two (none after the last)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers)


class SparseArch(nn.Module):
    """The embedding lookups: one ``nn.EmbeddingBag`` per table, each row's vector the mean over its bag of ids,
    ids equal to the table's ``padding_idx`` left out (a bag of ids padded to one width).

    ``forward(*ids)``: one ``int64`` tensor per table, ``[B]`` (one id per row) or ``[B, L]`` (a bag of ``L`` ids
    per row) -> ``float32[B, tables, dim]``. Weights drawn from ``N(0, 1/dim)`` (dot products of two of them have
    variance about 1); padding rows zero, and they stay zero: they get no gradient.

    A table with padding takes the mean as a sum weighted by ``1 / (ids in the bag that are not padding)`` (0 for
    padding), which equals ``EmbeddingBag(mode="mean", padding_idx=p)`` and keeps every row's lookup on the rank
    that holds the row under data parallelism (a bag with ``padding_idx`` is lowered on the whole batch).
    """

    def __init__(self, rows: Sequence[int], dim: int, padding_idx: Sequence[int | None] | None = None):
        super().__init__()
        self.padding_idx = tuple(padding_idx) if padding_idx is not None else (None,) * len(rows)
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="mean" if p is None else "sum")
                                    for n, p in zip(rows, self.padding_idx))
        with torch.no_grad():
            for t, p in zip(self.tables, self.padding_idx):
                nn.init.normal_(t.weight, std=dim ** -0.5)
                if p is not None:
                    t.weight[p].zero_()

    def forward(self, *ids: torch.Tensor) -> torch.Tensor:
        bags = []
        for t, p, i in zip(self.tables, self.padding_idx, ids):
            i = i.unsqueeze(1) if i.dim() == 1 else i
            if p is None:
                bags.append(t(i))
            else:
                keep = (i != p).float()
                bags.append(t(i, per_sample_weights=keep / keep.sum(1, keepdim=True).clamp(min=1.0)))
        return torch.stack(bags, dim=1)


class DenseArch(nn.Module):
    """The dense part: a bottom MLP over ``dense_in`` dense features to one more feature vector (when
    ``dense_in > 0``), the pairwise dot products of the ``n`` feature vectors (DLRM's interaction, ``n(n-1)/2``
    values), and a top MLP over ``[bottom output, the embeddings flattened (concat_sparse), the dot products]`` to
    one value per row.

    ``forward(sparse float32[B, tables, dim], dense float32[B, dense_in] | None) -> float32[B]``.
    """

    def __init__(self, tables: int, dim: int, dense_in: int = 0, bottom_hidden: Sequence[int] = (16,),
                 top_hidden: Sequence[int] = (16,), concat_sparse: bool = False):
        super().__init__()
        self.bottom = mlp([dense_in, *bottom_hidden, dim]) if dense_in else None
        self.concat_sparse = concat_sparse
        n = tables + (1 if dense_in else 0)
        top_in = (dim if dense_in else 0) + (tables * dim if concat_sparse else 0) + n * (n - 1) // 2
        self.top = mlp([top_in, *top_hidden, 1])

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor | None = None) -> torch.Tensor:
        parts, feats = [], sparse
        if self.bottom is not None:
            x = self.bottom(dense)
            parts.append(x)
            feats = torch.cat([x.unsqueeze(1), sparse], dim=1)  # [B, n, dim]
        if self.concat_sparse:
            parts.append(sparse.flatten(1))
        n = feats.shape[1]
        dots = torch.bmm(feats, feats.transpose(1, 2))  # [B, n, n]
        i, j = torch.triu_indices(n, n, offset=1)
        parts.append(dots[:, i, j])
        return self.top(torch.cat(parts, dim=1)).squeeze(1)


class DLRM(nn.Module):
    """:class:`SparseArch` then :class:`DenseArch`. ``forward(*inputs)``: ``dense float32[B, dense_in]`` first when
    ``dense_in > 0``, then one id tensor per table (``[B]`` or ``[B, L]``) -> ``float32[B]``."""

    def __init__(self, table_rows: Sequence[int], dim: int = 8, dense_in: int = 0,
                 padding_idx: Sequence[int | None] | None = None, bottom_hidden: Sequence[int] = (16,),
                 top_hidden: Sequence[int] = (16,), concat_sparse: bool = False):
        super().__init__()
        self.dense_in = dense_in
        self.sparse_arch = SparseArch(table_rows, dim, padding_idx)
        self.dense_arch = DenseArch(len(table_rows), dim, dense_in, bottom_hidden, top_hidden, concat_sparse)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        dense, ids = (inputs[0], inputs[1:]) if self.dense_in else (None, inputs)
        return self.dense_arch(self.sparse_arch(*ids), dense)


# --- builtin:dlrm: movie ratings ----------------------------------------------------------------------------

@dataclass(frozen=True)
class RatingConfig:
    """``builtin:dlrm``'s sizes; the tables' rows come from the data."""

    dim: int = 32
    top_hidden: tuple[int, ...] = (64, 32)


def rating_model(num_users: int, num_movies: int, num_genres: int, mean_rating: float,
                 config: RatingConfig = RatingConfig()) -> DLRM:
    """A :class:`DLRM` over users, movies and genre bags (``num_genres + 1`` rows, row 0 the padding), its
    embeddings and their 3 dot products into the top MLP, whose output bias starts at ``mean_rating``."""
    model = DLRM((num_users, num_movies, num_genres + 1), config.dim, padding_idx=(None, None, 0),
                 top_hidden=config.top_hidden, concat_sparse=True)
    with torch.no_grad():
        model.dense_arch.top[-1].bias.fill_(mean_rating)
    return model


def rating_loss(predicted: torch.Tensor, ratings: torch.Tensor) -> torch.Tensor:
    """Mean squared error, ``predicted, ratings: float32[B]`` -> scalar (its square root is the RMSE)."""
    return F.mse_loss(predicted, ratings)


def _note(text: str) -> None:
    print(f"adaptdist: {text}", file=sys.stderr, flush=True)


def factory(batch_size: int, seq_len: int, data_path: str | None = None, config: RatingConfig | None = None):
    """``(DLRM, (users, movies, genres, ratings), rating_loss)``: the tables sized from the data at ``data_path``
    (None: the default, see the module docstring), the example batch the first ``batch_size`` training ratings;
    ``seq_len`` is not used. Says which data it uses (stderr).

    Raises:
        DataError: the data is bad (:func:`adaptdist.data.movielens.load`), or has fewer training ratings than
            ``batch_size``.
    """
    from adaptdist.data import movielens as ml

    data = ml.resolve(data_path)
    train, val = data.split()
    per_epoch = ml.steps_per_epoch(train.numel(), batch_size)
    if per_epoch == 0:
        from adaptdist.errors import DataError

        raise DataError(f"--batch-size {batch_size} is larger than the {train.numel():,} training ratings of "
                        f"{data.source}; use --batch-size {train.numel()} or less")
    which = (f"{ml.DEFAULT_DIR} is absent: a generated data set of its shape" if data.generated and data_path is None
             else data.source)
    _note(f"builtin:dlrm data: {which} ({data.describe()}); training on the first "
          f"{1 - ml.VALIDATION_FRACTION:.0%} by timestamp ({train.numel():,} ratings, {per_epoch:,} steps per epoch "
          f"at --batch-size {batch_size}), validating on the last {ml.VALIDATION_FRACTION:.0%} ({val.numel():,})")
    model = rating_model(data.num_users, data.num_movies, data.num_genres, float(data.ratings[train].mean()),
                         config or RatingConfig())
    return model, data.rows(train[:batch_size]), rating_loss


def data(batch_size: int, seq_len: int, path: str | None = None, seed: int = 0, start_step: int = 0):
    """Endless training batches ``(users, movies, genres, ratings)`` of ``batch_size`` ratings, shuffled per epoch
    from ``seed`` (:func:`adaptdist.data.movielens.epoch_batches`), from the batch after ``start_step`` on.

    Raises:
        DataError: the data is bad, or has fewer training ratings than ``batch_size``.
    """
    from adaptdist.data import movielens as ml

    ratings = ml.resolve(path)
    train, _ = ratings.split()
    return ml.epoch_batches(ratings, train, batch_size, seed=seed, start_step=start_step)


@torch.no_grad()
def evaluate(model: nn.Module, path: str | None = None, batch_size: int | None = None, steps: int | None = None
             ) -> tuple[dict, str]:
    """The trained ``model``'s RMSE on the validation ratings (the latest by timestamp) of the data at ``path``,
    beside the RMSE of always predicting the training mean. With ``batch_size`` and ``steps`` (the run's), also
    the epochs trained. Returns ``(fields for summary.json, one line for the log)``.

    Raises:
        DataError: the data is bad.
    """
    from adaptdist.data import movielens as ml

    data = ml.resolve(path)
    train, val = data.split()
    model.eval()
    sq = 0.0
    for chunk in val.split(8192):
        users, movies, genres, ratings = data.rows(chunk)
        sq += float(((model(users, movies, genres) - ratings) ** 2).sum())
    rmse = math.sqrt(sq / val.numel())
    mean = data.ratings[train].mean()
    baseline = float(((data.ratings[val] - mean) ** 2).mean().sqrt())
    fields = {"validation_rmse": rmse, "validation_ratings": val.numel(), "mean_baseline_rmse": baseline,
              "train_ratings": train.numel(), "validation_split": f"the last {ml.VALIDATION_FRACTION:.0%} by timestamp",
              "data": data.source, "generated_data": data.generated}
    epochs = ""
    if batch_size and steps:
        fields["epochs"] = steps / max(1, ml.steps_per_epoch(train.numel(), batch_size))
        epochs = f" after {fields['epochs']:.2f} epochs"
    text = (f"validation RMSE {rmse:.4f} on the latest {val.numel():,} ratings{epochs} (always predicting the "
            f"training mean: {baseline:.4f})")
    return fields, text
