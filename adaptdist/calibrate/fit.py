"""The alpha-beta fit: time(n bytes) = alpha + beta * n (Hockney 1994, "The communication
challenge for MPP: Intel Paragon and Meiko CS-2", Parallel Computing 20(3)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import AdaptdistError


class FitError(AdaptdistError):
    """The timings cannot be fitted (too few points, non-positive or non-finite values)."""


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted line: alpha_s (s, >= 0), beta_s_per_byte (s/byte, > 0) and the fit's
    root-mean-square relative residual (dimensionless)."""

    alpha_s: float
    beta_s_per_byte: float
    rms_rel_error: float


def fit_alpha_beta(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> AlphaBeta:
    """Least-squares fit of ``t = alpha + beta * n`` minimising the *relative* error
    sum(((alpha + beta n_i - t_i) / t_i)^2), so that small messages (which set alpha) weigh as
    much as large ones (which set beta); alpha >= 0 and beta > 0 are enforced by refitting the
    other coefficient alone when one comes out out of range.

    If the times do not grow with size (all messages latency-bound), beta falls back to the
    pessimistic t_max_size / n_max (the bandwidth the largest message achieved at least).

    Args:
        sizes_bytes: message sizes, bytes, > 0; at least two distinct ones.
        times_s: the measured seconds per message, > 0, one per size.

    Raises:
        FitError: fewer than two distinct sizes, lengths differ, or a value is not positive and finite.
    """
    n = np.asarray(sizes_bytes, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if n.shape != t.shape or n.ndim != 1:
        raise FitError(f"alpha-beta fit: {len(n)} sizes but {len(t)} times")
    if len(np.unique(n)) < 2:
        raise FitError(f"alpha-beta fit needs at least two distinct message sizes, got {list(n)}")
    if not (np.all(np.isfinite(n)) and np.all(np.isfinite(t)) and np.all(n > 0) and np.all(t > 0)):
        raise FitError(f"alpha-beta fit needs positive finite sizes and times, got sizes {list(n)}, times {list(t)}")
    w = 1.0 / t
    a_mat = np.stack([w, n * w], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a_mat, np.ones_like(t), rcond=None)
    if alpha < 0:  # refit beta alone with alpha = 0
        alpha = 0.0
        beta = float(np.sum(n * w) / np.sum((n * w) ** 2))
    if beta <= 0:  # latency-bound everywhere: bound the bandwidth by the largest message
        i = int(np.argmax(n))
        beta = float(t[i] / n[i])
        alpha = max(0.0, float(np.sum((t - beta * n) * w * w) / np.sum(w * w)))
    rel = (alpha + beta * n - t) / t
    err = float(math.sqrt(float(np.mean(rel ** 2))))
    return AlphaBeta(float(alpha), float(beta), err)
