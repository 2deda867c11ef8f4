"""Which device runs which rank, and how many rows of the batch each one gets: resource-aware placement.

The planner treats the mesh as uniform; this module adds what the devices' differences decide:

* :class:`DeviceAssignment` (held by :attr:`adaptdist.plan.Plan.devices`, written in ``plan.json`` under
  ``devices``): the rows of the global batch each coordinate of the batch axis takes (``batch_rows``; None:
  ``torch.chunk``'s even split) and the device each program rank runs on (``rank_to_device``; None: rank r on
  device r).
* :func:`rank_capacities`: each device's measured FLOP/s, memory and throughput relative to the fastest one
  -- the per-device speed/memory model the data-parallel split here and a pipeline stage DP can both use.
* :func:`balanced_rows`: the integer split of ``total`` rows minimizing the slowest rank's predicted time,
  within each rank's row limit (memory); :func:`proportional_rows` the plain proportional one;
  :func:`fixed_point_rows`: the split re-measured at its own rows until it stops moving (speeds per row that
  depend on the rows).
* :func:`map_ranks`: the communication-heaviest mesh axes on the fastest links (a greedy grouping of devices
  by link bandwidth, heaviest axis first, kept only where it beats the identity mapping);
  :func:`permuted_cluster`: the cluster seen by program rank (device ``rank_to_device[r]`` as rank r), which
  the cost models then price as they do any cluster.

Example: 3 CPU ranks, ranks 0 and 1 pinned to core 0, rank 2 alone on core 1 (``cpus:`` in the cluster file;
``cluster profile`` measures 0.5, 0.5 and 1.0 of a core's FLOP/s): ``balanced_rows(8, ...)`` gives
``(2, 2, 4)``, which the lowering splits exactly (``passes/globalize_reductions.py`` divides by the global
count, whatever the split).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import UsageError


@dataclass(frozen=True)
class DeviceAssignment:
    """Rows per batch-axis coordinate and the device of each program rank.

    Attributes:
        batch_rows: rows of the global batch (dim 0) that coordinate i of the plan's batch axis takes, in
            order (they sum to the batch size); None: ``torch.chunk``'s split.
        rank_to_device: program rank r runs on the cluster's device ``rank_to_device[r]`` (a permutation of
            0..N-1); None: the identity.
        reason: one line saying why (shown by ``adaptdist plan``; not used by the lowering).

    Raises:
        UsageError: negative or non-integer rows, or a mapping that is not a permutation.
    """

    batch_rows: tuple[int, ...] | None = None
    rank_to_device: tuple[int, ...] | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if self.batch_rows is not None:
            rows = tuple(self.batch_rows)
            if not rows or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in rows):
                raise UsageError(f"plan: devices.batch_rows must be row counts >= 0, one per coordinate of the "
                                 f"batch axis, got {self.batch_rows!r}")
            object.__setattr__(self, "batch_rows", rows)
        if self.rank_to_device is not None:
            m = tuple(self.rank_to_device)
            if sorted(m) != list(range(len(m))) or not all(isinstance(x, int) and not isinstance(x, bool) for x in m):
                raise UsageError(f"plan: devices.rank_to_device must be a permutation of 0..N-1, got "
                                 f"{self.rank_to_device!r}")
            object.__setattr__(self, "rank_to_device", m)
        if not isinstance(self.reason, str):
            raise UsageError(f"plan: devices.reason must be a string, got {self.reason!r}")

    def device_of(self, rank: int) -> int:
        """The cluster device program rank ``rank`` runs on."""
        return rank if self.rank_to_device is None else self.rank_to_device[rank]

    def to_doc(self) -> dict:
        return {"batch_rows": None if self.batch_rows is None else list(self.batch_rows),
                "rank_to_device": None if self.rank_to_device is None else list(self.rank_to_device),
                "reason": self.reason}

    @staticmethod
    def from_doc(doc: Any, source: str = "<plan>") -> "DeviceAssignment":
        """Parse :meth:`to_doc`'s form.

        Raises:
            UsageError: not an object, or a field of the wrong type (names ``source`` and the field).
        """
        if not isinstance(doc, dict) or set(doc) - {"batch_rows", "rank_to_device", "reason"}:
            raise UsageError(f"plan {source!r}: field 'devices' must be an object with batch_rows, rank_to_device "
                             f"and reason, got {doc!r}")
        for key in ("batch_rows", "rank_to_device"):
            v = doc.get(key)
            if v is not None and not isinstance(v, list):
                raise UsageError(f"plan {source!r}: field 'devices.{key}' must be a list of integers or null, "
                                 f"got {v!r}")
        try:
            return DeviceAssignment(None if doc.get("batch_rows") is None else tuple(doc["batch_rows"]),
                                    None if doc.get("rank_to_device") is None else tuple(doc["rank_to_device"]),
                                    doc.get("reason", ""))
        except UsageError as e:
            raise UsageError(f"plan {source!r}: {e}") from None


@dataclass(frozen=True)
class RankCapacity:
    """One device's speed and memory, for splitting work.

    Attributes:
        rank: the device's rank in the cluster. flops_per_s: its peak FLOP/s for the dtype asked (measured by
        ``cluster profile``: all ranks busy at once, pinned as the cluster file says). memory_bytes: its memory.
        relative_throughput: flops_per_s / the fastest device's (1.0 for the fastest).
    """

    rank: int
    flops_per_s: float
    memory_bytes: int
    relative_throughput: float


def rank_capacities(cluster: Any, dtype: str = "float32") -> tuple[RankCapacity, ...]:
    """Each device's :class:`RankCapacity`, by rank (``peak_flops[dtype]``, else float32)."""
    devs = [cluster.device(r) for r in range(cluster.world_size)]
    flops = [float(d.peak_flops.get(dtype, d.peak_flops["float32"])) for d in devs]
    top = max(flops)
    return tuple(RankCapacity(d.rank, f, int(d.memory_bytes), f / top) for d, f in zip(devs, flops))


