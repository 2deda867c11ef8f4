"""The asynchronous heterogeneous mode's layout: which rank does what (issue 17, point 2).

A recommender's step splits in two: the embedding lookups and their sparse updates (the *sparse* side, memory
bound, suited to CPU hosts with much memory) and the dense MLP (the *dense* side, compute bound, suited to
accelerators). In ``--mode async-hetero`` the sparse ranks hold the embedding tables, sharded by rows or by
tables (:class:`TableShard`), and the dense ranks hold the dense part, replicated (data parallel among
themselves, the batch split :func:`torch.chunk`-wise). Bounded queues join them: a sparse rank may run at most
``max_staleness`` batches ahead of the gradients it has applied (:mod:`adaptdist.runtime.async_hetero`).

A :class:`HeteroLayout` is a frozen value that checks itself; :func:`shard_tables` makes the shards for a number
of sparse ranks; :func:`parse_dense_ranks` reads ``--dense-ranks 2,3``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .errors import UsageError

MODES = ("sync", "async-hetero", "auto")
"""``--mode``: synchronous data parallelism (the compiled programs), the asynchronous heterogeneous pipeline, or
the planner's choice between the two."""
SPARSE, DENSE = "sparse", "dense"
SHARDINGS = ("row", "table")


@dataclass(frozen=True)
class TableShard:
    """Rows ``[row_start, row_end)`` of embedding table ``table``, held by sparse rank ``rank``."""

    table: int
    row_start: int
    row_end: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.row_start < self.row_end:
            raise UsageError(f"table {self.table}: a shard must hold rows [start, end) with 0 <= start < end, got "
                             f"[{self.row_start}, {self.row_end})")

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    def __repr__(self) -> str:
        return f"table{self.table}[{self.row_start}:{self.row_end}]@rank{self.rank}"


@dataclass(frozen=True)
class HeteroLayout:
    """Each rank's role and the sparse ranks' table shards.

    Attributes:
        roles: ``roles[r]`` is ``"sparse"`` or ``"dense"`` for rank ``r``; at least one of each.
        shards: every table's rows, each row in exactly one shard, each shard on a sparse rank.
        sharding: ``"row"`` (every table split into contiguous row ranges, one per sparse rank) or ``"table"``
            (whole tables, balanced over the sparse ranks).
        max_staleness: K >= 0; the lookups of step ``t`` see the updates of steps ``0 .. t-K-1`` exactly (K = 0:
            the synchronous step).

    Raises:
        UsageError: no sparse or no dense rank, an unknown role, a negative K, or shards that do not cover each
            table once (names the table and rows).
    """

    roles: tuple[str, ...]
    shards: tuple[TableShard, ...]
    sharding: str
    max_staleness: int

    def __post_init__(self) -> None:
        bad = [r for r, role in enumerate(self.roles) if role not in (SPARSE, DENSE)]
        if bad:
            raise UsageError(f"rank {bad[0]}: role {self.roles[bad[0]]!r} is neither 'sparse' nor 'dense'")
        if not self.sparse_ranks or not self.dense_ranks:
            raise UsageError(f"--mode async-hetero needs at least one sparse and one dense rank, got roles "
                             f"{list(self.roles)}; use 2 or more ranks (or --mode sync)")
        if self.sharding not in SHARDINGS:
            raise UsageError(f"sharding {self.sharding!r} is not one of {SHARDINGS}")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise UsageError(f"--max-staleness must be a whole number >= 0, got {self.max_staleness!r}")
        for s in self.shards:
            if s.rank not in self.sparse_ranks:
                raise UsageError(f"shard {s!r} is on rank {s.rank}, which is not a sparse rank "
                                 f"({list(self.sparse_ranks)})")
        for t in sorted({s.table for s in self.shards}):
            spans = sorted((s.row_start, s.row_end) for s in self.shards if s.table == t)
            if spans[0][0] != 0 or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
                raise UsageError(f"table {t}: its shards {spans} do not cover its rows once from row 0")

    @property
    def world_size(self) -> int:
        return len(self.roles)

    @property
    def sparse_ranks(self) -> tuple[int, ...]:
        return tuple(r for r, role in enumerate(self.roles) if role == SPARSE)

    @property
    def dense_ranks(self) -> tuple[int, ...]:
        return tuple(r for r, role in enumerate(self.roles) if role == DENSE)

    def shards_of(self, rank: int) -> tuple[TableShard, ...]:
        return tuple(s for s in self.shards if s.rank == rank)

    def table_rows(self) -> tuple[int, ...]:
        """Each table's row count, from its shards."""
        n = 1 + max(s.table for s in self.shards)
        return tuple(max(s.row_end for s in self.shards if s.table == t) for t in range(n))

    def describe(self) -> dict:
        """JSON fields for ``summary.json`` and ``adaptdist plan``: roles by rank, shards by sparse rank, K."""
        return {"roles": {str(r): role for r, role in enumerate(self.roles)},
                "dense_ranks": list(self.dense_ranks), "sparse_ranks": list(self.sparse_ranks),
                "sharding": self.sharding, "max_staleness": self.max_staleness,
                "shards": {str(r): [repr(s) for s in self.shards_of(r)] for r in self.sparse_ranks}}


