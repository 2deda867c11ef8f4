"""Pinning a rank process to the CPU cores its cluster-file device names (``cpus: [0]``).

Called in the rank process before torch starts its intra-op threads (the worker, ``cluster profile``'s ranks):
``os.sched_setaffinity(0, cpus)`` then ``torch.set_num_threads(len(cpus))``. Two ranks pinned to one core share
it, so each computes at about half its speed: the heterogeneity ``benchmarks/bench_hetero.py`` measures.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..errors import ClusterSpecError


def available_cpus() -> tuple[int, ...]:
    """The core ids this process may run on (``os.sched_getaffinity``; all cores where the OS has no affinity)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def pin_to_cpus(cpus: Sequence[int] | None, rank: int, *, set_threads: bool = True) -> int | None:
    """Pin this process to ``cpus`` and set torch's thread count to ``len(cpus)``; returns that count (None:
    ``cpus`` is None, nothing changed).

    Raises:
        ClusterSpecError: a core id this process cannot run on (names the rank, the cores and the ones available),
            or an OS without ``sched_setaffinity``.
    """
    if cpus is None:
        return None
    want = tuple(int(c) for c in cpus)
    have = available_cpus()
    bad = sorted(set(want) - set(have))
    if bad:
        raise ClusterSpecError(f"rank {rank}: the cluster file pins it to cpus {list(want)}, but cores {bad} are not "
                               f"available to this process (available: {list(have)}); edit that device's 'cpus'")
    if not hasattr(os, "sched_setaffinity"):
        raise ClusterSpecError(f"rank {rank}: the cluster file pins it to cpus {list(want)}, but this OS has no "
                               "sched_setaffinity; drop 'cpus' from the cluster file")
    try:
        os.sched_setaffinity(0, want)
    except OSError as e:
        raise ClusterSpecError(f"rank {rank}: cannot pin to cpus {list(want)}: {e.strerror or e}") from None
    if set_threads:
        import torch

        torch.set_num_threads(len(want))
    return len(want)


def cpus_of_ranks(cluster, rank_to_device: Sequence[int] | None = None) -> tuple[tuple[int, ...] | None, ...]:
    """For each program rank ``r``, the ``cpus`` of the device it runs on (``rank_to_device[r]``; None: device
    ``r``), or None where that device is not pinned. Empty when no device is pinned."""
    n = cluster.world_size
    mapping = tuple(rank_to_device) if rank_to_device is not None else tuple(range(n))
    out = tuple(cluster.device(mapping[r]).cpus for r in range(n))
    return out if any(c is not None for c in out) else ()