def is_uniform(cluster: Any, ranks: Sequence[int] | None = None) -> bool:
    """Whether the devices ``ranks`` (default: all) have the same float32 FLOP/s and memory."""
    rs = list(range(cluster.world_size)) if ranks is None else list(ranks)
    figs = {(cluster.device(r).peak_flops["float32"], cluster.device(r).memory_bytes) for r in rs}
    return len(figs) <= 1


def proportional_rows(total: int, weights: Sequence[float], max_rows: Sequence[int | None] | None = None
                      ) -> tuple[int, ...]:
    """``total`` rows split in proportion to ``weights`` (largest remainder), each at most ``max_rows[i]``.

    Raises:
        UsageError: the limits hold fewer than ``total`` rows, or a weight is negative / all are 0.
    """
    w = [float(x) for x in weights]
    if any(x < 0 or not math.isfinite(x) for x in w) or sum(w) <= 0:
        raise UsageError(f"weights must be finite, >= 0 and not all 0, got {list(weights)!r}")
    return balanced_rows(total, [(lambda n, x=x: n / x if x > 0 else (0.0 if n == 0 else math.inf)) for x in w],
                         max_rows)


def balanced_rows(total: int, time_of_rows: Sequence[Callable[[int], float]],
                  max_rows: Sequence[int | None] | None = None) -> tuple[int, ...]:
    """The split of ``total`` rows over ranks that minimizes the largest ``time_of_rows[i](rows_i)``.

    Each ``time_of_rows[i]`` must be non-decreasing in the rows (seconds, any affine model: fixed + per-row
    work). Greedy: every next row goes to the rank whose time after taking it is least (optimal for
    non-decreasing per-rank costs; ties to the lower rank). ``max_rows[i]`` (None: no limit) caps a rank.

    Raises:
        UsageError: the caps hold fewer than ``total`` rows.
    """
    n = len(time_of_rows)
    caps = [None] * n if max_rows is None else list(max_rows)
    if total < 0 or n == 0:
        raise UsageError(f"cannot split {total} rows over {n} ranks")
    room = sum(math.inf if c is None else c for c in caps)
    if room < total:
        raise UsageError(f"{total} rows do not fit: the ranks hold at most {list(caps)} rows")
    rows = [0] * n
    heap = [(time_of_rows[i](1), i) for i in range(n) if caps[i] is None or caps[i] > 0]
    heapq.heapify(heap)
    for _ in range(total):
        _, i = heapq.heappop(heap)
        rows[i] += 1
        if caps[i] is None or rows[i] < caps[i]:
            heapq.heappush(heap, (time_of_rows[i](rows[i] + 1), i))
    return tuple(rows)


