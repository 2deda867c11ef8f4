"""The cluster data model: the ranks a job runs on, how fast they compute and how they communicate.

Frozen value objects -- :class:`Device`, :class:`Host`, :class:`Link`, :class:`CollectiveFit`,
:class:`Calibration`, :class:`Cluster` -- that validate themselves on construction and take their
figures from the caller: the file schema (reading and writing YAML/JSON) is :mod:`adaptdist.cluster_file`,
this machine's estimated figures and :func:`~adaptdist.calibrate.local.local_cluster` are in
:mod:`adaptdist.calibrate.local`, measured ones come from ``adaptdist cluster profile``.

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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from .errors import ClusterSpecError

DEVICE_KINDS: Mapping[str, str] = {"cpu": "gloo", "cuda": "nccl"}
"""Device kind -> the torch.distributed backend that launches it."""
TIERS = ("intra_host", "inter_host")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
SHM_TIER = "shm"
"""The calibration key of adaptdist's shared-memory collectives among the ranks of one host (``--comm``): measured
by ``adaptdist cluster profile`` beside gloo's ``intra_host`` fits where the kernels are loaded."""
SHM_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
CALIBRATION_TIERS = TIERS + (SHM_TIER,)
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
        cpus: the CPU core ids this rank is pinned to (``os.sched_setaffinity``; torch then runs
            ``len(cpus)`` threads), applied by the launcher and by ``adaptdist cluster profile``; None: not
            pinned. Ranks may share cores (two ranks on ``[0]`` each get about half of core 0).

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
    cpus: tuple[int, ...] | None = None

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
        if self.cpus is not None:
            cpus = tuple(self.cpus) if isinstance(self.cpus, (list, tuple)) else None
            if (not cpus or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus)
                    or len(set(cpus)) != len(cpus)):
                raise ClusterSpecError(f"{who}: cpus must be a non-empty list of distinct core ids >= 0 (e.g. [0] or "
                                       f"[2, 3]), or absent; got {self.cpus!r}")
            if self.kind != "cpu":
                raise ClusterSpecError(f"{who}: cpus pins a cpu rank to cores; this device is {self.kind!r}")
            object.__setattr__(self, "cpus", cpus)

    def __repr__(self) -> str:
        return (f"Device(rank={self.rank}, {self.kind} on {self.host}, "
                f"{self.peak_flops['float32']:.3g} float32 FLOP/s, {self.memory_bytes / 2**30:.1f} GiB"
                + (f", cpus {list(self.cpus)}" if self.cpus is not None else "") + ")")


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
            if not (isinstance(key, tuple) and len(key) == 2 and key[0] in CALIBRATION_TIERS
                    and key[1] in (SHM_COLLECTIVES if key[0] == SHM_TIER else COLLECTIVES)):
                raise ClusterSpecError(f"calibration: collective key {key!r} must be (tier, collective) with tier in "
                                       f"{list(CALIBRATION_TIERS)} and collective in {list(COLLECTIVES)} "
                                       f"({list(SHM_COLLECTIVES)} for {SHM_TIER!r})")
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

@dataclass(frozen=True)
class Cluster:
    """A frozen description of the ranks of a job, their devices and the links between them.

    Ranks are 0..world_size-1, each on exactly one host. Heterogeneous clusters (cpu and cuda
    devices) are described fully; a runtime that launches one backend refuses them through
    :attr:`backend`.

    ``shm_collectives``: the one-host groups' collectives take adaptdist's shared-memory kernels (a costing view,
    :meth:`with_shm_collectives`; not part of the cluster file or the topology fingerprint).

    Raises:
        ClusterSpecError: no hosts, duplicate host names or ranks, ranks not 0..N-1, a link
            naming a rank that does not exist or with the wrong tier, a tier with no link.
    """

    hosts: tuple[Host, ...]
    links: tuple[Link, ...] = ()
    calibration: Calibration | None = None
    shm_collectives: bool = False

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
        if tier not in CALIBRATION_TIERS:
            raise ClusterSpecError(f"tier {tier!r} is not one of {list(CALIBRATION_TIERS)}")
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

    def with_shm_collectives(self) -> "Cluster":
        """A copy marked ``shm_collectives`` (its one-host collectives take adaptdist's shared-memory kernels), whose
        ``intra_host`` collective fits are the kernels' (the ``shm`` fits, where measured): what the cost models and
        the planner see when a one-host group's collectives take shared memory (``--comm auto|shm``;
        :func:`adaptdist.comm_transport.cluster_for_comm`). Without ``shm`` fits (not profiled with the kernels) the
        mark alone makes :func:`adaptdist.cost_models.communication.link_cost` price one-host collectives at the
        estimated shared-memory figures (:func:`adaptdist.cost_models.hardware.default_shm_link`), not at gloo's
        link or fits; send/recv (which stays on gloo) keeps gloo's."""
        marked = dataclasses.replace(self, shm_collectives=True)
        cal = self.calibration
        if cal is None or not any(t == SHM_TIER for t, _ in cal.collectives):
            return marked
        fits = dict(cal.collectives)
        for (tier, name), fit in cal.collectives.items():
            if tier == SHM_TIER:
                fits[("intra_host", name)] = fit
        return marked.with_calibration(dataclasses.replace(cal, collectives=FrozenMap(fits)))

    def with_calibration(self, calibration: Calibration | None) -> "Cluster":
        """A copy with another calibration block."""
        return dataclasses.replace(self, calibration=calibration)
