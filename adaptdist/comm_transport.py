"""Which transport each mesh axis's collectives take: gloo, or adaptdist's shared-memory kernels.

``--comm auto|shm|gloo`` (:attr:`~adaptdist.lowering_options.LoweringOptions.comm`, ``adaptdist.backend(comm=...)``)
chooses; the lowering's last pass (``passes/use_shm_collectives.py``) then swaps an axis's
``_c10d_functional.X(..., group_name)`` + ``wait_tensor`` for ``torch.ops.adaptdist.shm_X(..., group_name)``
(:mod:`adaptdist.kernels.shm`). An axis takes shared memory when every group of it (one per setting of the other
axes, :meth:`~adaptdist.mesh.Mesh.groups`) has all its ranks on one host:

- ``gloo``: never;
- ``auto`` (default): where the kernels are loaded (:func:`adaptdist.kernels.available`) and the hosts are known;
- ``shm``: required: :func:`adaptdist.kernels.require` raises ShmUnavailableError without the kernels. An axis
  whose groups cross hosts stays on gloo either way. Unknown hosts (``hosts`` None) count as one host here;
  the runtime's group set-up (``init_group``) refuses a group that turns out to span hosts.

Transports per axis: ``"shm"``, ``"gloo"``, or ``"none"`` for an axis of size 1 (no collectives).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Mapping, Sequence

from .errors import UsageError
from .mesh import Mesh

log = logging.getLogger("adaptdist.compiler")

if TYPE_CHECKING:
    from .plan import Plan

COMM_MODES = ("auto", "shm", "gloo")
"""``LoweringOptions.comm``: how collectives are carried (see the module docstring)."""
TRANSPORTS = ("shm", "gloo", "none")

SHM_OPS = {
    "all_reduce": "shm_all_reduce",
    "all_gather_into_tensor": "shm_all_gather_into_tensor",
    "reduce_scatter_tensor": "shm_reduce_scatter_tensor",
    "all_to_all_single": "shm_all_to_all_single",
    "broadcast": "shm_broadcast",
}
"""``torch.ops._c10d_functional.<name>`` -> the ``torch.ops.adaptdist.<name>`` that takes the same arguments."""

SHM_START_OPS = {
    "all_reduce": "shm_all_reduce_start",
    "all_gather_into_tensor": "shm_all_gather_into_tensor_start",
    "reduce_scatter_tensor": "shm_reduce_scatter_tensor_start",
}
"""The collectives that can also be started and waited for later (``torch.ops.adaptdist.shm_wait``), as a functional
collective and its ``wait_tensor``: the caller computes on while the group's comm thread carries them."""
SHM_FLATTEN_OP = "shm_flatten_all_reduce_start"
"""A gradient bucket's flatten (``torch.cat`` of 1-d tensors) fused with its started all_reduce: the tensors are
copied straight into the rank's registered input region (the all_reduce then skips its copy-in); waited for with
``shm_wait`` (:func:`adaptdist.passes.use_shm_collectives.use_shm_collectives`)."""
SHM_WAIT_OP = "shm_wait"

_SHM_CALL = re.compile(r"torch\.ops\.adaptdist\.(shm_\w+)\.default\(.*?'([^']+)'\)")


def axis_transports(mesh: Mesh, comm: str, hosts: Sequence[str] | None, *, kernels_available: bool | None = None,
                    what: str = "--comm shm") -> dict[str, str]:
    """The transport of each axis of ``mesh`` under ``comm`` (see the module docstring).

    Args:
        mesh: the program's mesh; ranks row-major (``Mesh.groups``).
        comm: one of :data:`COMM_MODES`.
        hosts: the host name of each mesh rank (index = rank), or None when unknown.
        kernels_available: whether the shm kernels can run (None: ask :func:`adaptdist.kernels.available`).
        what: the request named in the error for ``comm="shm"`` without the kernels.

    Raises:
        UsageError: an unknown ``comm`` or a ``hosts`` of the wrong length.
        ShmUnavailableError: ``comm == "shm"`` and the kernels are unavailable.
    """
    if hosts is not None and len(hosts) != mesh.world_size:
        raise UsageError(f"comm: {len(hosts)} host names for mesh {mesh} of {mesh.world_size} ranks")
    usable = shm_usable(comm, hosts, kernels_available=kernels_available, what=what)
    out = {}
    for axis in mesh.names:
        if mesh.size(axis) == 1:
            out[axis] = "none"
        elif usable and all(on_one_host(hosts, g) for g in mesh.groups(axis)):
            out[axis] = "shm"
        else:
            out[axis] = "gloo"
    return out


