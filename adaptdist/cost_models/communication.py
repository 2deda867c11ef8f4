"""Communication time of one collective: the alpha-beta model with ring and tree algorithms.

A message of ``n`` bytes between two ranks takes ``alpha + n * beta`` seconds (Hockney 1994);
``alpha`` is the link's latency (s), ``beta`` its time per byte (s/B, ``1 / bandwidth``). A
collective over ``p`` ranks is a sequence of such steps; the formulas below are from
Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH",
IJHPCA 19(1), 2005 (Thakur 2005), and NCCL's documentation: the bus-bandwidth factors in
nccl-tests ``doc/PERFORMANCE.md`` (all_reduce 2(p-1)/p, all_gather / reduce_scatter /
all_to_all (p-1)/p) are exactly the ring formulas' bandwidth terms. ``n`` is always the
*full* buffer in bytes: the all_reduce input, the all_gather output, the reduce_scatter
input, the all_to_all input of one rank.

    ==============  =====================================  =======================================
    collective      ring (bandwidth-optimal)               tree (latency-optimal)
    ==============  =====================================  =======================================
    all_reduce      2(p-1) a + 2 (p-1)/p n b               2 ceil(log2 p) a + 2 n b  (NCCL double
                    (Thakur 2005 s.4.4, ring = reduce-     binary tree, Jeaugey 2019; Sanders,
                    scatter + all-gather)                  Speck & Traeff 2009)
    all_gather      (p-1) a + (p-1)/p n b (Thakur s.4.1)   ceil(log2 p) a + (p-1)/p n b
                                                           (recursive doubling, Thakur s.4.1)
    reduce_scatter  (p-1) a + (p-1)/p n b (Thakur s.4.3)   ceil(log2 p) a + (p-1)/p n b
                                                           (recursive halving, Thakur s.4.3)
    all_to_all      (p-1) a + (p-1)/p n b (pairwise        ceil(log2 p) a + n/2 ceil(log2 p) b
                    exchange, Thakur s.4.5)                (Bruck, Thakur s.4.5)
    broadcast       as tree                                ceil(log2 p) (a + n b) (binomial tree,
                                                           Thakur s.4.2)
    send_recv       a + n b                                a + n b
    ==============  =====================================  =======================================

``algorithm="auto"`` takes the faster of the two (NCCL chooses per message size from its own
tuning model; the minimum is that choice idealized). The reduction arithmetic (Thakur's
gamma term) is left out: it is memory-bound and small next to the transfer.

Every function here works on Python numbers and on sympy expressions alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .. import _torch_compat as compat
from ..errors import ClusterSpecError, UsageError
from .hardware import ClusterLike
from .numbers import ceil_log2, smin

ALGORITHMS = ("ring", "tree", "auto")
CALIBRATED_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""Collectives a cluster may hold a calibrated fit for (``adaptdist.cluster.COLLECTIVES``)."""

_SHM_KINDS = {"shm_all_reduce": "all_reduce", "shm_all_gather_into_tensor": "all_gather",
              "shm_reduce_scatter_tensor": "reduce_scatter", "shm_all_to_all_single": "all_to_all",
              "shm_broadcast": "broadcast", "shm_all_reduce_start": "all_reduce",
              "shm_all_gather_into_tensor_start": "all_gather", "shm_reduce_scatter_tensor_start": "reduce_scatter",
              "shm_flatten_all_reduce_start": "all_reduce",
              "shm_wait": "wait"}


def functional_collective_kind(target: Any) -> str | None:
    """The collective a ``_c10d_functional.*`` op issues (``"all_reduce"``, ``"all_gather"``, ...),
    ``"wait"`` for ``wait_tensor``, None for anything else (by op handle: :mod:`adaptdist._torch_compat`).
    adaptdist's shared-memory ops (``torch.ops.adaptdist.shm_*``) count as the collective they carry (complete on
    return, :func:`is_synchronous_collective`, or started, then ``shm_wait``: ``"wait"``)."""
    from ..comm_transport import is_shm_collective, is_shm_wait

    kind = compat.functional_collective_kind(target)
    if kind is None and (is_shm_collective(target) or is_shm_wait(target)):
        kind = _SHM_KINDS.get(str(target.name()).split("::")[-1].split(".")[0])
    return kind


def is_synchronous_collective(target: Any) -> bool:
    """Whether ``target`` is a collective complete on return (adaptdist's shared-memory ops, not the started ones):
    its cost is waited for at its issue."""
    from ..comm_transport import is_shm_collective, is_shm_started

    return is_shm_collective(target) and not is_shm_started(target)


def is_shm_priced(target: Any) -> bool:
    """Whether ``target`` is one of adaptdist's shared-memory collectives (complete on return or started): a one-host
    group's ``intra_host`` figures are the kernels' (``--comm``)."""
    from ..comm_transport import is_shm_collective

    return is_shm_collective(target)