def shard_tables(table_rows: Sequence[int], sparse_ranks: Sequence[int], sharding: str | None = None,
                 imbalance: float = 1.25) -> tuple[tuple[TableShard, ...], str]:
    """The tables' shards over ``sparse_ranks`` and the sharding used.

    ``"table"``: whole tables, largest first onto the sparse rank holding the fewest rows (greedy LPT); chosen
    (``sharding=None``) when there are at least as many tables as sparse ranks and that leaves the fullest rank
    within ``imbalance`` x the mean. ``"row"``: every table cut into ``len(sparse_ranks)`` contiguous row ranges
    (:func:`torch.chunk`'s sizes; a table with fewer rows than ranks goes to fewer ranks).

    Raises:
        UsageError: an unknown sharding, no sparse rank, or a table with no rows.
    """
    ranks = list(sparse_ranks)
    if not ranks:
        raise UsageError("no sparse rank to hold the embedding tables")
    if any(n < 1 for n in table_rows):
        raise UsageError(f"every embedding table needs at least one row, got rows {list(table_rows)}")
    if sharding is not None and sharding not in SHARDINGS:
        raise UsageError(f"sharding {sharding!r} is not one of {SHARDINGS}")
    if sharding in (None, "table") and len(table_rows) >= len(ranks):
        load = {r: 0 for r in ranks}
        placed = []
        for t in sorted(range(len(table_rows)), key=lambda t: -table_rows[t]):
            r = min(ranks, key=lambda r: (load[r], r))
            load[r] += table_rows[t]
            placed.append(TableShard(t, 0, table_rows[t], r))
        mean = sum(table_rows) / len(ranks)
        if sharding == "table" or max(load.values()) <= imbalance * mean:
            return tuple(sorted(placed, key=lambda s: s.table)), "table"
    elif sharding == "table":
        raise UsageError(f"table-wise sharding needs at least as many tables ({len(table_rows)}) as sparse ranks "
                         f"({len(ranks)}); use row-wise sharding or fewer sparse ranks")
    shards = []
    for t, n in enumerate(table_rows):
        size = -(-n // len(ranks))  # torch.chunk's chunk size
        for i, start in enumerate(range(0, n, size)):
            shards.append(TableShard(t, start, min(n, start + size), ranks[i]))
    return tuple(shards), "row"


def make_layout(world_size: int, dense_ranks: Sequence[int], table_rows: Sequence[int], max_staleness: int,
                sharding: str | None = None) -> HeteroLayout:
    """The layout with ``dense_ranks`` dense and every other rank sparse, tables sharded by :func:`shard_tables`.

    Raises:
        UsageError: a dense rank outside ``[0, world_size)``, or a layout :class:`HeteroLayout` refuses.
    """
    bad = [r for r in dense_ranks if not 0 <= r < world_size]
    if bad:
        raise UsageError(f"--dense-ranks {','.join(map(str, dense_ranks))}: rank {bad[0]} is not in 0..{world_size - 1}"
                         f" ({world_size} ranks)")
    roles = tuple(DENSE if r in set(dense_ranks) else SPARSE for r in range(world_size))
    if SPARSE not in roles:
        raise UsageError(f"--dense-ranks {','.join(map(str, dense_ranks))} leaves no sparse rank of {world_size}; "
                         "name fewer dense ranks")
    shards, used = shard_tables(table_rows, [r for r in range(world_size) if roles[r] == SPARSE], sharding)
    return HeteroLayout(roles, shards, used, max_staleness)


def parse_dense_ranks(text: str) -> tuple[int, ...]:
    """``--dense-ranks 2,3`` -> ``(2, 3)``.

    Raises:
        UsageError: not a comma list of distinct whole numbers >= 0.
    """
    try:
        ranks = tuple(int(p) for p in text.split(",") if p.strip() != "")
    except ValueError:
        raise UsageError(f"--dense-ranks {text!r}: expected a comma list of ranks, e.g. 1 or 2,3") from None
    if not ranks or any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
        raise UsageError(f"--dense-ranks {text!r}: expected distinct ranks >= 0, e.g. 1 or 2,3")
    return ranks
