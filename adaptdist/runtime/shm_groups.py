"""Setting up the shared-memory groups a rank program's ``torch.ops.adaptdist.shm_*`` ops name.

The lowering puts mesh axes whose ranks share a host on adaptdist's shared-memory collectives
(:mod:`adaptdist.comm_transport`); their ops name the axis's group (``"adaptdist:<axis>"``). Before such a
program runs, every rank creates the shared-memory group of each of those axes over the gloo group it shadows
(:func:`adaptdist.kernels.shm.init_group`, a collective over that group), in mesh-axis order on every rank.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

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

    A group of that name made before in this process (an earlier attempt's) is destroyed first.

    Raises:
        ShmUnavailableError: the program uses the kernels and they are unavailable here.
        UsageError: an axis's ranks are not on one host (the shm groups cannot join them).
        ShmPeerError: a peer did not attach within the timeout.
    """
    wanted = set(shm_groups_in_code(code))
    if not wanted:
        return []
    from ..kernels import require

    require("this program (lowered with shared-memory collectives: --comm auto|shm)")
    from ..kernels.shm import destroy_group, group_names as existing, init_group

    made = []
    have = set(existing())
    for axis, name in group_names.items():
        if name not in wanted:
            continue
        if name in have:
            destroy_group(name)
        init_group(process_group(axis), name=name, timeout_s=float(timeout_s or DEFAULT_TIMEOUT_S))
        made.append(name)
    unknown = wanted - set(made)
    if unknown:
        from ..errors import ProgramLoadError

        raise ProgramLoadError(f"the program's shared-memory ops name groups {sorted(unknown)} that are not groups of "
                               f"its mesh axes {dict(group_names)}; compile again")
    log.info("adaptdist: shared-memory collectives on %s", ", ".join(made))
    return made
