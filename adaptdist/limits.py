"""Stated limits on what adaptdist reads: how many ranks, how large and how deeply nested a file, and the
range of every figure of a cluster file. Each is checked before any work that grows with it (allocating
devices, planning, launching), so bad input fails at once with a typed error instead of filling memory or
keeping the planner busy for hours.

===========================  ==================  =========================================================
limit                        default             overridden by
===========================  ==================  =========================================================
batch x sequence length      2**28               (fixed) ``--batch-size`` x ``--seq-len``, each <= 2**24
ranks of a cluster           4096                ``ADAPTDIST_MAX_RANKS=N`` (a real cluster that is larger)
local ranks (``--nproc``)    256                 ``ADAPTDIST_MAX_LOCAL_RANKS=N`` (a host with more cores)
input file size              64 MiB              (fixed) cluster files, plan files, manifests
nesting depth                32                  (fixed) a cluster file nests 6 deep, a plan.json 4
document nodes               2,000,000           (fixed) counted with YAML aliases expanded
===========================  ==================  =========================================================

Planning time grows with the ranks (about a minute for 1000 ranks on 2 cores; the planner prints its
progress): the rank limits are where planning stops being interactive, not what adaptdist can represent.

Figures of a cluster file must lie in :data:`FIGURE_BOUNDS` (per field name, inclusive): far beyond any
device built (1e308 FLOP/s overflows the cost models to inf), far below any that computes.
"""

from __future__ import annotations

import math
import os

MAX_RANKS = 4096
"""Default largest world size of a cluster (file or arguments); ``ADAPTDIST_MAX_RANKS`` overrides it."""
MAX_LOCAL_RANKS = 256
"""Default largest ``--nproc`` (ranks on this one machine); ``ADAPTDIST_MAX_LOCAL_RANKS`` overrides it."""
MAX_FILE_BYTES = 64 * 2**20
"""Largest cluster file, plan file or manifest read (a 4096-rank cluster file is about 0.6 MiB)."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists in a cluster file, plan file or manifest."""
MAX_NODES = 2_000_000
"""Most values (mappings, lists, scalars) in one document, counting each YAML alias as what it expands to."""

MAX_BATCH_DIM = 2**24
"""Largest ``--batch-size`` and ``--seq-len``."""
MAX_BATCH_ITEMS = 2**28
"""Largest ``--batch-size`` x ``--seq-len`` (the example batch is built for real: 2**28 int64 tokens are 2 GiB)."""

FIGURE_BOUNDS: dict[str, tuple[float, float]] = {
    "peak_flops": (1e5, 1e19),                      # FLOP/s of one device (an H200: ~2e15 dense fp8)
    "memory_bytes": (2**20, 2**50),                 # bytes one rank may use: 1 MiB .. 1 PiB
    "memory_bandwidth_bytes_per_s": (1e6, 1e15),    # an H200: 4.8e12
    "bandwidth_bytes_per_s": (1e5, 1e15),           # a link: 100 kB/s .. 1 PB/s
    "latency_s": (0.0, 1.0),                        # a link's one-way latency (across the earth: ~0.1 s)
    "op_overhead_s": (0.0, 0.1),                    # host time of one dispatched op (measured: 3-10 us)
    "cores": (1e-3, 1e5),                           # a rank's share of its host's cores
    "alpha_s": (0.0, 1.0),                          # a collective's fixed cost
    "beta_s_per_byte": (1e-18, 1e-5),               # 1 / (1e18 ... 1e5 bytes/s)
    "rms_rel_error": (0.0, 1e6),
    "wall_s": (0.0, 1e8),
    "num_ranks": (1, 2**31),
}
"""Field name -> (least, greatest) allowed value in a cluster file (the field's last path component)."""


def _env_int(name: str, default: int) -> int:
    from .errors import UsageError

    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        v = int(text)
    except ValueError:
        raise UsageError(f"environment variable {name}={text!r} must be a positive integer") from None
    if v < 1:
        raise UsageError(f"environment variable {name}={text!r} must be a positive integer")
    return v


def max_ranks() -> int:
    """The largest world size allowed now: ``ADAPTDIST_MAX_RANKS`` or :data:`MAX_RANKS`.

    Raises:
        UsageError: the variable is set but not a positive integer.
    """
    return _env_int("ADAPTDIST_MAX_RANKS", MAX_RANKS)


def max_local_ranks() -> int:
    """The largest ``--nproc`` allowed now: ``ADAPTDIST_MAX_LOCAL_RANKS`` or :data:`MAX_LOCAL_RANKS`.

    Raises:
        UsageError: the variable is set but not a positive integer.
    """
    return _env_int("ADAPTDIST_MAX_LOCAL_RANKS", MAX_LOCAL_RANKS)


def rank_limit_message(n: int, what: str, local: bool = False) -> str:
    """The one-line refusal of ``n`` ranks (``what`` names the file and field or the flag)."""
    if local:
        return (f"{what + ' ' if what else ''}asks for {n} local ranks, over the limit of {max_local_ranks()} ranks on one machine "
                f"(ADAPTDIST_MAX_LOCAL_RANKS); a host with that many cores may raise it, e.g. "
                f"ADAPTDIST_MAX_LOCAL_RANKS={n} (planning time grows with the ranks: README, Trust and limits)")
    return (f"{what} gives {n} ranks, over the limit of {max_ranks()} ranks (ADAPTDIST_MAX_RANKS); for a real "
            f"cluster that large set ADAPTDIST_MAX_RANKS={n} (planning time grows with the ranks: README, "
            f"Trust and limits)")


def check_ranks(n: int, what: str, local: bool = False) -> None:
    """Refuse ``n`` ranks over :func:`max_ranks` (``local``: :func:`max_local_ranks`), before any work.

    Raises:
        ClusterSpecError: too many ranks; the message names ``what``, the limit and how to raise it.
    """
    from .errors import ClusterSpecError

    limit = max_local_ranks() if local else max_ranks()
    if n > limit:
        raise ClusterSpecError(rank_limit_message(n, what, local))


def check_batch_items(batch_size: int | None, seq_len: int | None) -> None:
    """Refuse ``--batch-size`` x ``--seq-len`` over :data:`MAX_BATCH_ITEMS` before the example batch is built.

    Raises:
        UsageError: names both flags and the limit.
    """
    from .errors import UsageError

    if batch_size is not None and seq_len is not None and batch_size * seq_len > MAX_BATCH_ITEMS:
        raise UsageError(f"--batch-size {batch_size} x --seq-len {seq_len} = {batch_size * seq_len:,} items, over the "
                         f"limit of {MAX_BATCH_ITEMS:,} (2**28) that one example batch may hold (adaptdist/limits.py)")


def figure_bounds(path: str) -> tuple[float, float] | None:
    """The allowed range of the cluster-file field at ``path`` (e.g. ``hosts[0].devices[1].peak_flops.float32``),
    or None when :data:`FIGURE_BOUNDS` states none."""
    parts = path.replace("]", "").split(".")
    for key in (parts[-1], parts[-2] if len(parts) > 1 else ""):
        if key in FIGURE_BOUNDS:
            return FIGURE_BOUNDS[key]
    return None


def out_of_bounds(path: str, v: float) -> str | None:
    """Why ``v`` is not allowed at ``path`` (None: it is within :func:`figure_bounds`, or none are stated)."""
    b = figure_bounds(path)
    if b is None:
        return None
    lo, hi = b
    if not math.isfinite(v) or v < lo or v > hi:
        return f"is {v!r}, outside the range this field allows, {lo:g} to {hi:g} (adaptdist/limits.py)"
    return None