def fit_shm_space(mesh: Mesh, transports: Mapping[str, str], space: tuple[int, int] | None = None
                  ) -> dict[str, str]:
    """``transports`` (of ``--comm auto``) with the shm axes whose groups /dev/shm has no room for put on gloo, with
    one warning naming them, /dev/shm's size and free bytes, and what to try. Each group reserves its header and
    slots when made (a full /dev/shm makes that a ShmCapacityError, never a crash; their slots shrink towards
    MIN_SLOT_BYTES where /dev/shm is small: :func:`adaptdist.kernels.shm.groups_fixed_bytes` counts what they take,
    made in mesh order); the axes are kept in mesh order while they fit. ``space``:
    ``(size_bytes, free_bytes)`` (None: :func:`adaptdist.kernels.shm.shm_space` of /dev/shm; unreadable: unchanged).
    The ranks' output and input regions are reserved as used and fall back to private memory without room, so they
    are not counted."""
    from .kernels.shm import groups_fixed_bytes, shm_space

    axes = [a for a, t in transports.items() if t == "shm"]
    if not axes:
        return dict(transports)
    space = space if space is not None else shm_space()
    if space is None:
        return dict(transports)
    size, free = space
    out, dropped = dict(transports), []
    sizes: list[int] = []
    for axis in axes:
        kept = groups_fixed_bytes(sizes, free)
        need = groups_fixed_bytes(sizes + [len(g) for g in mesh.groups(axis)], free) - kept
        if kept + need <= free:
            sizes += [len(g) for g in mesh.groups(axis)]
        else:
            out[axis] = "gloo"
            dropped.append(f"{axis!r} ({len(mesh.groups(axis))} group(s) of {mesh.size(axis)} ranks: {need} bytes)")
    if dropped:
        log.warning("adaptdist: --comm auto puts mesh axis %s on gloo, not shared memory: /dev/shm has %d bytes free "
                    "of %d, too few for its shared-memory groups' slots. For shared-memory collectives give /dev/shm "
                    "more space (e.g. `docker run --shm-size=1g`); --comm gloo silences this", ", ".join(dropped),
                    free, size)
    return out


def shm_space_fits(group_sizes: Sequence[int], what: str, space: tuple[int, int] | None = None) -> bool:
    """Whether /dev/shm (``space``: ``(size_bytes, free_bytes)``; None: read it) has room for the slots of groups of
    ``group_sizes`` ranks (:func:`adaptdist.kernels.shm.groups_fixed_bytes`); if not, one warning naming ``what``,
    the bytes, and what to try. Unreadable: True."""
    from .kernels.shm import groups_fixed_bytes, shm_space

    space = space if space is not None else shm_space()
    if space is None:
        return True
    need = groups_fixed_bytes(group_sizes, space[1])
    if need <= space[1]:
        return True
    log.warning("adaptdist: --comm auto puts %s on gloo, not shared memory: their slots need %d bytes and /dev/shm "
                "has %d bytes free of %d. For shared-memory collectives give /dev/shm more space (e.g. `docker run "
                "--shm-size=1g`); --comm gloo silences this", what, need, space[1], space[0])
    return False


def shm_usable(comm: str, hosts: Sequence[str] | None, *, kernels_available: bool | None = None,
               what: str = "--comm shm") -> bool:
    """Whether ``comm`` puts one-host groups on shared memory at all (module docstring): ``shm`` (after
    :func:`adaptdist.kernels.require`), or ``auto`` with the kernels loaded and ``hosts`` known.

    Raises:
        UsageError: an unknown ``comm``.
        ShmUnavailableError: ``comm == "shm"`` and the kernels are unavailable.
    """
    if comm not in COMM_MODES:
        raise UsageError(f"comm must be one of {COMM_MODES} (--comm, adaptdist.backend(comm=...)), got {comm!r}")
    if comm == "shm":
        from .kernels import require

        require(what)
        return True
    if comm == "auto":
        if kernels_available is None:
            from .kernels import available

            kernels_available = available()
        return bool(kernels_available) and hosts is not None
    return False


def on_one_host(hosts: Sequence[str] | None, ranks: Sequence[int]) -> bool:
    """Whether ``ranks`` share a host by ``hosts`` (each rank's host; None: unknown, counted as one host here, the
    runtime's ``init_group`` refusing a group that spans hosts)."""
    return hosts is None or len({hosts[r] for r in ranks}) == 1