def ring_time_s(collective: str, n_bytes, p, alpha_s, beta_s_per_byte):
    """Ring algorithm time in seconds (table in the module docstring).

    Args:
        collective: one of all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send_recv.
        n_bytes: full buffer size, bytes (see the module docstring); p: ranks in the group.
        alpha_s: per-message latency, s; beta_s_per_byte: per-byte time, s/B.

    Raises:
        UsageError: an unknown collective.
    """
    if collective == "send_recv":
        return alpha_s + n_bytes * beta_s_per_byte
    if collective == "broadcast":
        return tree_time_s(collective, n_bytes, p, alpha_s, beta_s_per_byte)
    if collective == "all_reduce":
        return 2 * (p - 1) * alpha_s + 2 * (p - 1) * n_bytes * beta_s_per_byte / p
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) * alpha_s + (p - 1) * n_bytes * beta_s_per_byte / p
    raise UsageError(f"no communication formula for collective {collective!r}; known: all_reduce, all_gather, "
                     "reduce_scatter, all_to_all, broadcast, send_recv")


def tree_time_s(collective: str, n_bytes, p, alpha_s, beta_s_per_byte):
    """Tree / recursive-doubling algorithm time in seconds (table in the module docstring).

    Arguments and errors as for :func:`ring_time_s`; ``ceil(log2 p)`` steps (0 for p = 1).
    """
    steps = ceil_log2(p)
    if collective == "send_recv":
        return alpha_s + n_bytes * beta_s_per_byte
    if collective == "all_reduce":
        return 2 * steps * alpha_s + 2 * n_bytes * beta_s_per_byte
    if collective in ("all_gather", "reduce_scatter"):
        return steps * alpha_s + (p - 1) * n_bytes * beta_s_per_byte / p
    if collective == "all_to_all":
        return steps * alpha_s + n_bytes * steps * beta_s_per_byte / 2
    if collective == "broadcast":
        return steps * (alpha_s + n_bytes * beta_s_per_byte)
    raise UsageError(f"no communication formula for collective {collective!r}; known: all_reduce, all_gather, "
                     "reduce_scatter, all_to_all, broadcast, send_recv")


def collective_time_s(collective: str, n_bytes, p, alpha_s, beta_s_per_byte, algorithm: str = "ring"):
    """Time of one collective over ``p`` ranks, seconds; 0 when ``p`` is 1 (nothing moves).

    ``algorithm``: ``"ring"``, ``"tree"`` or ``"auto"`` (the smaller of the two). Formulas and
    sources in the module docstring.

    Raises:
        UsageError: an unknown collective or algorithm.
    """
    if algorithm not in ALGORITHMS:
        raise UsageError(f"collective algorithm {algorithm!r} is not one of {ALGORITHMS}")
    if isinstance(p, int) and p <= 1 and collective != "send_recv":
        return 0.0
    if algorithm == "ring":
        return ring_time_s(collective, n_bytes, p, alpha_s, beta_s_per_byte)
    if algorithm == "tree":
        return tree_time_s(collective, n_bytes, p, alpha_s, beta_s_per_byte)
    return smin(ring_time_s(collective, n_bytes, p, alpha_s, beta_s_per_byte),
                tree_time_s(collective, n_bytes, p, alpha_s, beta_s_per_byte))


def per_step_fit(collective: str, p: int, total_alpha_s: float, total_beta_s_per_byte: float,
                 algorithm: str = "ring") -> tuple[float, float]:
    """Convert a whole-collective timing fit ``t(n) = a + b n`` measured on ``p`` ranks into the
    per-message ``(alpha_s, beta_s_per_byte)`` that the formulas above take, by dividing out the
    algorithm's step count and bandwidth factor (e.g. ring all_reduce: ``alpha = a / (2(p-1))``,
    ``beta = b p / (2(p-1))``).

    Raises:
        UsageError: ``p < 2`` (a one-rank collective has no steps to divide by) or an unknown collective.
    """
    if p < 2:
        raise UsageError(f"a collective fit needs a group of at least 2 ranks, got p={p}")
    a_coeff = collective_time_s(collective, 0, p, 1.0, 0.0, algorithm)
    b_coeff = collective_time_s(collective, 1, p, 0.0, 1.0, algorithm)
    return total_alpha_s / a_coeff, total_beta_s_per_byte / b_coeff


