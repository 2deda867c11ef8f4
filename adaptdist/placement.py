"""Placements: how one tensor is laid out along one mesh axis (DTensor's vocabulary).

* ``Shard(dim)``: the tensor is split along tensor dim ``dim`` across the ranks of
  the mesh axis, with ``torch.chunk`` semantics (uneven shards allowed, a rank may
  hold an empty shard).
* ``Replicate()``: every rank of the axis holds the whole tensor.
* ``Partial(op)``: every rank holds a partial value; the true value is the
  reduction (``"sum"`` or ``"avg"``) over the ranks of the axis.

A tensor's layout over an N-D mesh is a tuple of placements, one per mesh axis.
"""

from __future__ import annotations

from dataclasses import dataclass

_PARTIAL_OPS = ("sum", "avg")


@dataclass(frozen=True)
class Shard:
    """Split along tensor dim ``dim`` (non-negative) across a mesh axis."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"Shard(dim) needs a non-negative int dim, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every rank of the mesh axis holds the full tensor."""

    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a partial value; the true value is their ``op`` reduction."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in _PARTIAL_OPS:
            raise ValueError(f"Partial(op) takes one of {_PARTIAL_OPS}, got {self.op!r}")

    def __repr__(self) -> str:
        return f"P({self.op})"


Placement = Shard | Replicate | Partial


def parse_placement(text: str) -> Placement:
    """Parse ``"S(0)"``, ``"Shard(0)"``, ``"R"``, ``"Replicate()"``, ``"P(sum)"``, ``"Partial(avg)"``.

    Raises:
        ValueError: the text is none of these forms.
    """
    t = text.strip().replace(" ", "")
    if t in ("R", "Replicate()", "Replicate"):
        return Replicate()
    for head in ("Shard(", "S("):
        if t.startswith(head) and t.endswith(")"):
            dim = t[len(head):-1]
            if not dim.isdigit():
                raise ValueError(f"not a placement: {text!r}; use S(dim) with a dim >= 0, R or P(sum|avg)")
            return Shard(int(dim))
    for head in ("Partial(", "P("):
        if t.startswith(head) and t.endswith(")"):
            inner = t[len(head):-1].strip("'\"") or "sum"
            return Partial(inner)
    raise ValueError(f"not a placement: {text!r}; use S(dim), R or P(sum|avg)")


def chunk_interval(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """The ``[start, end)`` of chunk ``index`` when ``size`` is split like ``torch.chunk(num_chunks)``.

    ``torch.chunk`` takes chunks of ``ceil(size / num_chunks)``; trailing chunks may be
    shorter or empty (e.g. 4 over 3 -> [0,2), [2,4), [4,4)).
    """
    if size == 0:
        return (0, 0)
    step = -(-size // num_chunks)
    start = min(index * step, size)
    return (start, min(start + step, size))