@dataclass(frozen=True)
class FixedPointSplit:
    """The rows :func:`fixed_point_rows` settled on, and every round it measured.

    Attributes:
        rows: rows per rank (a split that was measured: the last one, or the best one when it did not settle).
        rounds: per round, the rows measured and each rank's measured seconds for them.
        converged: whether the split stopped moving (the next split's predicted gain under ``min_gain``).
    """

    rows: tuple[int, ...]
    rounds: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...]
    converged: bool

    @property
    def measured_s(self) -> tuple[float, ...]:
        """Each rank's measured seconds for :attr:`rows`."""
        return next(t for r, t in reversed(self.rounds) if r == self.rows)

    def lines(self) -> list[str]:
        """One line per round: rows, measured ms per rank, the slowest over the fastest."""
        return [f"round {i + 1}: rows {list(r)} -> measured [{', '.join(f'{1e3 * x:.1f}' for x in t)}] ms "
                f"(slowest / fastest {max(t) / min(t):.3f})" for i, (r, t) in enumerate(self.rounds)] + [
                f"{'settled' if self.converged else 'not settled; kept the best measured'}: rows {list(self.rows)}"]


def fixed_point_rows(total: int, rows: Sequence[int], measure_s: Callable[[tuple[int, ...]], Sequence[float]],
                     max_rows: Sequence[int | None] | None = None, max_rounds: int = 3,
                     min_gain: float = 0.01, max_step: float = 0.25) -> FixedPointSplit:
    """Rows per rank that equalize the ranks' *measured* times when a rank's speed per row depends on its rows.

    A split in proportion to speeds measured at one size overshoots where the speed per row falls with the rows
    (a CPU rank whose activations leave its cache: benchmarks/RESULTS.md, "bench_hetero with twice the rows").
    So: measure every rank at the rows it would get (``measure_s(rows)``: seconds per rank, all ranks at once),
    model each rank at its speed per row *at that split* (``t_i(n) = t_i * n / rows_i``; from the second round, the
    line through its last two measurements, :func:`_local_model`), re-split with
    :func:`balanced_rows` (within ``max_rows``), and repeat until the split stops moving -- the next split's
    predicted gain (slowest measured / slowest predicted) under ``1 + min_gain`` -- or ``max_rounds``
    measurements were taken. A round moves no rank's rows by more than ``max_step`` of them (the move is
    shortened along its direction: one noisy measurement cannot send the split far). At the fixed point the measured times are equal (within ``min_gain``). The first,
    proportional step converges when the time per row changes more slowly than the rows
    (``|d ln(t/n) / d ln n| < 1``); the secant steps after it as Newton's method does.

    ``rows``: the first split to measure (every rank > 0 rows; e.g. :func:`proportional_rows` by a profile).
    Returns the last measured split when it settled, else the measured split whose slowest rank was fastest.

    Raises:
        UsageError: ``rows`` do not add up to ``total`` or hold a rank with 0 rows; a measurement is not positive
            or has the wrong length; ``max_rounds`` < 1.
    """
    cur = tuple(int(r) for r in rows)
    if sum(cur) != total or any(r <= 0 for r in cur) or max_rounds < 1:
        raise UsageError(f"fixed_point_rows: start rows {list(cur)} must add up to {total}, each > 0, "
                         f"with max_rounds >= 1 (got {max_rounds})")
    rounds: list[tuple[tuple[int, ...], tuple[float, ...]]] = []
    for _ in range(max_rounds):
        t = tuple(float(x) for x in measure_s(cur))
        if len(t) != len(cur) or not all(x > 0 and math.isfinite(x) for x in t):
            raise UsageError(f"fixed_point_rows: need a positive time per rank for rows {list(cur)}, got {list(t)}")
        rounds.append((cur, t))
        models = [_local_model(i, rounds) for i in range(len(cur))]
        nxt = _shortened(cur, balanced_rows(total, models, max_rows), max_step)
        predicted = max(m(n) for m, n in zip(models, nxt))
        if nxt == cur or max(t) <= (1.0 + min_gain) * predicted:
            return FixedPointSplit(cur, tuple(rounds), True)
        if any(n == 0 for n in nxt):
            break  # a rank left without rows cannot be measured; keep the best measured split
        cur = nxt
    best = min(rounds, key=lambda rt: max(rt[1]))
    return FixedPointSplit(best[0], tuple(rounds), False)


