"""What the cost models need to know about the machines, as a small Protocol.

The cost models read a cluster only through :class:`ClusterLike`::

    cluster.world_size -> int
    cluster.device(rank) -> DeviceLike       # peak_flops by dtype name, memory, memory bandwidth,
                                             # optionally op_overhead_s (host time per dispatched op)
    cluster.link(rank_a, rank_b) -> LinkLike # tier, bandwidth_bytes_per_s, latency_s
    cluster.collective_fit(collective, tier) -> CollectiveFitLike | None   # calibrated alpha, beta

:class:`adaptdist.cluster.Cluster` implements it; :class:`FixedCluster` is a plain-number
implementation for tests and for describing a hypothetical machine. :func:`as_cost_cluster`
accepts either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence, runtime_checkable

from ..cluster import TIERS
from ..errors import ClusterSpecError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")
"""Collective names a :class:`CollectiveFitLike` may be asked for."""


class DeviceLike(Protocol):
    """One rank's device: ``peak_flops`` maps a dtype name (``"float32"``) to FLOP/s.

    A device may also have ``op_overhead_s`` (seconds of host time per dispatched op, None or absent:
    0); the cost models read it with :func:`op_overhead_s`, so older device objects keep working.
    """

    rank: int
    host: str
    kind: str
    peak_flops: Mapping[str, float]
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float


class LinkLike(Protocol):
    """The path between two ranks: ``tier`` is ``"intra_host"`` or ``"inter_host"``."""

    tier: str
    bandwidth_bytes_per_s: float
    latency_s: float


class CollectiveFitLike(Protocol):
    """Calibrated alpha-beta fit of one collective on one link tier: the whole collective takes
    ``alpha_s + beta_s_per_byte * n`` seconds for ``n`` bytes (nccl-tests sizes: see
    :mod:`.communication`), measured on ``num_ranks`` ranks when the object has that attribute.
    :func:`.communication.link_cost` rescales it to other group sizes with the ring formula."""

    alpha_s: float
    beta_s_per_byte: float


@runtime_checkable
class ClusterLike(Protocol):
    """The interface the cost models read (see the module docstring)."""

    @property
    def world_size(self) -> int: ...

    def device(self, rank: int) -> DeviceLike: ...

    def link(self, rank_a: int, rank_b: int) -> LinkLike: ...

    def collective_fit(self, collective: str, tier: str) -> CollectiveFitLike | None: ...


@dataclass(frozen=True)
class DeviceFigures:
    """A device as plain numbers (implements :class:`DeviceLike`)."""

    rank: int
    host: str
    kind: str
    peak_flops: Mapping[str, float]
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    op_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.op_overhead_s < 0:
            raise ClusterSpecError(f"device of rank {self.rank}: op_overhead_s must be >= 0, got {self.op_overhead_s}")
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ClusterSpecError(f"device of rank {self.rank}: peak_flops must map dtype names to positive "
                                   f"FLOP/s, got {dict(self.peak_flops)!r}")
        if self.memory_bandwidth_bytes_per_s <= 0 or self.memory_bytes <= 0:
            raise ClusterSpecError(f"device of rank {self.rank}: memory_bytes and memory_bandwidth_bytes_per_s "
                                   "must be positive")


@dataclass(frozen=True)
class LinkFigures:
    """A link as plain numbers (implements :class:`LinkLike`)."""

    tier: str
    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ClusterSpecError(f"link tier {self.tier!r} is not one of {TIERS}")
        if self.bandwidth_bytes_per_s <= 0 or self.latency_s < 0:
            raise ClusterSpecError(f"{self.tier} link: bandwidth must be > 0 and latency >= 0, got "
                                   f"{self.bandwidth_bytes_per_s} B/s, {self.latency_s} s")


@dataclass(frozen=True)
class AlphaBeta:
    """A calibrated whole-collective fit as plain numbers (implements :class:`CollectiveFitLike`),
    measured on ``num_ranks`` ranks (None: on the group it is used for)."""

    alpha_s: float
    beta_s_per_byte: float
    num_ranks: int | None = None


# Default figures, used only when a cluster object does not describe its devices.
# CPU: gloo all_reduce measured on the 2-core development machine (DESIGN.md: 16 MiB in
# 11.4 ms on 2 ranks -> 1.47 GB/s; a tiny all_reduce 0.2 ms = 2 alpha on 2 ranks);
# 50 GFLOP/s float32 and 10 GB/s per rank are one AVX2 core's order of magnitude.
# CUDA: NVIDIA A100 80GB datasheet (19.5 TFLOP/s fp32, 312 bf16/fp16 tensor core, 2.0 TB/s
# HBM2e); NVLink 3 ~ 300 GB/s per direction, shared by the ring: 100 GB/s effective.
_DEFAULT_DEVICE = {
    "cpu": ({"float32": 5e10, "float64": 2.5e10, "bfloat16": 1.25e10, "float16": 1.25e10}, 8 * 2**30, 1e10),
    "cuda": ({"float32": 19.5e12, "float64": 9.7e12, "bfloat16": 312e12, "float16": 312e12}, 80 * 10**9, 2.0e12),
}
_DEFAULT_LINK = {
    ("cpu", "intra_host"): (1.47e9, 1e-4), ("cpu", "inter_host"): (1.25e9, 5e-5),
    ("cuda", "intra_host"): (1.0e11, 1e-5), ("cuda", "inter_host"): (1.25e10, 1e-5),
}


# adaptdist's shared-memory collectives (CPU ranks of one host, --comm auto|shm), per message of the ring formulas,
# used where the cluster has no measured "shm" fit (not profiled with the kernels): 2 GB/s and 20 us, the slow side
# of benchmarks/RESULTS.md's quiet-machine all_reduce (2 ranks: 4 KiB 8.5 us = 2 alpha, 16 MiB 5.5 ms = 3.1 GB/s;
# 4 ranks: 4 KiB 62 us = 6 alpha, 16 MiB 11.1 ms = 2.3 GB/s).
_DEFAULT_SHM_LINK = {"cpu": (2.0e9, 2e-5)}


def default_shm_link(kind: str) -> LinkFigures | None:
    """The estimated per-message figures of adaptdist's shared-memory collectives among ``kind`` ranks of one host
    (None where the kernels do not apply: they move CPU tensors)."""
    figures = _DEFAULT_SHM_LINK.get(kind)
    return LinkFigures("intra_host", *figures) if figures is not None else None


@dataclass(frozen=True)
class FixedCluster:
    """A cluster given as plain numbers (implements :class:`ClusterLike`).

    Attributes:
        devices: one :class:`DeviceFigures` per rank, in rank order.
        intra_host: the link between two ranks on the same host.
        inter_host: the link between ranks on different hosts.
        fits: ``(collective, tier) -> AlphaBeta`` calibrated fits (absent: use the link).

    Raises:
        ClusterSpecError: no devices, or devices out of rank order.
    """

    devices: tuple[DeviceFigures, ...]
    intra_host: LinkFigures
    inter_host: LinkFigures
    fits: Mapping[tuple[str, str], AlphaBeta] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.devices:
            raise ClusterSpecError("a cluster needs at least one device")
        if [d.rank for d in self.devices] != list(range(len(self.devices))):
            raise ClusterSpecError(f"devices must be listed in rank order 0..{len(self.devices) - 1}")

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def device(self, rank: int) -> DeviceFigures:
        if not 0 <= rank < len(self.devices):
            raise ClusterSpecError(f"rank {rank} is outside this cluster of {len(self.devices)} ranks")
        return self.devices[rank]

    def link(self, rank_a: int, rank_b: int) -> LinkFigures:
        return self.intra_host if self.device(rank_a).host == self.device(rank_b).host else self.inter_host

    def collective_fit(self, collective: str, tier: str) -> AlphaBeta | None:
        return self.fits.get((collective, tier))

    def __repr__(self) -> str:
        hosts: dict[str, int] = {}
        for d in self.devices:
            hosts[d.host] = hosts.get(d.host, 0) + 1
        return "FixedCluster(" + ", ".join(f"{h}:{n}x{self.devices[0].kind}" for h, n in hosts.items()) + ")"

    @staticmethod
    def uniform(hosts: Sequence[tuple[str, int]], kind: str = "cpu", *, peak_flops: Mapping[str, float] | None = None,
                memory_bytes: int | None = None, memory_bandwidth_bytes_per_s: float | None = None,
                op_overhead_s: float = 0.0) -> "FixedCluster":
        """Identical devices of ``kind`` on ``hosts`` (name, devices per host), default figures unless given
        (``op_overhead_s``: seconds per dispatched op, default 0).

        Raises:
            ClusterSpecError: an unknown ``kind`` (cpu, cuda) or a non-positive figure.
        """
        if kind not in _DEFAULT_DEVICE:
            raise ClusterSpecError(f"device kind {kind!r} has no default figures; use one of {sorted(_DEFAULT_DEVICE)}")
        flops, mem, bw = _DEFAULT_DEVICE[kind]
        devices, rank = [], 0
        for host, n in hosts:
            for _ in range(n):
                devices.append(DeviceFigures(rank, host, kind, dict(peak_flops or flops), memory_bytes or mem,
                                             memory_bandwidth_bytes_per_s or bw, op_overhead_s))
                rank += 1
        intra, inter = (LinkFigures(t, *_DEFAULT_LINK[(kind, t)]) for t in TIERS)
        return FixedCluster(tuple(devices), intra, inter)


def op_overhead_s(device: object) -> float:
    """Seconds of host time one dispatched op costs on ``device`` beyond its roofline time: the device's
    ``op_overhead_s`` (measured by ``adaptdist cluster profile``), 0 when it has none."""
    v = getattr(device, "op_overhead_s", None)
    return float(v) if v is not None else 0.0


def as_cost_cluster(cluster: object) -> ClusterLike:
    """``cluster`` itself, checked to implement :class:`ClusterLike` (``adaptdist.cluster.Cluster`` and
    :class:`FixedCluster` do).

    Raises:
        ClusterSpecError: the object lacks device()/link()/collective_fit().
    """
    if all(callable(getattr(cluster, m, None)) for m in ("device", "link", "collective_fit")):
        return cluster  # type: ignore[return-value]
    raise ClusterSpecError(f"{cluster!r} is not a cluster: it lacks device(), link() or collective_fit(); "
                           "load one with adaptdist.calibrate.local.load_cluster or build it with local_cluster")
