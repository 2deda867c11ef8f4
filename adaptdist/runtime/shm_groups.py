"""Setting up the shared-memory groups a rank program's ``torch.ops.adaptdist.shm_*`` ops name.

The lowering puts mesh axes whose ranks share a host on adaptdist's shared-memory collectives
(:mod:`adaptdist.comm_transport`); their ops name the shared-memory group by the axis and this rank's group's
ranks (``"adaptdist:dp[0,2]"``, :func:`adaptdist.mesh.shm_group_name`), so graphs over other ranks (the
torch.compile backend's graphs on different meshes, a pipeline's groups) never share a group. Before such a
program runs, every rank creates the shared-memory group of each of those axes over the gloo group it shadows
(:func:`adaptdist.kernels.shm.init_group`, a collective over that group), in one order on every rank.

Under ``--comm auto`` a group that /dev/shm has no room for when the run starts (ShmCapacityError: /dev/shm filled
after the lowering's check, :func:`adaptdist.comm_transport.fit_shm_space`, or the artifacts compiled where it was
larger) is no error: the ranks agree (one all_gather over the world, bounded by the collective timeout) on the axes
whose group some rank could not make, destroy their groups of those axes, and rewrite their programs to carry those
axes' collectives through gloo (:func:`use_gloo_for_axes`), with one warning. Once, before the first step: the
steps pay nothing for it. ``--comm shm`` still raises the ShmCapacityError.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..comm_transport import shm_groups_in_code
from ..errors import ShmCapacityError
from ..kernels.shm import DEFAULT_TIMEOUT_S

log = logging.getLogger("adaptdist.runtime")


def setup_shm_groups(code: str, group_names: Mapping[str, str], process_group: Callable[[str], Any],
                     timeout_s: float | None = None) -> list[str]:
    """Create the shared-memory groups that ``code`` (a program's source) names; returns their names.

    Args:
        code: the program's source (its shm ops name their groups in it).
        group_names: mesh axis -> group name, in mesh order (``RankProgram.group_names``).
        process_group: axis -> this rank's gloo process group of that axis.
        timeout_s: the collective timeout of the shm ops (None: the kernels' default, 120 s).

    A group of that name made before in this process (an earlier attempt's, or an earlier graph's over the same
    ranks) is destroyed first. Programs compiled before groups were named by their ranks name the axis's group
    (``"adaptdist:dp"``); that name is made too.

    Raises:
        ShmUnavailableError: the program uses the kernels and they are unavailable here.
        ShmCapacityError: /dev/shm has no room for a group's header and slots (``--comm auto`` falls back to gloo
            instead through :func:`setup_shm_groups_or_gloo`).
        UsageError: an axis's ranks are not on one host (the shm groups cannot join them).
        ShmPeerError: a peer did not attach within the timeout.
        ProgramLoadError: the code names a group that is none of its axes' groups.
    """
    return setup_shm_groups_or_gloo(code, group_names, process_group, timeout_s)[0]


def setup_shm_groups_or_gloo(code: str, group_names: Mapping[str, str], process_group: Callable[[str], Any],
                             timeout_s: float | None = None, *, fall_back: bool = False
                             ) -> tuple[list[str], dict[str, "ShmShortfall"]]:
    """:func:`setup_shm_groups`, and with ``fall_back`` (``--comm auto``) the mesh axes that go to gloo instead:
    ``(names made, {axis: ShmShortfall})``. Where some group of an axis could not be made for want of /dev/shm space
    (ShmCapacityError: /dev/shm filled between the lowering's check and now, or the artifacts were compiled where
    it was larger), every rank of the world learns it (:func:`agree_on_shortfalls`, a collective bounded by
    ``timeout_s``) and destroys its groups of that axis, so all ranks put the axis on gloo together (a rank on shared
    memory while its peer is on gloo would wait for it forever); the caller rewrites its program
    (:func:`use_gloo_for_axes`). Without ``fall_back`` the ShmCapacityError is raised as is (``--comm shm``)."""
    wanted = shm_groups_in_code(code)
    if not wanted:
        return [], {}
    import torch.distributed as dist

    from ..mesh import shm_group_name

    candidates = []
    axis_of: dict[str, str] = {}
    for axis, name in group_names.items():
        pg = process_group(axis)
        shm = shm_group_name(name, dist.get_process_group_ranks(pg))
        candidates += [(shm, pg), (name, pg)]  # the second: the name of programs compiled before (see above)
        axis_of[shm] = axis_of[name] = axis
    failed: dict[str, ShmShortfall] = {}

    def capacity(name: str, error: Exception) -> None:
        failed[axis_of[name]] = ShmShortfall.of(error)

    made = make_shm_groups(wanted, candidates, timeout_s, lambda unknown: f"its mesh axes' groups {dict(group_names)}",
                           on_capacity=capacity if fall_back else None)
    if not fall_back:
        return made, {}
    axes = [a for a in group_names if any(axis_of.get(n) == a for n in wanted)]
    agreed = agree_on_shortfalls(axes, failed, timeout_s)
    if agreed:
        from ..kernels.shm import destroy_group

        for name in [n for n in made if axis_of[n] in agreed]:
            destroy_group(name)
        made = [n for n in made if axis_of[n] not in agreed]
    return made, agreed


@dataclass(frozen=True)
class ShmShortfall:
    """Why an axis's shared-memory group could not be made: the bytes it needed (0: unknown) and /dev/shm's free and
    total bytes when it failed (0: unreadable)."""

    needed_bytes: int
    free_bytes: int
    size_bytes: int

    @staticmethod
    def of(error: Exception) -> "ShmShortfall":
        from ..kernels.shm import shm_space

        space = shm_space() or (0, 0)
        return ShmShortfall(int(getattr(error, "needed_bytes", None) or 0), int(space[1]), int(space[0]))


def agree_on_shortfalls(axes: Sequence[str], mine: Mapping[str, ShmShortfall], timeout_s: float | None
                        ) -> dict[str, ShmShortfall]:
    """(Collective over the world, every rank with the same ``axes``) the axes of ``axes`` whose shared-memory group
    some rank could not make (``mine``: this rank's), each with the largest need reported and the least free bytes:
    one all_gather of ``3 * len(axes)`` integers, waited for at most ``timeout_s`` (None: the kernels' default).

    Raises:
        CollectiveTimeoutError: a rank did not arrive within the timeout (its stage named)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ..errors import CollectiveTimeoutError

    mine_t = torch.zeros(len(axes), 4, dtype=torch.int64)
    for i, axis in enumerate(axes):
        if axis in mine:
            s = mine[axis]
            mine_t[i] = torch.tensor([1, s.needed_bytes, s.free_bytes, s.size_bytes])
    out = [torch.zeros_like(mine_t) for _ in range(dist.get_world_size())]
    limit = float(timeout_s or DEFAULT_TIMEOUT_S)
    try:
        dist.all_gather(out, mine_t, async_op=True).wait(timeout=timedelta(seconds=limit))
    except RuntimeError as e:
        raise CollectiveTimeoutError(f"rank {dist.get_rank()}: the ranks did not all agree within {limit:.0f} s "
                                     f"whether their shared-memory groups of mesh axes {list(axes)} could be made "
                                     f"(--comm auto): {e}") from e
    agreed: dict[str, ShmShortfall] = {}
    for i, axis in enumerate(axes):
        rows = [t[i].tolist() for t in out if int(t[i, 0])]
        if rows:
            agreed[axis] = ShmShortfall(max(r[1] for r in rows), min(r[2] for r in rows), max(r[3] for r in rows))
    return agreed


def use_gloo_for_axes(program: Any, shortfalls: Mapping[str, ShmShortfall]) -> None:
    """Rewrite ``program`` (a RankProgram) so that the collectives of the axes of ``shortfalls`` take gloo
    (:func:`adaptdist.passes.use_gloo_collectives.use_gloo_collectives`): its module (a loaded program's exec'd source
    is traced first) and its ``code``. One warning (on global rank 0) names each axis, /dev/shm's free bytes and the
    bytes its group needed."""
    if not shortfalls:
        return
    import torch.fx

    from ..mesh import base_group_name
    from ..program_source import rewrite_source

    gloo = {n: base_group_name(n) for n in shm_groups_in_code(program.code)
            if any(base_group_name(n) == program.group_names.get(a) for a in shortfalls)}
    loaded = not isinstance(program.module, torch.fx.GraphModule)
    gm, changed = _to_gloo(program.module, gloo)
    if changed:
        program.code = rewrite_source(program.code, gm)
        if loaded:  # as load_program makes it: the source exec'd, its constants set
            from ..program import module_from_source

            program.module = module_from_source(program.code, "<program rewritten for gloo>")
            for k, v in program.constants.items():
                setattr(program.module, k, v)
            program._traced = None
    warn_gloo_fallback({f"mesh axis {a!r}": s for a, s in shortfalls.items()})


def gloo_module(module: Any, gloo_names: Mapping[str, str]) -> Any:
    """``module`` (a GraphModule, or a loaded program's exec'd source: traced first) with its shared-memory collectives
    on the groups of ``gloo_names`` put back on gloo (:func:`~adaptdist.passes.use_gloo_collectives.use_gloo_collectives`);
    ``module`` itself where it has none."""
    if not gloo_names:
        return module
    gm, changed = _to_gloo(module, gloo_names)
    return gm if changed else module


def _to_gloo(module: Any, gloo_names: Mapping[str, str]) -> tuple[Any, bool]:
    """(``module`` as a GraphModule with the shared-memory collectives of ``gloo_names`` on gloo, whether any was)."""
    import torch.fx

    from ..passes.use_gloo_collectives import use_gloo_collectives

    gm = module if isinstance(module, torch.fx.GraphModule) else torch.fx.symbolic_trace(module)
    if gm is not module:
        for node in gm.graph.find_nodes(op="placeholder"):
            node.type = None  # (the source's shape annotations, "f32[4, 16]", are no types)
    return use_gloo_collectives(gm, gloo_names)


def warn_gloo_fallback(shortfalls: Mapping[str, ShmShortfall]) -> None:
    """One warning (on global rank 0): ``--comm auto`` puts each of ``shortfalls`` (a description, ``"mesh axis
    'dp'"`` -> why) on gloo, naming /dev/shm's free and total bytes and the bytes the group needed."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    log.warning("adaptdist: --comm auto puts %s on gloo, not shared memory: %s. For shared-memory collectives give "
                "/dev/shm more space (e.g. `docker run --shm-size=1g`); --comm gloo silences this",
                ", ".join(shortfalls), "; ".join(
                    f"a shared-memory group of {what} could not be made as the run started: /dev/shm had "
                    f"{s.free_bytes} bytes free of {s.size_bytes}, the group needed {s.needed_bytes}"
                    for what, s in shortfalls.items()))


def make_shm_groups(wanted: Iterable[str], candidates: Sequence[tuple[str, Any]], timeout_s: float | None,
                    known: Callable[[list[str]], str],
                    on_capacity: Callable[[str, Exception], None] | None = None) -> list[str]:
    """(Collective over each group made) create the shared-memory groups named in ``wanted`` that ``candidates``
    (``(name, gloo process group)``, in an order every rank follows) offers, in that order; returns their names.
    ``known(unknown names)`` says, in the error, which groups there are. ``on_capacity(name, error)``: called for a
    group /dev/shm has no room for (ShmCapacityError, the same on every rank of that group: its rank 0 tells them),
    which is then not made, in place of raising it.

    Raises:
        ShmUnavailableError, UsageError, ShmPeerError: as :func:`setup_shm_groups`.
        ProgramLoadError: a wanted name that no candidate has.
    """
    wanted = set(wanted)
    from ..kernels import require

    require("this program (lowered with shared-memory collectives: --comm auto|shm)")
    from ..kernels.shm import destroy_group, group_names as existing, init_group

    made: list[str] = []
    failed: list[str] = []
    have = set(existing())
    for name, pg in candidates:
        if name not in wanted or name in made:
            continue
        if name in have:
            destroy_group(name)
        try:
            init_group(pg, name=name, timeout_s=float(timeout_s or DEFAULT_TIMEOUT_S))
        except ShmCapacityError as e:
            if on_capacity is None or name in have:  # (a group an earlier graph's program uses is gone: stop)
                raise
            on_capacity(name, e)
            failed.append(name)
            continue
        made.append(name)
    unknown = sorted(wanted - set(made) - set(failed))
    if unknown:
        from ..errors import ProgramLoadError

        raise ProgramLoadError(f"the program's shared-memory ops name groups {unknown} that are not {known(unknown)}; "
                               "compile again")
    if made:
        log.info("adaptdist: shared-memory collectives on %s", ", ".join(made))
    return made
