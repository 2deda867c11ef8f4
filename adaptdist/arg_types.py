"""argparse ``type=`` converters every command shares (re-exported by :mod:`adaptdist.cli.common`; the runtime's
own entry points use them too): numbers are refused at parse time when they are not finite, out of range or
absurd, so ``--lr nan`` or ``--seed 2**70`` fail before any work, with argparse's ``argument --lr: ...``."""

from __future__ import annotations

import argparse
import math
import os

from . import limits

MAX_SEED = 2**63 - 1
"""The largest ``--seed``: a rank seeds torch with ``seed + rank`` (``torch.manual_seed`` takes up to 2**64 - 1)."""
MAX_COUNT = 10**9
"""The largest integer flag (``--steps``, ``--keep``, ``--max-restarts``, ...): a billion steps is no real run, and
a number past int64 would fail only deep in a rank."""
MAX_DIGITS = 40
"""Longest number text read (Python refuses int() of more than 4300 digits with a ValueError of its own)."""


def _number(kind, text: str):
    t = text.strip()
    if len(t) > MAX_DIGITS:
        raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {len(t)} characters")
    try:
        v = kind(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a{'n' if kind is int else ''} {kind.__name__}, "
                                         f"got {text!r}") from None
    if isinstance(v, float) and not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return v


def bounded(kind, least=None, greatest=None, *, above=None, why: str = ""):
    """An argparse ``type=`` for a number of ``kind`` (int or float; floats finite) in ``[least, greatest]``
    (``above``: strictly greater than it); ``why`` explains the upper bound in the message."""

    def conv(text: str):
        v = _number(kind, text)
        if above is not None and not v > above:
            raise argparse.ArgumentTypeError(f"must be > {above:g}, got {text}")
        if least is not None and v < least:
            raise argparse.ArgumentTypeError(f"must be >= {least:g}, got {text}")
        hi = greatest() if callable(greatest) else greatest
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi:g}{' (' + why + ')' if why else ''}, got {text}")
        return v
    conv.__name__ = kind.__name__
    return conv


def positive(kind, greatest=None, why: str = ""):
    """An argparse ``type=`` for a number > 0 of ``kind`` (int or float); floats must also be finite (``nan`` and
    ``inf`` are refused: ``--lr nan`` would only fail on the ranks, ``--max-grad-norm nan`` would turn clipping
    off); ``greatest`` bounds it above. argparse prefixes the message with the flag (``argument --lr: ...``)."""
    if greatest is None and kind is int:
        greatest, why = MAX_COUNT, "the largest count adaptdist takes"
    conv = bounded(kind, None, greatest, above=0, why=why)
    conv.__name__ = f"positive {kind.__name__}"
    return conv


def nonnegative_int(text: str) -> int:
    """An argparse ``type=`` for an integer >= 0 (``--max-restarts``, ``--sample-bytes``)."""
    return bounded(int, 0, MAX_COUNT, why="the largest count adaptdist takes")(text)


def seed(text: str) -> int:
    """An argparse ``type=`` for ``--seed``: an integer in 0..:data:`MAX_SEED`."""
    v = _number(int, text)
    if not 0 <= v <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in 0..2**63-1 ({MAX_SEED}), got {text}")
    return v


def local_ranks(text: str) -> int:
    """An argparse ``type=`` for ``--nproc`` (ranks on this machine): an integer in 1..
    :func:`adaptdist.limits.max_local_ranks` (256; ``ADAPTDIST_MAX_LOCAL_RANKS`` raises it)."""
    v = bounded(int, 1)(text)
    if v > limits.max_local_ranks():
        raise argparse.ArgumentTypeError(limits.rank_limit_message(v, "", local=True))
    return v


def threads(text: str) -> int:
    """An argparse ``type=`` for ``--threads-per-rank``: 1..4 x this machine's cores."""
    return positive(int, 4 * (os.cpu_count() or 1), "4 x this machine's cores")(text)
