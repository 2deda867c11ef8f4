"""What passes need to know besides the graph."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..lowering_options import LoweringOptions
from ..placement import Placement


@dataclass(frozen=True)
class PassContext:
    """Settings shared by the lowering passes.

    Attributes:
        axis_size: number of ranks on the mesh axis this lowering takes (``mesh_axis``); the
            job's world size is the product of every axis's size.
        batch_size: global batch size (dim 0 of every batch input).
        mesh_axis: name of the mesh axis the batch is sharded over.
        bucket_bytes: target size of one gradient all_reduce bucket, bytes (default: LoweringOptions').
        shard_batch: whether batch inputs are split on dim 0 over the axis (data
            parallel); False keeps them replicated (e.g. a pure tensor-parallel axis).
        gather_bucket_bytes: target size of one bucket of parameter all_gathers, bytes.
        replicate_fallback: ops with no sharding rule gather their inputs and run whole on
            every rank (with one warning listing them) instead of raising UnsupportedOpError.
        param_placements: placement of each parameter/buffer (by fqn) on the axis;
            absent ones are replicated.
        batch_norm: training-mode BatchNorm over a split batch, ``"local"`` or ``"sync"``
            (:attr:`~adaptdist.lowering_options.LoweringOptions.batch_norm`).
        node_hints: node name -> the strategy the planner chose for it on this axis; propagation
            follows it where the op's rule agrees (see ``propagate_placements``).
        rng: ``"per-rank"`` or ``"global"`` (``LoweringOptions.rng``; the ``global_rng`` pass).
        batch_rows: rows of the batch each coordinate of this axis takes when it splits the batch (the plan's
            :attr:`~adaptdist.device_assignment.DeviceAssignment.batch_rows`: uneven, in proportion to each
            device's speed); None: torch.chunk's split.
    """

    axis_size: int
    batch_size: int
    mesh_axis: str = "dp"
    bucket_bytes: int = LoweringOptions.grad_bucket_bytes
    shard_batch: bool = True
    gather_bucket_bytes: int = LoweringOptions.gather_bucket_bytes
    replicate_fallback: bool = False
    param_placements: Mapping[str, Placement] = field(default_factory=dict)
    node_hints: Mapping[str, Any] = field(default_factory=dict)
    rng: str = "per-rank"
    batch_norm: str = LoweringOptions.batch_norm
    batch_rows: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.axis_size < 1:
            raise ValueError(f"axis_size must be >= 1, got {self.axis_size}")
        if self.batch_rows is not None and (len(self.batch_rows) != self.axis_size
                                            or sum(self.batch_rows) != self.batch_size
                                            or any(r < 0 for r in self.batch_rows)):
            raise ValueError(f"batch_rows {list(self.batch_rows)} must be {self.axis_size} row counts >= 0 summing "
                             f"to the batch size {self.batch_size}")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {self.bucket_bytes}")

    @property
    def shards_batch(self) -> bool:
        """False when splitting is pointless (one rank) or impossible (one sample): then every
        rank holds the whole batch and computes the whole step, with no collectives."""
        return self.shard_batch and self.axis_size > 1 and self.batch_size > 1

    @property
    def group_name(self) -> str:
        """The name functional collectives use for this mesh axis's process group."""
        return f"adaptdist:{self.mesh_axis}"

    def shard_sizes(self) -> list[int]:
        """Local batch size of each rank: :attr:`batch_rows` when given, else torch.chunk semantics (trailing ranks
        may get 0)."""
        b, w = self.batch_size, self.axis_size
        if not self.shards_batch:
            return [b] * w
        if self.batch_rows is not None:
            return list(self.batch_rows)
        chunk = -(-b // w) if b else 0
        return [max(0, min(chunk, b - r * chunk)) for r in range(w)]

    def shard_offsets(self) -> list[int]:
        if not self.shards_batch:
            return [0] * self.axis_size
        sizes = self.shard_sizes()
        return [sum(sizes[:r]) for r in range(self.axis_size)]
