"""The device mesh: the job's ranks arranged as an N-D grid with named axes.

Ranks are laid out row-major over the axes, as ``torch.distributed.device_mesh``
does: on ``Mesh.parse("dp=2,tp=2")`` rank 3 sits at coordinates ``(dp=1, tp=1)``,
and the ``tp`` group of rank 2 is ranks ``(2, 3)``. Each axis has one process
group per setting of the other axes; collectives name it ``"adaptdist:<axis>"``
(the runtime registers this rank's group under that name). The shared-memory collectives name the group
by its ranks too (:func:`shm_group_name`: ``"adaptdist:dp[0,2]"``): their groups cannot be re-pointed
between runs as gloo's are, so two rank sets never share a name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

from .errors import UsageError

_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Mesh:
    """Named mesh axes with their sizes, outermost first, e.g. ``(("dp", 2), ("tp", 2))``."""

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        if not self.axes:
            raise UsageError("a mesh needs at least one axis, e.g. dp=2")
        names = [a for a, _ in self.axes]
        if len(set(names)) != len(names):
            raise UsageError(f"mesh axes {names} repeat a name; each axis needs its own name")
        for name, size in self.axes:
            if not isinstance(name, str) or not _AXIS_NAME.match(name):
                raise UsageError(f"mesh axis name {name!r} must be an identifier such as dp or tp")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise UsageError(f"mesh axis {name!r} has size {size!r}; sizes are positive integers")

    @staticmethod
    def parse(text: str) -> "Mesh":
        """``"dp=2,tp=2"`` -> Mesh; raises UsageError naming the bad part."""
        axes = []
        for part in text.split(","):
            name, eq, size = part.strip().partition("=")
            if not eq or not size.strip().isascii() or not size.strip().isdigit() or len(size.strip()) > 18:
                raise UsageError(f"--mesh {text!r}: {part.strip()!r} is not AXIS=SIZE; write e.g. --mesh dp=2,tp=2")
            axes.append((name.strip(), int(size)))
        try:
            return Mesh(tuple(axes))
        except UsageError as e:
            raise UsageError(f"--mesh {text!r}: {e}") from None

    @staticmethod
    def one_axis(name: str, size: int) -> "Mesh":
        return Mesh(((name, size),))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def as_dict(self) -> dict[str, int]:
        return dict(self.axes)

    def index(self, axis: str) -> int:
        """Position of ``axis``; raises UsageError naming the mesh's axes."""
        if axis not in self.names:
            raise UsageError(f"mesh {self} has no axis {axis!r}; its axes are {list(self.names)}")
        return self.names.index(axis)

    def size(self, axis: str) -> int:
        return self.sizes[self.index(axis)]

    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of ``rank`` along each axis (row-major)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside mesh {self} of {self.world_size} ranks")
        out = []
        for s in reversed(self.sizes):
            out.append(rank % s)
            rank //= s
        return tuple(reversed(out))

    def rank(self, coords: tuple[int, ...]) -> int:
        r = 0
        for c, s in zip(coords, self.sizes):
            r = r * s + c
        return r

    def group(self, axis: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``axis``, in axis order."""
        k = self.index(axis)
        c = list(self.coords(rank))
        out = []
        for i in range(self.sizes[k]):
            c[k] = i
            out.append(self.rank(tuple(c)))
        return tuple(out)

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along ``axis`` (each rank in exactly one)."""
        seen, out = set(), []
        for r in range(self.world_size):
            g = self.group(axis, r)
            if g not in seen:
                seen.add(g)
                out.append(g)
        return out

    @staticmethod
    def group_name(axis: str) -> str:
        """The name functional collectives use for ``axis``'s process group."""
        return f"adaptdist:{axis}"

    def __str__(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.axes)

    def __repr__(self) -> str:
        return f"Mesh({self})"


def lowering_order(mesh: Mesh, batch_axis: str | None) -> list[str]:
    """Axes of ``mesh`` in the order the lowering takes them: model-parallel axes first (mesh order), the
    batch axis last, so data-parallel gradient buckets are built from already-local (model-parallel)
    shards. A tensor dim sharded on several axes is chunked in this order (outer first); the runtime's
    checkpoints describe shards in it."""
    return [a for a in mesh.names if a != batch_axis] + ([batch_axis] if batch_axis in mesh.names else [])


def shm_group_name(group_name: str, ranks: Sequence[int]) -> str:
    """The name of the shared-memory group over global ``ranks`` (in group-rank order) that carries the collectives
    of ``group_name`` (``"adaptdist:<axis>"``): ``"adaptdist:dp[0,2]"``; an arithmetic run of more than 8 ranks is
    written as a slice, ``"adaptdist:dp[0:64]"``, ``"adaptdist:dp[1:64:2]"`` (stop exclusive). Two different rank
    sets (or orders) never get the same name, so groups of one name are one group in every graph of a process
    (the torch.compile backend's graphs on different meshes; a pipeline rank's stages)."""
    rs = [int(r) for r in ranks]
    step = rs[1] - rs[0] if len(rs) > 1 else 0
    if len(rs) > 8 and step > 0 and all(b - a == step for a, b in zip(rs, rs[1:])):
        text = f"{rs[0]}:{rs[-1] + 1}" + (f":{step}" if step != 1 else "")
    else:
        text = ",".join(map(str, rs))
    return f"{group_name}[{text}]"


def base_group_name(name: str) -> str:
    """The mesh axis's group name (``"adaptdist:<axis>"``) of a collective's group name, whether the axis's
    (gloo: ``"adaptdist:dp"``) or a shared-memory group's over some of its ranks (``"adaptdist:dp[0,2]"``)."""
    text = str(name)
    return text[:text.index("[")] if text.endswith("]") and "[" in text else text