def _shortened(cur: tuple[int, ...], nxt: tuple[int, ...], max_step: float) -> tuple[int, ...]:
    """``cur`` moved toward ``nxt`` so that no rank's rows change by more than ``max_step`` of ``cur``'s (same
    total; rounded by largest remainder)."""
    alpha = min([1.0] + [max_step * c / abs(n - c) for c, n in zip(cur, nxt) if n != c])
    if alpha >= 1.0:
        return nxt
    x = [c + alpha * (n - c) for c, n in zip(cur, nxt)]
    out = [math.floor(v) for v in x]
    for i in sorted(range(len(x)), key=lambda i: out[i] - x[i])[:sum(cur) - sum(out)]:
        out[i] += 1
    return tuple(out)


def _local_model(i: int, rounds: Sequence[tuple[tuple[int, ...], tuple[float, ...]]]) -> Callable[[int], float]:
    """Rank ``i``'s seconds for ``n`` rows near its last measured split: through the last measurement, with the
    slope of the line through the last two (a secant: how its time grows with its rows there) when they lie 2% of
    the rows or more apart and that slope is within 0.5x-2x the time per row measured last; else in proportion
    to the rows (the time per row of the last split: a secant outside that range is the measurements' noise)."""
    n1, t1 = rounds[-1][0][i], rounds[-1][1][i]
    per_row = t1 / n1
    slope = per_row
    if len(rounds) > 1:
        n0, t0 = rounds[-2][0][i], rounds[-2][1][i]
        secant = (t1 - t0) / (n1 - n0) if abs(n1 - n0) >= 0.02 * n1 else 0.0
        if 0.5 * per_row <= secant <= 2.0 * per_row:
            slope = secant
    return lambda n: max(t1 + slope * (n - n1), 0.0)


# --- rank mapping ----------------------------------------------------------------------------------

def _bandwidth(cluster: Any, a: int, b: int) -> float:
    return float(cluster.link(a, b).bandwidth_bytes_per_s)


def _block_bandwidth(cluster: Any, x: Sequence[int], y: Sequence[int]) -> float:
    return min(_bandwidth(cluster, a, b) for a in x for b in y)


def mapping_cost_s(cluster: Any, mesh: Any, axis_bytes: Mapping[str, float], rank_to_device: Sequence[int]) -> float:
    """Seconds the per-step traffic ``axis_bytes`` (bytes per mesh axis) costs under ``rank_to_device``: for
    each axis, its bytes over the slowest link inside its slowest group (a ring runs at its slowest hop)."""
    total = 0.0
    for axis in mesh.names:
        if mesh.size(axis) < 2 or not axis_bytes.get(axis):
            continue
        k = mesh.index(axis)
        groups: dict[tuple, list[int]] = {}
        for r in range(mesh.world_size):
            c = list(mesh.coords(r))
            c[k] = -1
            groups.setdefault(tuple(c), []).append(rank_to_device[r])
        slowest = min(min(_bandwidth(cluster, a, b) for a in g for b in g if a != b) for g in groups.values())
        total += float(axis_bytes[axis]) / slowest
    return total


