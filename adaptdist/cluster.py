"""The cluster: the ranks a job runs on, how fast they compute and how they communicate.

A cluster file is YAML (or JSON, which YAML reads too). Schema version 2::

    schema_version: 2
    hosts:
      - name: localhost
        devices:                      # one entry per rank; ranks are 0..N-1, each once
          - rank: 0
            kind: cpu                 # cpu (gloo) or cuda (nccl); kinds may mix
            cores: 1.0                # cpu only, optional: this rank's share of the host's cores
            peak_flops: {float32: 1.6e+11, bfloat16: 2.56e+12}   # FLOP/s per dtype; float32 required
            memory_bytes: 12637208576
            memory_bandwidth_bytes_per_s: 1.0e+10
            op_overhead_s: 3.5e-6     # optional: host time of one dispatched op call (measured by profile)
          - {rank: 1, kind: cpu, cores: 1.0, peak_flops: {float32: 1.6e+11},
             memory_bytes: 12637208576, memory_bandwidth_bytes_per_s: 1.0e+10}
    links:
      # a tier default covers every pair of ranks of that tier:
      # intra_host = two ranks on one host, inter_host = ranks on two hosts
      - {tier: intra_host, bandwidth_bytes_per_s: 1.5e+9, latency_s: 2.0e-4}
      # a pair entry overrides its tier's default for one pair (its tier is implied)
      - {ranks: [0, 1], bandwidth_bytes_per_s: 2.0e+9, latency_s: 1.5e-4}
    calibration: null                 # null: every figure is an estimate (`adaptdist cluster detect`)

Every tier that occurs in the cluster needs a default or a pair entry for each of its
pairs. ``adaptdist cluster profile`` writes measured figures and a ``calibration``
block with the alpha-beta fit of each collective per link tier::

    calibration:
      measured_at: '2025-01-01T12:00:00+00:00'
      backend: gloo
      torch_version: 2.13.0+cpu
      wall_s: 41.2
      collectives:
        intra_host:
          all_reduce: {alpha_s: 1.9e-4, beta_s_per_byte: 6.8e-10, num_ranks: 2, rms_rel_error: 0.08}
          # all_gather, reduce_scatter, all_to_all, send_recv likewise

Numbers may be written ``1.5e9`` (YAML 1.2 style) as well as ``1.5e+9``.

Schema version 1 files (``hosts: [{name, device_kind, num_devices}]``) still load: their
devices get the same estimated figures as :meth:`Cluster.local` (this machine's cores
and memory, shared among the host's ranks) and default links.

Messages in bytes: for a collective, ``nbytes`` is the size of the *whole* tensor on
one rank, as in nccl-tests' PERFORMANCE.md: all_reduce its input, all_gather its
(gathered) output, reduce_scatter its (unscattered) input, all_to_all its input (what one
rank sends and keeps), send_recv the message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ClusterSpecError

SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
DEVICE_KINDS: Mapping[str, str] = {"cpu": "gloo", "cuda": "nccl"}
"""Device kind -> the torch.distributed backend that launches it."""
TIERS = ("intra_host", "inter_host")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8")
"""dtype names (torch's) that ``peak_flops`` may be keyed by."""


class FrozenMap(Mapping):
    """An immutable, hashable mapping (what a frozen dataclass holds instead of a dict)."""

    __slots__ = ("_d",)

    def __init__(self, items: Mapping | None = None) -> None:
        object.__setattr__(self, "_d", dict(items or {}))

    def __getitem__(self, key):
        return self._d[key]

    def __iter__(self) -> Iterator:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        return hash(frozenset(self._d.items()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._d) == dict(other)

    def __setattr__(self, name, value):
        raise AttributeError("FrozenMap is immutable")

    def __reduce__(self):
        return (FrozenMap, (self._d,))

    def __repr__(self) -> str:
        return f"FrozenMap({self._d!r})"


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_kind(kind: object, what: str) -> None:
    if kind not in DEVICE_KINDS:
        raise ClusterSpecError(
            f"{what}: device_kind {kind!r} is not one of {sorted(DEVICE_KINDS)} "
            "(cpu ranks use gloo, cuda ranks nccl)")


# --- value objects -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    """One rank's device.

    On a CPU host a device is a rank with its share of the host's cores (``cores``).

    Attributes:
        rank: global rank, 0..world_size-1.
        host: name of the host it is on.
        kind: ``"cpu"`` or ``"cuda"``.
        peak_flops: FLOP/s per dtype name (``"float32"``, ``"bfloat16"``, ...); ``float32``
            always present. Conservative estimates when the cluster is uncalibrated, measured
            matmul rates (all ranks busy at once) after ``adaptdist cluster profile``.
        memory_bytes: memory this rank may use, bytes.
        memory_bandwidth_bytes_per_s: memory bandwidth, bytes/s (measured: elementwise add).
        cores: CPU cores this rank has (may be below 1 when ranks outnumber cores); None on cuda.
        op_overhead_s: seconds of host time one dispatched ATen op call costs beyond its arithmetic and
            memory traffic (Python + dispatcher + output allocation of a tiny op), all ranks busy at once;
            measured by ``adaptdist cluster profile`` on CPU; None: unknown (the cost models then count 0).

    Raises:
        ClusterSpecError: a field is missing its allowed form (message names the rank).
    """

    rank: int
    host: str
    kind: str
    peak_flops: Mapping[str, float]
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    cores: float | None = None
    op_overhead_s: float | None = None

    def __post_init__(self) -> None:
        who = f"device rank {self.rank!r}"
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ClusterSpecError(f"{who}: rank must be an integer >= 0")
        if not isinstance(self.host, str) or not self.host:
            raise ClusterSpecError(f"{who}: host must be a non-empty host name, got {self.host!r}")
        _check_kind(self.kind, who)
        if not isinstance(self.peak_flops, Mapping) or "float32" not in self.peak_flops:
            raise ClusterSpecError(f"{who}: peak_flops must map dtype names to FLOP/s and include float32, "
                                   f"got {self.peak_flops!r}")
        for dt, v in self.peak_flops.items():
            if dt not in DTYPES:
                raise ClusterSpecError(f"{who}: peak_flops has unknown dtype {dt!r}; allowed: {', '.join(DTYPES)}")
            if not _is_number(v) or v <= 0:
                raise ClusterSpecError(f"{who}: peak_flops[{dt}] must be a positive number of FLOP/s, got {v!r}")
        object.__setattr__(self, "peak_flops", FrozenMap({k: float(v) for k, v in self.peak_flops.items()}))
        if not isinstance(self.memory_bytes, int) or isinstance(self.memory_bytes, bool) or self.memory_bytes <= 0:
            raise ClusterSpecError(f"{who}: memory_bytes must be a positive integer, got {self.memory_bytes!r}")
        if not _is_number(self.memory_bandwidth_bytes_per_s) or self.memory_bandwidth_bytes_per_s <= 0:
            raise ClusterSpecError(f"{who}: memory_bandwidth_bytes_per_s must be a positive number of bytes/s, "
                                   f"got {self.memory_bandwidth_bytes_per_s!r}")
        if self.cores is not None and (not _is_number(self.cores) or self.cores <= 0):
            raise ClusterSpecError(f"{who}: cores must be a positive number (or absent), got {self.cores!r}")
        if self.op_overhead_s is not None and (not _is_number(self.op_overhead_s) or self.op_overhead_s < 0):
            raise ClusterSpecError(f"{who}: op_overhead_s must be a number of seconds >= 0 (or absent), "
                                   f"got {self.op_overhead_s!r}")

    def __repr__(self) -> str:
        return (f"Device(rank={self.rank}, {self.kind} on {self.host}, "
                f"{self.peak_flops['float32']:.3g} float32 FLOP/s, {self.memory_bytes / 2**30:.1f} GiB)")


@dataclass(frozen=True)
class Link:
    """Point-to-point figures between two ranks: time(n bytes) = latency_s + n / bandwidth_bytes_per_s
    (Hockney 1994, "The communication challenge for MPP").

    Attributes:
        tier: ``"intra_host"`` (both ranks on one host) or ``"inter_host"``.
        bandwidth_bytes_per_s: bytes/s, > 0.
        latency_s: seconds, >= 0.
        ranks: the pair ``(a, b)``, a < b, for a per-pair entry; None for the tier's default.

    Raises:
        ClusterSpecError: unknown tier, non-positive bandwidth, negative latency, bad pair.
    """

    tier: str
    bandwidth_bytes_per_s: float
    latency_s: float
    ranks: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ClusterSpecError(f"link: tier {self.tier!r} is not one of {list(TIERS)}")
        if not _is_number(self.bandwidth_bytes_per_s) or self.bandwidth_bytes_per_s <= 0:
            raise ClusterSpecError(f"link {self.tier}: bandwidth_bytes_per_s must be a positive number of bytes/s, "
                                   f"got {self.bandwidth_bytes_per_s!r}")
        if not _is_number(self.latency_s) or self.latency_s < 0:
            raise ClusterSpecError(f"link {self.tier}: latency_s must be a number of seconds >= 0, "
                                   f"got {self.latency_s!r}")
        if self.ranks is not None:
            r = tuple(self.ranks)
            if (len(r) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in r)
                    or r[0] == r[1]):
                raise ClusterSpecError(f"link: ranks must be two different ranks [a, b], got {self.ranks!r}")
            object.__setattr__(self, "ranks", (min(r), max(r)))

    def time_s(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` bytes over this link: latency_s + nbytes / bandwidth_bytes_per_s."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class CollectiveFit:
    """Measured alpha-beta model of one collective on one link tier:
    time(n) = alpha_s + beta_s_per_byte * n, n = bytes of the whole tensor on one rank (see the
    module docstring); Hockney 1994. Fitted on ``num_ranks`` ranks: the ring formulas of Thakur,
    Rabenseifner & Gropp 2005 (all_reduce: 2(p-1)/p n beta; all_gather / reduce_scatter:
    (p-1)/p n beta) rescale it to another rank count.

    Attributes:
        alpha_s: fixed cost, seconds, >= 0.
        beta_s_per_byte: seconds per byte, > 0 (1 / the algorithm bandwidth).
        num_ranks: ranks it was measured on (None: unknown).
        rms_rel_error: root-mean-square relative residual of the fit (None: unknown).
    """

    alpha_s: float
    beta_s_per_byte: float
    num_ranks: int | None = None
    rms_rel_error: float | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.alpha_s) or self.alpha_s < 0:
            raise ClusterSpecError(f"collective fit: alpha_s must be a number of seconds >= 0, got {self.alpha_s!r}")
        if not _is_number(self.beta_s_per_byte) or self.beta_s_per_byte <= 0:
            raise ClusterSpecError(f"collective fit: beta_s_per_byte must be a positive number of s/byte, "
                                   f"got {self.beta_s_per_byte!r}")
        if self.num_ranks is not None and (not isinstance(self.num_ranks, int) or isinstance(self.num_ranks, bool)
                                           or self.num_ranks < 1):
            raise ClusterSpecError(f"collective fit: num_ranks must be a positive integer, got {self.num_ranks!r}")
        if self.rms_rel_error is not None and (not _is_number(self.rms_rel_error) or self.rms_rel_error < 0):
            raise ClusterSpecError(f"collective fit: rms_rel_error must be a number >= 0, got {self.rms_rel_error!r}")

    def time_s(self, nbytes: float) -> float:
        """Predicted seconds for a message of ``nbytes`` bytes: alpha_s + beta_s_per_byte * nbytes."""
        return self.alpha_s + self.beta_s_per_byte * nbytes

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Asymptotic algorithm bandwidth, bytes/s: 1 / beta_s_per_byte."""
        return 1.0 / self.beta_s_per_byte


@dataclass(frozen=True)
class Calibration:
    """What ``adaptdist cluster profile`` measured.

    Attributes:
        collectives: {(tier, collective): CollectiveFit}.
        measured_at: ISO 8601 time of the measurement.
        backend: torch.distributed backend used (gloo, nccl).
        torch_version: torch version used.
        wall_s: seconds the profile took.
    """

    collectives: Mapping[tuple[str, str], CollectiveFit] = field(default_factory=FrozenMap)
    measured_at: str = ""
    backend: str = ""
    torch_version: str = ""
    wall_s: float | None = None

    def __post_init__(self) -> None:
        for key, fit in dict(self.collectives).items():
            if not (isinstance(key, tuple) and len(key) == 2 and key[0] in TIERS and key[1] in COLLECTIVES):
                raise ClusterSpecError(f"calibration: collective key {key!r} must be (tier, collective) with tier in "
                                       f"{list(TIERS)} and collective in {list(COLLECTIVES)}")
            if not isinstance(fit, CollectiveFit):
                raise ClusterSpecError(f"calibration: {key!r} must be a CollectiveFit, got {type(fit).__name__}")
        object.__setattr__(self, "collectives", FrozenMap(self.collectives))
        if self.wall_s is not None and (not _is_number(self.wall_s) or self.wall_s < 0):
            raise ClusterSpecError(f"calibration: wall_s must be a number of seconds >= 0, got {self.wall_s!r}")


@dataclass(frozen=True)
class Host:
    """One machine and the devices (ranks) on it."""

    name: str
    devices: tuple[Device, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ClusterSpecError(f"host: name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "devices", tuple(self.devices))
        if not self.devices:
            raise ClusterSpecError(f"host {self.name!r}: must have at least one device")
        for d in self.devices:
            if not isinstance(d, Device):
                raise ClusterSpecError(f"host {self.name!r}: devices must be Device objects, got {type(d).__name__}")
            if d.host != self.name:
                raise ClusterSpecError(f"host {self.name!r}: device rank {d.rank} says it is on host {d.host!r}")

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(d.rank for d in self.devices)

    @property
    def device_kinds(self) -> tuple[str, ...]:
        """The device kinds on this host, sorted."""
        return tuple(sorted({d.kind for d in self.devices}))

    @property
    def device_kind(self) -> str:
        """The one device kind of this host.

        Raises:
            ClusterSpecError: the host has devices of several kinds.
        """
        kinds = self.device_kinds
        if len(kinds) > 1:
            raise ClusterSpecError(f"host {self.name!r} has devices of kinds {list(kinds)}; ask each device its kind")
        return kinds[0]

    @staticmethod
    def uniform(name: str, device_kind: str, num_devices: int, first_rank: int = 0) -> "Host":
        """``num_devices`` devices of one kind with estimated default figures (see :meth:`Cluster.local`).

        Raises:
            ClusterSpecError: unknown kind, or ``num_devices`` is not a positive integer.
        """
        from .calibrate import hardware

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
    from .calibrate import hardware

    kinds = frozenset(d.kind for h in hosts for d in h.devices)
    links = []
    if any(h.num_devices > 1 for h in hosts):
        links.append(Link("intra_host", *hardware.default_link("intra_host", kinds)))
    if len(hosts) > 1:
        links.append(Link("inter_host", *hardware.default_link("inter_host", kinds)))
    return tuple(links)


@dataclass(frozen=True)
class Cluster:
    """A frozen description of the ranks of a job, their devices and the links between them.

    Ranks are 0..world_size-1, each on exactly one host. Heterogeneous clusters (cpu and cuda
    devices) are described fully; a runtime that launches one backend refuses them through
    :attr:`backend`.

    Raises:
        ClusterSpecError: no hosts, duplicate host names or ranks, ranks not 0..N-1, a link
            naming a rank that does not exist or with the wrong tier, a tier with no link.
    """

    hosts: tuple[Host, ...]
    links: tuple[Link, ...] = ()
    calibration: Calibration | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", tuple(self.hosts))
        object.__setattr__(self, "links", tuple(self.links))
        if not self.hosts:
            raise ClusterSpecError("cluster: 'hosts' must list at least one host")
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise ClusterSpecError(f"cluster: duplicate host names in {names}")
        host_of: dict[int, str] = {}
        for h in self.hosts:
            for d in h.devices:
                if d.rank in host_of:
                    raise ClusterSpecError(f"cluster: duplicate rank {d.rank} (on hosts {host_of[d.rank]!r} and "
                                           f"{h.name!r}); give every device its own rank 0..N-1")
                host_of[d.rank] = h.name
        n = len(host_of)
        missing = sorted(set(range(n)) - set(host_of))
        if missing:
            raise ClusterSpecError(f"cluster: ranks must be 0..{n - 1}; rank(s) {missing} missing "
                                   f"(have {sorted(host_of)})")
        tier_defaults: set[str] = set()
        pairs: dict[str, set[tuple[int, int]]] = {t: set() for t in TIERS}
        for link in self.links:
            if not isinstance(link, Link):
                raise ClusterSpecError(f"cluster: links must be Link objects, got {type(link).__name__}")
            if link.ranks is None:
                if link.tier in tier_defaults:
                    raise ClusterSpecError(f"cluster: two default links for tier {link.tier!r}; keep one")
                tier_defaults.add(link.tier)
                continue
            for r in link.ranks:
                if r not in host_of:
                    raise ClusterSpecError(f"cluster: link {list(link.ranks)} names rank {r}, which does not exist "
                                           f"(ranks are 0..{n - 1})")
            a, b = link.ranks
            tier = "intra_host" if host_of[a] == host_of[b] else "inter_host"
            if link.tier != tier:
                raise ClusterSpecError(f"cluster: link {[a, b]} has tier {link.tier!r}, but ranks {a} and {b} are on "
                                       f"{'one host' if tier == 'intra_host' else 'different hosts'} ({tier})")
            if link.ranks in pairs[tier]:
                raise ClusterSpecError(f"cluster: two links for ranks {[a, b]}; keep one")
            pairs[tier].add(link.ranks)
        sizes = [h.num_devices for h in self.hosts]
        n_pairs = {"intra_host": sum(k * (k - 1) // 2 for k in sizes),
                   "inter_host": n * (n - 1) // 2 - sum(k * (k - 1) // 2 for k in sizes)}
        for tier in TIERS:
            if n_pairs[tier] and tier not in tier_defaults and len(pairs[tier]) < n_pairs[tier]:
                raise ClusterSpecError(
                    f"cluster: no link for tier {tier!r}, which {n_pairs[tier]} pair(s) of ranks use; add "
                    f"{{tier: {tier}, bandwidth_bytes_per_s: ..., latency_s: ...}} to 'links'")
        if self.calibration is not None and not isinstance(self.calibration, Calibration):
            raise ClusterSpecError(f"cluster: calibration must be a Calibration or None, "
                                   f"got {type(self.calibration).__name__}")
        # lookup tables for device() / host_of() / link(), built once (not fields: no effect on ==, hash, repr)
        object.__setattr__(self, "_device_of", {d.rank: d for h in self.hosts for d in h.devices})
        object.__setattr__(self, "_host_of", {d.rank: h for h in self.hosts for d in h.devices})
        object.__setattr__(self, "_links", {(link.ranks or link.tier): link for link in self.links})

    # --- queries (the cost models' interface) ----------------------------------------------------

    @property
    def world_size(self) -> int:
        return sum(h.num_devices for h in self.hosts)

    @property
    def devices(self) -> tuple[Device, ...]:
        """All devices, by rank."""
        return tuple(sorted((d for h in self.hosts for d in h.devices), key=lambda d: d.rank))

    def device(self, rank: int) -> Device:
        """The device of ``rank``.

        Raises:
            ClusterSpecError: no such rank.
        """
        d = self._device_of.get(rank) if isinstance(rank, int) else None
        if d is not None:
            return d
        raise ClusterSpecError(f"{self!r} has no rank {rank!r}; ranks are 0..{self.world_size - 1}")

    def host_of(self, rank: int) -> Host:
        """The host ``rank`` is on. Raises ClusterSpecError for an unknown rank."""
        h = self._host_of.get(rank) if isinstance(rank, int) else None
        if h is not None:
            return h
        raise ClusterSpecError(f"{self!r} has no rank {rank!r}; ranks are 0..{self.world_size - 1}")

    def tier(self, rank_a: int, rank_b: int) -> str:
        """``"intra_host"`` when both ranks are on one host, else ``"inter_host"``."""
        return "intra_host" if self.host_of(rank_a).name == self.host_of(rank_b).name else "inter_host"

    @property
    def tiers(self) -> tuple[str, ...]:
        """The link tiers that pairs of ranks in this cluster use."""
        out = []
        if any(h.num_devices > 1 for h in self.hosts):
            out.append("intra_host")
        if len(self.hosts) > 1:
            out.append("inter_host")
        return tuple(out)

    def link(self, rank_a: int, rank_b: int) -> Link:
        """The link between two different ranks: the pair's own entry, else its tier's default.

        Raises:
            ClusterSpecError: an unknown rank, or ``rank_a == rank_b`` (a rank has no link to itself).
        """
        if rank_a == rank_b:
            raise ClusterSpecError(f"{self!r}: rank {rank_a} has no link to itself; ask for two different ranks")
        tier = self.tier(rank_a, rank_b)
        pair = (min(rank_a, rank_b), max(rank_a, rank_b))
        link = self._links.get(pair) or self._links.get(tier)
        assert link is not None, (self, pair)  # __post_init__ checks every used tier is covered
        return link

    def collective_fit(self, collective: str, tier: str) -> CollectiveFit | None:
        """The measured alpha-beta fit of ``collective`` on ``tier``; None when not measured.

        Raises:
            ClusterSpecError: ``collective`` or ``tier`` is not a known name.
        """
        if collective not in COLLECTIVES:
            raise ClusterSpecError(f"collective {collective!r} is not one of {list(COLLECTIVES)}")
        if tier not in TIERS:
            raise ClusterSpecError(f"tier {tier!r} is not one of {list(TIERS)}")
        if self.calibration is None:
            return None
        return self.calibration.collectives.get((tier, collective))

    @property
    def calibrated(self) -> bool:
        """True when the figures were measured by ``adaptdist cluster profile`` (a calibration block)."""
        return self.calibration is not None

    @property
    def device_kinds(self) -> tuple[str, ...]:
        """The device kinds in this cluster, sorted."""
        return tuple(sorted({d.kind for h in self.hosts for d in h.devices}))

    @property
    def device_kind(self) -> str:
        """The one device kind of every rank.

        Raises:
            ClusterSpecError: the cluster mixes kinds (one torch.distributed backend cannot launch it).
        """
        kinds = self.device_kinds
        if len(kinds) > 1:
            raise ClusterSpecError(
                f"{self!r} mixes device kinds {list(kinds)}; the runtime launches one torch.distributed backend "
                f"(gloo for cpu, nccl for cuda) per job, so it cannot run this cluster yet. Plan for it, or "
                f"describe only the devices of one kind")
        return kinds[0]

    @property
    def backend(self) -> str:
        """The torch.distributed backend for this cluster (gloo on CPU, nccl on CUDA).

        Raises:
            ClusterSpecError: the cluster mixes device kinds.
        """
        return DEVICE_KINDS[self.device_kind]

    def topology_fingerprint(self) -> str:
        """A 16-hex-digit id of the topology, for plan caches.

        It covers the number of hosts, which ranks share a host and their device kinds (in rank
        order), and the link tiers in use; not host names and not any measured or estimated
        figure, so re-calibrating keeps it and another topology changes it.
        """
        doc = {
            "fingerprint_version": 1,
            "hosts": sorted([[d.rank, d.kind] for d in sorted(h.devices, key=lambda d: d.rank)]
                            for h in self.hosts),
            "tiers": list(self.tiers),
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        def host(h: Host) -> str:
            counts: dict[str, int] = {}
            for d in h.devices:
                counts[d.kind] = counts.get(d.kind, 0) + 1
            return f"{h.name}:" + "+".join(f"{k}x{kind}" for kind, k in counts.items())

        return f"Cluster({', '.join(map(host, self.hosts))}{', calibrated' if self.calibrated else ''})"

    # --- construction --------------------------------------------------------------------------

    @staticmethod
    def local(nproc: int, device_kind: str = "cpu") -> "Cluster":
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
        _check_kind(device_kind, "Cluster.local")
        hosts = (Host.uniform("localhost", device_kind, nproc),)
        return Cluster(hosts, default_links(hosts))

    @staticmethod
    def from_yaml(path: str | os.PathLike) -> "Cluster":
        """Load a cluster file, YAML or JSON (schema in the module docstring; versions 1 and 2).

        Raises:
            ClusterSpecError: the file is missing, is not YAML, or a field is missing, has the wrong
                type or an invalid value; the message names the file, the field and the allowed form.
        """
        p = Path(path)
        if not p.is_file():
            raise ClusterSpecError(f"cluster file {str(p)!r} does not exist")
        try:
            doc = yaml.load(p.read_text(), Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ClusterSpecError(f"cluster file {str(p)!r} is not valid YAML: {e}") from None
        return Cluster.from_dict(doc, source=str(p))

    @staticmethod
    def from_dict(doc: object, source: str = "<dict>") -> "Cluster":
        """Build from a parsed document; see :meth:`from_yaml`. ``source`` names it in errors."""
        return _Parser(source).cluster(doc)

    def to_dict(self) -> dict:
        """The schema-version-2 document (plain dicts, lists, numbers and strings)."""
        doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "hosts": [], "links": []}
        for h in self.hosts:
            devs = []
            for d in h.devices:
                e: dict[str, Any] = {"rank": d.rank, "kind": d.kind}
                if d.cores is not None:
                    e["cores"] = d.cores
                e["peak_flops"] = dict(d.peak_flops)
                e["memory_bytes"] = d.memory_bytes
                e["memory_bandwidth_bytes_per_s"] = d.memory_bandwidth_bytes_per_s
                if d.op_overhead_s is not None:
                    e["op_overhead_s"] = d.op_overhead_s
                devs.append(e)
            doc["hosts"].append({"name": h.name, "devices": devs})
        for link in self.links:
            e = {"tier": link.tier} if link.ranks is None else {"ranks": list(link.ranks)}
            e.update(bandwidth_bytes_per_s=link.bandwidth_bytes_per_s, latency_s=link.latency_s)
            doc["links"].append(e)
        cal = self.calibration
        if cal is None:
            doc["calibration"] = None
        else:
            coll: dict[str, dict] = {}
            for (tier, name), fit in cal.collectives.items():
                f = {"alpha_s": fit.alpha_s, "beta_s_per_byte": fit.beta_s_per_byte}
                if fit.num_ranks is not None:
                    f["num_ranks"] = fit.num_ranks
                if fit.rms_rel_error is not None:
                    f["rms_rel_error"] = fit.rms_rel_error
                coll.setdefault(tier, {})[name] = f
            c: dict[str, Any] = {"measured_at": cal.measured_at, "backend": cal.backend,
                                 "torch_version": cal.torch_version}
            if cal.wall_s is not None:
                c["wall_s"] = cal.wall_s
            c["collectives"] = coll
            doc["calibration"] = c
        return doc

    def to_yaml(self, path: str | os.PathLike, comment: str = "") -> None:
        """Write the cluster as a schema-version-2 YAML file (``comment`` lines become a header)."""
        head = "".join(f"# {line}\n" for line in comment.splitlines())
        state = ("calibrated: figures measured by `adaptdist cluster profile`" if self.calibrated else
                 "uncalibrated: every figure is an estimate; `adaptdist cluster profile` measures them")
        text = yaml.dump(self.to_dict(), Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=120)
        Path(path).write_text(f"{head}# adaptdist cluster file; {state}\n{text}")

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the cluster as schema-version-2 JSON (loadable by :meth:`from_yaml`)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def save(self, path: str | os.PathLike, comment: str = "") -> None:
        """Write JSON when ``path`` ends in ``.json``, else YAML."""
        if str(path).endswith(".json"):
            self.to_json(path)
        else:
            self.to_yaml(path, comment)

    def with_calibration(self, calibration: Calibration | None) -> "Cluster":
        """A copy with another calibration block."""
        return dataclasses.replace(self, calibration=calibration)


# --- parsing -------------------------------------------------------------------------------------

class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as ``1.5e9`` (PyYAML's 1.1 rules make it a string)."""


_Loader.yaml_implicit_resolvers = {
    k: [r for r in v if r[0] != "tag:yaml.org,2002:float"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)

class _Dumper(yaml.SafeDumper):
    """SafeDumper writing floats in their shortest exact form, large and small ones as ``1.6e+11``."""


def _represent_float(dumper: yaml.SafeDumper, v: float) -> yaml.ScalarNode:
    if not math.isfinite(v) or v == 0 or 1e-3 <= abs(v) < 1e6:
        return yaml.SafeDumper.represent_float(dumper, v)
    text = next(t for t in (f"{v:.{k}e}" for k in range(1, 18)) if float(t) == v)
    mantissa, exp = text.split("e")
    mantissa = mantissa if "." in mantissa else mantissa + ".0"
    return dumper.represent_scalar("tag:yaml.org,2002:float", f"{mantissa}e{exp}")


_Dumper.add_representer(float, _represent_float)

_V2_TOP = ("schema_version", "hosts", "links", "calibration")
_V2_DEVICE = ("rank", "kind", "cores", "peak_flops", "memory_bytes", "memory_bandwidth_bytes_per_s", "op_overhead_s")
_V2_DEVICE_REQUIRED = ("rank", "kind", "peak_flops", "memory_bytes", "memory_bandwidth_bytes_per_s")
_EXAMPLE_DEVICE = ("{rank: 0, kind: cpu, peak_flops: {float32: 1.0e+11}, memory_bytes: 8589934592, "
                   "memory_bandwidth_bytes_per_s: 1.0e+10}")


class _Parser:
    """Turns a parsed document into a Cluster; every error names the file and the field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, why: str) -> ClusterSpecError:
        return ClusterSpecError(f"cluster file {self.source!r}: field '{path}' {why}")

    def wrap(self, e: ClusterSpecError) -> ClusterSpecError:
        return ClusterSpecError(f"cluster file {self.source!r}: {e}")

    # leaf readers

    def mapping(self, path: str, v: object, allowed: tuple[str, ...], required: tuple[str, ...],
                example: str = "") -> dict:
        if not isinstance(v, dict):
            raise self.fail(path, f"must be a mapping{' like ' + example if example else ''}, got "
                                  f"{type(v).__name__} {v!r}")
        for key in required:
            if key not in v:
                raise self.fail(f"{path}.{key}" if path else key,
                                f"is missing; {path or 'the top level'} needs {', '.join(required)}"
                                + (f", e.g. {example}" if example else ""))
        unknown = sorted(map(str, set(v) - set(allowed)))
        if unknown:
            raise self.fail(path, f"has unknown keys {unknown}; allowed keys: {', '.join(allowed)}")
        return v

    def number(self, path: str, v: object, unit: str, *, zero_ok: bool = False) -> float:
        bad = not _is_number(v) or (v < 0 if zero_ok else v <= 0)
        if bad:
            want = ">= 0" if zero_ok else "> 0"
            raise self.fail(path, f"must be a number of {unit} {want} (e.g. 1.5e+9), got {v!r}")
        return float(v)

    def integer(self, path: str, v: object, what: str, *, minimum: int) -> int:
        if isinstance(v, float) and v.is_integer() and what == "bytes":
            v = int(v)  # memory_bytes: 8e9
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise self.fail(path, f"must be an integer {what} >= {minimum}, got {v!r}")
        return v

    def kind(self, path: str, v: object) -> str:
        if v not in DEVICE_KINDS:
            raise self.fail(path, f"is {v!r}; allowed device kinds: 'cpu' (gloo) or 'cuda' (nccl)")
        return v  # type: ignore[return-value]

    # documents

    def cluster(self, doc: object) -> Cluster:
        if not isinstance(doc, dict):
            raise ClusterSpecError(f"cluster file {self.source!r}: expected a mapping at top level, "
                                   f"got {type(doc).__name__}")
        if "schema_version" not in doc:
            raise self.fail("schema_version", f"is missing; add 'schema_version: {SCHEMA_VERSION}'")
        version = doc["schema_version"]
        if type(version) is not int or version not in READABLE_SCHEMA_VERSIONS:  # not True, 1.0, '2'
            raise self.fail("schema_version", f"is {version!r}; this adaptdist reads version 1 and "
                                              f"version {SCHEMA_VERSION}")
        return self.v1(doc) if version == 1 else self.v2(doc)

    def hosts_list(self, doc: dict, hint: str) -> list:
        hosts = doc.get("hosts")
        if hosts is None:
            raise self.fail("hosts", f"is missing; list at least one host with {hint}")
        if not isinstance(hosts, list) or not hosts:
            got = "an empty list" if isinstance(hosts, list) else f"a {type(hosts).__name__}"
            raise self.fail("hosts", f"must be a non-empty list of hosts, got {got}")
        return hosts

    def v1(self, doc: dict) -> Cluster:
        unknown_top = set(doc) - {"schema_version", "hosts"}
        if unknown_top:
            raise ClusterSpecError(
                f"cluster file {self.source!r}: unknown top-level keys {sorted(map(str, unknown_top))}; "
                f"schema version 1 has only 'schema_version' and 'hosts' (version {SCHEMA_VERSION} adds "
                f"'links' and 'calibration')")
        parsed = []
        rank = 0
        for i, h in enumerate(self.hosts_list(doc, "name, device_kind, num_devices")):
            if not isinstance(h, dict):
                raise self.fail(f"hosts[{i}]", f"must be a mapping, got {type(h).__name__}")
            for key, typ in (("name", str), ("device_kind", str), ("num_devices", int)):
                if key not in h:
                    raise self.fail(f"hosts[{i}].{key}", "is missing")
                if not isinstance(h[key], typ) or isinstance(h[key], bool):
                    raise self.fail(f"hosts[{i}].{key}", f"must be {typ.__name__}, got {h[key]!r}")
            unknown = set(h) - {"name", "device_kind", "num_devices"}
            if unknown:
                raise self.fail(f"hosts[{i}]", f"has unknown keys {sorted(map(str, unknown))}")
            try:
                parsed.append(Host.uniform(h["name"], h["device_kind"], h["num_devices"], rank))
            except ClusterSpecError as e:
                raise self.wrap(e) from None
            rank += h["num_devices"]
        try:
            hosts = tuple(parsed)
            return Cluster(hosts, default_links(hosts))
        except ClusterSpecError as e:
            raise self.wrap(e) from None

    def v2(self, doc: dict) -> Cluster:
        self.mapping("", doc, _V2_TOP, ("schema_version", "hosts"))
        hosts: list[Host] = []
        seen: dict[int, str] = {}
        for i, h in enumerate(self.hosts_list(doc, "name and devices")):
            hp = f"hosts[{i}]"
            if isinstance(h, dict) and "devices" not in h and ("num_devices" in h or "device_kind" in h):
                raise self.fail(hp, "has the schema version 1 keys device_kind / num_devices; in version 2 a host "
                                    "lists its devices: {name: localhost, devices: [" + _EXAMPLE_DEVICE + ", ...]} "
                                    "(or write 'schema_version: 1' to get estimated figures)")
            self.mapping(hp, h, ("name", "devices"), ("name", "devices"), "{name: localhost, devices: [...]}")
            if not isinstance(h["name"], str) or not h["name"]:
                raise self.fail(f"{hp}.name", f"must be a non-empty string, got {h['name']!r}")
            devs = h["devices"]
            if not isinstance(devs, list) or not devs:
                raise self.fail(f"{hp}.devices", f"must be a non-empty list of devices like {_EXAMPLE_DEVICE}, "
                                                 f"got {devs!r}")
            devices = []
            for j, d in enumerate(devs):
                dp = f"{hp}.devices[{j}]"
                devices.append(self.device(dp, d, h["name"]))
                if devices[-1].rank in seen:
                    raise self.fail(f"{dp}.rank", f"is {devices[-1].rank}, already the rank of {seen[devices[-1].rank]}"
                                                  f"; every device needs its own rank, 0..N-1")
                seen[devices[-1].rank] = dp
            try:
                hosts.append(Host(h["name"], tuple(devices)))
            except ClusterSpecError as e:
                raise self.wrap(e) from None
        n = len(seen)
        missing = sorted(set(range(n)) - set(seen))
        if missing:
            raise self.fail("hosts", f"has ranks {sorted(seen)}; ranks must be 0..{n - 1} (missing {missing})")
        links_doc = doc.get("links")
        if links_doc is None:
            raise self.fail("links", "is missing; add e.g. [{tier: intra_host, bandwidth_bytes_per_s: 1.5e+9, "
                                     "latency_s: 2.0e-4}] (one entry per link tier the cluster uses)")
        if not isinstance(links_doc, list):
            raise self.fail("links", f"must be a list of links, got {type(links_doc).__name__}")
        host_of = {d.rank: h.name for h in hosts for d in h.devices}
        links = [self.link(f"links[{k}]", e, host_of) for k, e in enumerate(links_doc)]
        calibration = self.calibration(doc.get("calibration"))
        try:
            return Cluster(tuple(hosts), tuple(links), calibration)
        except ClusterSpecError as e:
            raise self.wrap(e) from None

    def device(self, dp: str, d: object, host: str) -> Device:
        self.mapping(dp, d, _V2_DEVICE, _V2_DEVICE_REQUIRED, _EXAMPLE_DEVICE)
        assert isinstance(d, dict)
        rank = self.integer(f"{dp}.rank", d["rank"], "rank", minimum=0)
        kind = self.kind(f"{dp}.kind", d["kind"])
        pf = d["peak_flops"]
        if not isinstance(pf, dict) or "float32" not in pf:
            raise self.fail(f"{dp}.peak_flops", f"must map dtype names to FLOP/s and include float32, e.g. "
                                                f"{{float32: 1.0e+11, bfloat16: 2.0e+11}}; got {pf!r}")
        flops = {}
        for dt, v in pf.items():
            if dt not in DTYPES:
                raise self.fail(f"{dp}.peak_flops", f"has unknown dtype {dt!r}; allowed: {', '.join(DTYPES)}")
            flops[dt] = self.number(f"{dp}.peak_flops.{dt}", v, "FLOP/s")
        mem = self.integer(f"{dp}.memory_bytes", d["memory_bytes"], "bytes", minimum=1)
        bw = self.number(f"{dp}.memory_bandwidth_bytes_per_s", d["memory_bandwidth_bytes_per_s"], "bytes/s")
        cores = None if d.get("cores") is None else self.number(f"{dp}.cores", d["cores"], "cores")
        ovh = (None if d.get("op_overhead_s") is None
               else self.number(f"{dp}.op_overhead_s", d["op_overhead_s"], "seconds", zero_ok=True))
        try:
            return Device(rank, host, kind, flops, mem, bw, cores, ovh)
        except ClusterSpecError as e:
            raise self.wrap(e) from None

    def link(self, lp: str, e: object, host_of: dict[int, str]) -> Link:
        n = len(host_of)
        example = "{tier: intra_host, bandwidth_bytes_per_s: 1.5e+9, latency_s: 2.0e-4}"
        self.mapping(lp, e, ("tier", "ranks", "bandwidth_bytes_per_s", "latency_s"),
                     ("bandwidth_bytes_per_s", "latency_s"), example)
        assert isinstance(e, dict)
        if "tier" not in e and "ranks" not in e:
            raise self.fail(lp, f"needs 'tier' (a default for every pair of that tier) or 'ranks: [a, b]' "
                                f"(one pair), e.g. {example}")
        ranks = None
        if "ranks" in e:
            r = e["ranks"]
            if (not isinstance(r, list) or len(r) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in r) or r[0] == r[1]):
                raise self.fail(f"{lp}.ranks", f"must be two different ranks [a, b], got {r!r}")
            for x in r:
                if not 0 <= x < n:
                    raise self.fail(f"{lp}.ranks", f"names rank {x}, which does not exist: the devices have "
                                                   f"ranks 0..{n - 1}")
            ranks = (r[0], r[1])
        tier = e.get("tier")
        if tier is not None and tier not in TIERS:
            raise self.fail(f"{lp}.tier", f"is {tier!r}; allowed: 'intra_host' (ranks on one host) or "
                                          f"'inter_host' (ranks on different hosts)")
        if ranks is not None:
            a, b = ranks
            actual = "intra_host" if host_of[a] == host_of[b] else "inter_host"
            if tier is not None and tier != actual:
                raise self.fail(f"{lp}.tier", f"is {tier!r}, but ranks {a} and {b} are on hosts {host_of[a]!r} "
                                              f"and {host_of[b]!r} ({actual}); drop 'tier' from a pair entry")
            tier = actual
        bw = self.number(f"{lp}.bandwidth_bytes_per_s", e["bandwidth_bytes_per_s"], "bytes/s")
        lat = self.number(f"{lp}.latency_s", e["latency_s"], "seconds", zero_ok=True)
        try:
            return Link(tier, bw, lat, ranks)
        except ClusterSpecError as err:
            raise self.wrap(err) from None

    def calibration(self, c: object) -> Calibration | None:
        if c is None:
            return None
        self.mapping("calibration", c, ("measured_at", "backend", "torch_version", "wall_s", "collectives"),
                     ("collectives",))
        assert isinstance(c, dict)
        for key in ("measured_at", "backend", "torch_version"):
            if key in c and not isinstance(c[key], str):
                raise self.fail(f"calibration.{key}", f"must be a string, got {c[key]!r}")
        wall = None if c.get("wall_s") is None else self.number("calibration.wall_s", c["wall_s"], "seconds",
                                                                 zero_ok=True)
        coll = c["collectives"]
        if not isinstance(coll, dict):
            raise self.fail("calibration.collectives", f"must map tier -> collective -> fit, got {coll!r}")
        fits = {}
        for tier, by_name in coll.items():
            tp = f"calibration.collectives.{tier}"
            if tier not in TIERS:
                raise self.fail(tp, f"is not a link tier; allowed: {', '.join(TIERS)}")
            if not isinstance(by_name, dict):
                raise self.fail(tp, f"must map collective names to fits, got {by_name!r}")
            for name, f in by_name.items():
                fp = f"{tp}.{name}"
                if name not in COLLECTIVES:
                    raise self.fail(fp, f"is not a collective; allowed: {', '.join(COLLECTIVES)}")
                self.mapping(fp, f, ("alpha_s", "beta_s_per_byte", "num_ranks", "rms_rel_error"),
                             ("alpha_s", "beta_s_per_byte"), "{alpha_s: 2.0e-4, beta_s_per_byte: 7.0e-10}")
                assert isinstance(f, dict)
                nr = None if f.get("num_ranks") is None else self.integer(f"{fp}.num_ranks", f["num_ranks"],
                                                                          "ranks", minimum=1)
                err = None if f.get("rms_rel_error") is None else self.number(
                    f"{fp}.rms_rel_error", f["rms_rel_error"], "(relative error)", zero_ok=True)
                fits[(tier, name)] = CollectiveFit(
                    self.number(f"{fp}.alpha_s", f["alpha_s"], "seconds", zero_ok=True),
                    self.number(f"{fp}.beta_s_per_byte", f["beta_s_per_byte"], "seconds per byte"), nr, err)
        return Calibration(FrozenMap(fits), c.get("measured_at", ""), c.get("backend", ""),
                           c.get("torch_version", ""), wall)