def mesh_rank_hosts(plan: "Plan", hosts: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """The host of each *mesh* rank of ``plan``, from ``hosts`` (the host of each cluster rank): through the plan's
    rank-to-device mapping (``plan.devices.rank_to_device``) when it has one. ``hosts`` of one host fits any number
    of ranks (a local cluster compiled again at another size, e.g. ``estimate --symbolic``); None when ``hosts`` is
    None or, naming several hosts, does not fit the mesh."""
    world = plan.mesh_spec.world_size
    if hosts is not None and len(hosts) != world and len(set(hosts)) == 1:
        return (hosts[0],) * world
    if hosts is None or len(hosts) != world:
        return None
    order = plan.devices.rank_to_device if plan.devices is not None else None
    return tuple(hosts[d] for d in order) if order is not None else tuple(hosts)


def _adaptdist_op_name(target) -> str | None:
    name = getattr(target, "name", None)
    try:
        text = name() if callable(name) else ""
    except Exception:  # noqa: BLE001 -- not an OpOverload
        return None
    return text[len("adaptdist::"):] if isinstance(text, str) and text.startswith("adaptdist::shm_") else None


def is_shm_collective(target) -> bool:
    """Whether ``target`` is one of adaptdist's shared-memory collective ops (``torch.ops.adaptdist.shm_*``), complete
    on return or started (:data:`SHM_START_OPS`); not ``shm_wait``."""
    return _adaptdist_op_name(target) in (*SHM_OPS.values(), *SHM_START_OPS.values(), SHM_FLATTEN_OP)


def is_shm_started(target) -> bool:
    """Whether ``target`` is a started shared-memory collective (complete only at its ``shm_wait``)."""
    return _adaptdist_op_name(target) in (*SHM_START_OPS.values(), SHM_FLATTEN_OP)


def is_shm_wait(target) -> bool:
    """Whether ``target`` is ``torch.ops.adaptdist.shm_wait``."""
    return _adaptdist_op_name(target) == SHM_WAIT_OP


def cluster_for_comm(cluster, comm: str):
    """``cluster`` as the cost models and the planner should see it under ``comm``: with ``auto`` (kernels loaded)
    or ``shm``, its one-host (``intra_host``) collectives are priced as the shared-memory kernels' (an axis whose
    ranks share a host is exactly one the lowering puts on shared memory): at their measured ``shm`` fits, or,
    without them (not profiled with the kernels), at the estimated figures of
    :func:`~adaptdist.cost_models.hardware.default_shm_link` (:meth:`~adaptdist.cluster.Cluster.with_shm_collectives`);
    send/recv keeps gloo's. Else ``cluster`` itself."""
    if cluster is None or comm == "gloo" or not hasattr(cluster, "with_shm_collectives"):
        return cluster
    if comm == "auto":
        from .kernels import available

        if not available():
            return cluster
    return cluster.with_shm_collectives()


def shm_groups_in_code(code: str) -> list[str]:
    """The group names that a program's source passes to ``torch.ops.adaptdist.shm_*`` ops, in first-use order
    (what the runtime must set up with ``init_group`` before the program runs)."""
    seen: list[str] = []
    for m in _SHM_CALL.finditer(code):
        if m.group(2) not in seen:
            seen.append(m.group(2))
    return seen


def transports_of_code(code: str, group_names: Mapping[str, str], mesh: Mapping[str, int]) -> dict[str, str]:
    """Each axis's transport as a program's source shows it: ``"shm"`` where its shm ops name a group of the axis
    (``adaptdist:dp[0,1]``, :func:`adaptdist.mesh.shm_group_name`), ``"none"`` for an axis of size 1, else
    ``"gloo"`` (what ``summary.json`` records)."""
    from .mesh import base_group_name

    shm = {base_group_name(g) for g in shm_groups_in_code(code)}
    return {axis: ("none" if int(mesh.get(axis, 1)) == 1 else "shm" if name in shm else "gloo")
            for axis, name in group_names.items()}


def rank_hosts(cluster) -> tuple[str, ...] | None:
    """The host name of each rank of ``cluster`` (None for no cluster, or one whose ranks are not CPU ranks: the
    shared-memory kernels move CPU tensors)."""
    if cluster is None or getattr(cluster, "device_kinds", ("cpu",)) != ("cpu",):
        return None
    return tuple(cluster.host_of(r).name for r in range(cluster.world_size))
