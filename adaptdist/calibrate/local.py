"""This machine's ranks as a cluster with estimated (uncalibrated) figures, and cluster files loaded
with them: the figures :class:`adaptdist.cluster.Cluster` takes, from :mod:`.hardware`'s estimates.

``adaptdist cluster detect`` (:mod:`.detect`) reads the real devices; ``adaptdist cluster profile``
(:mod:`.profile`) measures the figures.
"""

from __future__ import annotations

import os

from .. import cluster_file, limits
from ..cluster import Cluster, Device, Host, Link, _check_kind
from ..errors import ClusterSpecError
from . import hardware


def uniform_host(name: str, device_kind: str, num_devices: int, first_rank: int = 0) -> Host:
    """``num_devices`` devices of one kind with estimated default figures (see :func:`local_cluster`).

    Raises:
        ClusterSpecError: unknown kind, or ``num_devices`` is not a positive integer.
    """
    _check_kind(device_kind, f"host {name!r}")
    if not isinstance(num_devices, int) or isinstance(num_devices, bool) or num_devices < 1:
        raise ClusterSpecError(f"host {name!r}: num_devices must be a positive integer, got {num_devices!r}")
    if device_kind == "cpu":
        fig = hardware.cpu_rank_figures(hardware.cpu_info(), num_devices)
    else:
        fig = hardware.cuda_figures()
    return Host(name, tuple(
        Device(first_rank + i, name, device_kind, fig.peak_flops, fig.memory_bytes,
               fig.memory_bandwidth_bytes_per_s, fig.cores, fig.op_overhead_s)
        for i in range(num_devices)))


def default_links(hosts: tuple[Host, ...]) -> tuple[Link, ...]:
    """Tier-default links (estimated) for every tier the hosts need; the slowest device kind sets them."""
    kinds = frozenset(d.kind for h in hosts for d in h.devices)
    links = []
    if any(h.num_devices > 1 for h in hosts):
        links.append(Link("intra_host", *hardware.default_link("intra_host", kinds)))
    if len(hosts) > 1:
        links.append(Link("inter_host", *hardware.default_link("inter_host", kinds)))
    return tuple(links)


def local_cluster(nproc: int, device_kind: str = "cpu") -> Cluster:
    """N local ranks on this machine, with estimated (uncalibrated) figures.

    CPU ranks share the machine's cores and memory evenly (see
    :func:`adaptdist.calibrate.hardware.cpu_rank_figures`); CUDA ranks get datasheet figures
    of an A100-80GB (use ``adaptdist cluster detect`` to read the real devices).

    Raises:
        ClusterSpecError: ``nproc`` is not a positive integer, or the kind is unknown.
    """
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ClusterSpecError(
            f"--nproc must be a positive number of local ranks, got {nproc!r}; try --nproc 2"
        )
    _check_kind(device_kind, "local_cluster")
    limits.check_ranks(nproc, "--nproc (or the mesh's world size)", local=True)
    hosts = (uniform_host("localhost", device_kind, nproc),)
    return Cluster(hosts, default_links(hosts))


def estimated_cluster(hosts: tuple[tuple[str, str, int], ...]) -> Cluster:
    """``((name, device_kind, num_devices), ...)`` as a cluster, ranks numbered in host order, each host's
    devices with :func:`uniform_host`'s estimated figures and :func:`default_links` (what a schema version 1
    cluster file means).

    Raises:
        ClusterSpecError: an unknown kind, or a count that is not a positive integer.
    """
    parsed, rank = [], 0
    for name, kind, n in hosts:
        parsed.append(uniform_host(name, kind, n, rank))
        rank += n
    built = tuple(parsed)
    return Cluster(built, default_links(built))


def load_cluster(path: str | os.PathLike) -> Cluster:
    """:func:`adaptdist.cluster_file.load_cluster`, schema version 1 files getting this machine's estimated
    figures (:func:`estimated_cluster`).

    The ``cpus`` of this machine's devices are checked against the cores that exist here
    (:func:`~adaptdist.runtime.affinity.check_local_cpus`), so that plan, estimate, compile and train refuse a
    missing core alike, before any work.

    Raises:
        ClusterSpecError: as :func:`adaptdist.cluster_file.load_cluster`.
        DeviceUnavailableError: a device of this machine pinned to a core that does not exist here.
    """
    from ..runtime.affinity import check_local_cpus

    cluster = cluster_file.load_cluster(path, estimated_cluster)
    check_local_cpus(cluster, str(path))
    return cluster


def uncalibrated_note(cluster: Cluster) -> str | None:
    """What a prediction on ``cluster`` must say when its figures are this module's defaults, not measured
    (None when the cluster is calibrated): which kind of defaults, and the command that measures them."""
    if getattr(cluster, "calibrated", False):
        return None
    kind = cluster.device(0).kind
    how = ("chosen to err on the slow side on an otherwise idle machine (1.0-1.5x the measured step of the "
           "built-in GPT on 2 cores; other jobs on the cores make steps slower still)"
           if kind == "cpu" else "datasheet peaks, so expect real steps to be slower")
    return (f"uncalibrated: these are default figures for {kind} ranks, {how}; for measured ones run "
            f"`adaptdist cluster profile --nproc {cluster.world_size} --out cluster.yaml` on the machine and pass "
            "--cluster cluster.yaml")