def group_members(group_name: str, rank: int, mesh: Mapping[str, int]) -> tuple[int, ...]:
    """The ranks of ``rank``'s process group ``group_name`` (``"adaptdist:<axis>"``, or a shared-memory group's
    ``"adaptdist:<axis>[ranks]"``), in axis order.

    Ranks are laid out row-major over the mesh axes (outermost first), as
    ``torch.distributed.device_mesh`` lays them out: on ``{"dp": 2, "tp": 2}`` rank 3 is at
    ``(dp=1, tp=1)`` and its ``tp`` group is ``(2, 3)``, its ``dp`` group ``(1, 3)``. This is the one
    place that maps a group name to ranks.

    Raises:
        UsageError: the name is not ``adaptdist:<axis>`` of an axis of ``mesh``, or ``rank`` is outside it.
    """
    from ..mesh import base_group_name

    prefix, _, axis = base_group_name(group_name).partition(":")  # a shm group's name: its axis's
    if prefix != "adaptdist" or axis not in mesh:
        raise UsageError(f"collective group {group_name!r} is not 'adaptdist:<axis>' for an axis of mesh "
                         f"{dict(mesh)}; the cost model cannot tell which ranks take part")
    sizes = [int(s) for s in mesh.values()]
    world = math.prod(sizes)
    if not 0 <= rank < world:
        raise UsageError(f"rank {rank} is outside mesh {dict(mesh)} of {world} ranks")
    k = list(mesh).index(axis)
    coords, r = [], rank
    for s in reversed(sizes):
        coords.append(r % s)
        r //= s
    coords.reverse()
    members = []
    for i in range(sizes[k]):
        c = coords.copy()
        c[k] = i
        flat = 0
        for ci, s in zip(c, sizes):
            flat = flat * s + ci
        members.append(flat)
    return tuple(members)


@dataclass(frozen=True)
class LinkCost:
    """The alpha-beta figures one collective runs at: ``tier`` of its slowest hop, and whether they
    came from a calibrated fit."""

    alpha_s: float
    beta_s_per_byte: float
    tier: str
    calibrated: bool


def _shm_fit(cluster: ClusterLike, collective: str) -> Any:
    """The cluster's measured fit of ``collective`` through the shared-memory kernels (calibration tier ``shm``),
    or None."""
    if collective == "send_recv" or collective not in CALIBRATED_COLLECTIVES:
        return None
    try:
        return cluster.collective_fit(collective, "shm")
    except ClusterSpecError:  # a cluster without that tier
        return None


def link_cost(cluster: ClusterLike, collective: str, members: Sequence[int], shm: bool = False) -> LinkCost:
    """The per-message alpha and per-byte beta a collective over ``members`` runs at.

    ``shm``: the collective is one of adaptdist's shared-memory ops (:func:`is_shm_priced`), or the
    cluster is marked ``shm_collectives`` (the ``--comm auto|shm`` view the planner prices with) and the collective
    is not send_recv; on one host it runs at the cluster's measured ``shm`` fit (``adaptdist cluster profile`` with the kernels), else at the
    cost model's estimated shared-memory figures (:func:`~.hardware.default_shm_link`), never at gloo's.

    The ring's hops are consecutive members (and last -> first); a ring runs at its slowest hop,
    so the tier is ``inter_host`` when any hop crosses hosts. When the cluster has a calibrated
    fit for (collective, tier) -- a whole-collective ``t(n) = alpha_s + beta_s_per_byte n`` measured
    on ``num_ranks`` ranks (``adaptdist.cluster.CollectiveFit``; this group's size when it does not
    say) -- it is turned into per-message figures by :func:`per_step_fit` with the ring formula (the
    rescaling ``adaptdist.cluster`` documents), so the formula gives the fit back at ``num_ranks``
    and rescales it to other group sizes. Else alpha is the largest hop latency and beta the inverse
    of the smallest hop bandwidth. ``broadcast`` has no calibrated fit.

    Raises:
        ClusterSpecError: a member is outside the cluster (from the cluster), or a link has no
            positive bandwidth.
    """
    if len(members) < 2:
        return LinkCost(0.0, 0.0, "intra_host", False)
    # a cluster viewed under --comm auto|shm (Cluster.with_shm_collectives): its one-host collectives are the
    # kernels', even before lowering names the shm ops (the planner prices functional collectives); send/recv stays gloo
    shm = shm or (collective != "send_recv" and bool(getattr(cluster, "shm_collectives", False)))
    hops = [cluster.link(a, b) for a, b in zip(members, list(members[1:]) + [members[0]])]
    tier = "inter_host" if any(h.tier == "inter_host" for h in hops) else "intra_host"
    fit = _shm_fit(cluster, collective) if shm and tier == "intra_host" else None
    if shm and tier == "intra_host" and fit is None:
        from .hardware import default_shm_link

        figures = default_shm_link(getattr(cluster.device(members[0]), "kind", ""))
        if figures is not None:
            return LinkCost(figures.latency_s, 1.0 / figures.bandwidth_bytes_per_s, tier, False)
    if fit is None and collective in CALIBRATED_COLLECTIVES:  # gloo's (or, where the kernels do not apply, nccl's)
        fit = cluster.collective_fit(collective, tier)
    if fit is not None:
        p_fit = getattr(fit, "num_ranks", None)
        p_fit = p_fit if isinstance(p_fit, int) and p_fit >= 2 else len(members)
        alpha, beta = per_step_fit(collective, p_fit, float(fit.alpha_s), float(fit.beta_s_per_byte), "ring")
        return LinkCost(alpha, beta, tier, True)
    slowest = min(h.bandwidth_bytes_per_s for h in hops)
    if slowest <= 0:
        raise ClusterSpecError(f"a link between ranks {list(members)} has bandwidth {slowest} B/s; it must be > 0")
    return LinkCost(max(h.latency_s for h in hops), 1.0 / slowest, tier, False)
