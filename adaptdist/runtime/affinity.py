"""Pinning a rank process to the CPU cores its cluster-file device names (``cpus: [0]``).

Called in the rank process before torch starts its intra-op threads (the worker, ``cluster profile``'s ranks):
``os.sched_setaffinity(0, cpus)`` then ``torch.set_num_threads(len(cpus))``. Two ranks pinned to one core share
it, so each computes at about half its speed: the heterogeneity ``benchmarks/bench_hetero.py`` measures.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from ..errors import ClusterSpecError, DeviceUnavailableError

LOOPBACK_HOST_NAMES = ("localhost", "127.0.0.1", "::1")
"""Host names that always mean this machine (besides its own ``socket.gethostname()``)."""


def is_this_host(name: str) -> bool:
    """Whether a cluster file's host ``name`` is this machine: ``localhost``, a loopback address, or this machine's
    host name (the names ``adaptdist train`` launches ranks for; any other names another host)."""
    return name in LOOPBACK_HOST_NAMES or name == socket.gethostname()


def available_cpus() -> tuple[int, ...]:
    """The core ids this process may run on (``os.sched_getaffinity``; all cores where the OS has no affinity)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def online_cpus() -> tuple[int, ...]:
    """The core ids this machine has online (``/sys/devices/system/cpu/online``; else ``range(os.cpu_count())``),
    whatever this process's own affinity (a rank already pinned to one core still sees the others)."""
    try:
        text = open("/sys/devices/system/cpu/online").read().strip()
        cores: list[int] = []
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cores.extend(range(int(lo), int(hi or lo) + 1))
        if cores:
            return tuple(sorted(cores))
    except (OSError, ValueError):
        pass
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


def check_local_cpus(cluster, source: str) -> None:
    """That every ``cpus`` core id of a device on this machine's hosts (:func:`is_this_host`) exists on this machine
    (:func:`online_cpus`: not this process's affinity, which an already pinned rank loading the file has narrowed),
    when the cluster file ``source`` is loaded: a missing core is refused here, by plan,
    estimate, compile and train alike, not first at launch. Devices of other hosts are not checked (their cores are
    not visible from here).

    Raises:
        DeviceUnavailableError: names the file, the device (rank, host, field), its cpus, the missing cores and the
            cores available.
    """
    have = online_cpus()
    for i, h in enumerate(cluster.hosts):
        if not is_this_host(h.name):
            continue
        for j, d in enumerate(h.devices):
            bad = sorted(set(d.cpus or ()) - set(have))
            if bad:
                raise DeviceUnavailableError(
                    f"cluster file {source!r}: device {d.rank} (field 'hosts[{i}].devices[{j}].cpus', host {h.name!r}, "
                    f"this machine) pins its rank to cpus {list(d.cpus)}, but core{'s' if len(bad) > 1 else ''} "
                    f"{', '.join(map(str, bad))} {'do' if len(bad) > 1 else 'does'} not exist on this machine: the "
                    f"cores online here are {_ranges(have)} ({len(have)}). Edit that device's 'cpus' to cores "
                    "among those, or drop 'cpus'")


def _ranges(cores: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for c in cores:
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ", ".join(out)


def cpus_of_ranks(cluster, rank_to_device: Sequence[int] | None = None) -> tuple[tuple[int, ...] | None, ...]:
    """For each program rank ``r``, the ``cpus`` of the device it runs on (``rank_to_device[r]``; None: device
    ``r``), or None where that device is not pinned. Empty when no device is pinned."""
    n = cluster.world_size
    mapping = tuple(rank_to_device) if rank_to_device is not None else tuple(range(n))
    out = tuple(cluster.device(mapping[r]).cpus for r in range(n))
    return out if any(c is not None for c in out) else ()
