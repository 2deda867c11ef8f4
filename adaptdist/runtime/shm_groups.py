"""Setting up the shared-memory groups a rank program's ``torch.ops.adaptdist.shm_*`` ops name.

The lowering puts mesh axes whose ranks share a host on adaptdist's shared-memory collectives
(:mod:`adaptdist.comm_transport`); their ops name the shared-memory group by the axis and this rank's group's
ranks (``"adaptdist:dp[0,2]"``, :func:`adaptdist.mesh.shm_group_name`), so graphs over other ranks (the
torch.compile backend's graphs on different meshes, a pipeline's groups) never share a group. Before such a
program runs, every rank creates the shared-memory group of each of those axes over the gloo group it shadows
(:func:`adaptdist.kernels.shm.init_group`, a collective over that group), in one order on every rank.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..comm_transport import shm_groups_in_code
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
        UsageError: an axis's ranks are not on one host (the shm groups cannot join them).
        ShmPeerError: a peer did not attach within the timeout.
        ProgramLoadError: the code names a group that is none of its axes' groups.
    """
    wanted = shm_groups_in_code(code)
    if not wanted:
        return []
    import torch.distributed as dist

    from ..mesh import shm_group_name

    candidates = []
    for axis, name in group_names.items():
        pg = process_group(axis)
        shm = shm_group_name(name, dist.get_process_group_ranks(pg))
        candidates += [(shm, pg), (name, pg)]  # the second: the name of programs compiled before (see above)
    return make_shm_groups(wanted, candidates, timeout_s,
                           lambda unknown: f"its mesh axes' groups {dict(group_names)}")


def make_shm_groups(wanted: Iterable[str], candidates: Sequence[tuple[str, Any]], timeout_s: float | None,
                    known: Callable[[list[str]], str]) -> list[str]:
    """(Collective over each group made) create the shared-memory groups named in ``wanted`` that ``candidates``
    (``(name, gloo process group)``, in an order every rank follows) offers, in that order; returns their names.
    ``known(unknown names)`` says, in the error, which groups there are.

    Raises:
        ShmUnavailableError, UsageError, ShmPeerError: as :func:`setup_shm_groups`.
        ProgramLoadError: a wanted name that no candidate has.
    """
    wanted = set(wanted)
    from ..kernels import require

    require("this program (lowered with shared-memory collectives: --comm auto|shm)")
    from ..kernels.shm import destroy_group, group_names as existing, init_group

    made: list[str] = []
    have = set(existing())
    for name, pg in candidates:
        if name not in wanted or name in made:
            continue
        if name in have:
            destroy_group(name)
        init_group(pg, name=name, timeout_s=float(timeout_s or DEFAULT_TIMEOUT_S))
        made.append(name)
    unknown = sorted(wanted - set(made))
    if unknown:
        from ..errors import ProgramLoadError

        raise ProgramLoadError(f"the program's shared-memory ops name groups {unknown} that are not {known(unknown)}; "
                               "compile again")
    log.info("adaptdist: shared-memory collectives on %s", ", ".join(made))
    return made