def map_ranks(cluster: Any, mesh: Any, axis_bytes: Mapping[str, float]) -> tuple[tuple[int, ...], str]:
    """The device each program rank of ``mesh`` runs on, and one line saying why.

    ``axis_bytes``: the bytes each mesh axis communicates per step (e.g. the lowered programs' collectives).
    The heaviest axis is placed first: the devices are grouped into that axis's groups greedily by link
    bandwidth (start from the lowest free device, add the free device with the fastest link to the group),
    then those groups into the next axis's groups the same way (the bandwidth between two groups is their
    slowest pair), and so on; so the heaviest axis stays inside a host, or on a cluster file's fast pairs. The
    result is kept only where :func:`mapping_cost_s` says it beats the identity (rank r on device r).
    """
    n = mesh.world_size
    identity = tuple(range(n))
    if n != cluster.world_size:
        raise UsageError(f"mesh {mesh} has {n} ranks, the cluster {cluster!r} {cluster.world_size}")
    heavy = sorted((a for a in mesh.names if mesh.size(a) > 1), key=lambda a: (-float(axis_bytes.get(a, 0.0)),
                                                                              -mesh.index(a)))
    if n < 3 or not heavy or not any(axis_bytes.get(a) for a in heavy):
        return identity, "identity (nothing to gain)"
    blocks: list[list[int]] = [[d] for d in range(n)]
    coord: dict[int, dict[str, int]] = {d: {} for d in range(n)}
    for axis in heavy:
        size = mesh.size(axis)
        free = list(blocks)
        grouped = []
        while free:
            group = [free.pop(0)]
            while len(group) < size:
                best = max(free, key=lambda b: (min(_block_bandwidth(cluster, g, b) for g in group), -b[0]))
                free.remove(best)
                group.append(best)
            for i, b in enumerate(group):
                for d in b:
                    coord[d][axis] = i
            grouped.append([d for b in group for d in b])
        blocks = grouped
    mapping = [0] * n
    for d in range(n):
        mapping[mesh.rank(tuple(coord[d].get(a, 0) for a in mesh.names))] = d
    greedy = tuple(mapping)
    before, after = mapping_cost_s(cluster, mesh, axis_bytes, identity), mapping_cost_s(cluster, mesh, axis_bytes,
                                                                                         greedy)
    if greedy == identity or after >= before * (1 - 1e-9):
        return identity, f"identity: {', '.join(heavy)} already on the fastest links"
    return greedy, (f"{', '.join(heavy)} heaviest first on the fastest links: predicted communication "
                    f"{before * 1e3:.3f} -> {after * 1e3:.3f} ms per step")


def permuted_cluster(cluster: Any, rank_to_device: Sequence[int] | None) -> Any:
    """The cluster as the programs see it: rank r is device ``rank_to_device[r]`` (its host, figures, cpus and
    links). The identity (or None) returns ``cluster`` itself."""
    import dataclasses

    from .cluster import Cluster, Host, Link

    if rank_to_device is None or tuple(rank_to_device) == tuple(range(cluster.world_size)):
        return cluster
    m = list(rank_to_device)
    inverse = {d: r for r, d in enumerate(m)}
    hosts = []
    for h in cluster.hosts:
        devs = sorted((dataclasses.replace(d, rank=inverse[d.rank]) for d in h.devices), key=lambda d: d.rank)
        hosts.append(Host(h.name, tuple(devs)))
    links = tuple(link if link.ranks is None else Link(link.tier, link.bandwidth_bytes_per_s, link.latency_s,
                                                        (inverse[link.ranks[0]], inverse[link.ranks[1]]))
                  for link in cluster.links)
    return Cluster(tuple(hosts), links, cluster.calibration)


def program_cluster(plan: Any, cluster: Any) -> Any:
    """The cluster as ``plan``'s programs see it (:func:`permuted_cluster` by ``plan.devices``; ``cluster`` when
    the plan maps rank r to device r)."""
    devices = getattr(plan, "devices", None)
    return permuted_cluster(cluster, devices.rank_to_device if devices is not None else None)
