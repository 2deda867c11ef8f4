"""The execution mode of a recommender (issue 17): synchronous data parallelism or the asynchronous heterogeneous
pipeline (:mod:`adaptdist.hetero_layout`), chosen on the cost model (:mod:`adaptdist.cost_models.recsys`) and
the cluster description.

``--mode auto`` weighs ``sync`` on every rank against ``async-hetero`` with each candidate set of dense ranks:
on a cluster with accelerators and CPU ranks, the accelerators dense and the CPUs sparse (the paper's split);
on one kind of device, the ``D`` fastest ranks dense for ``D = 1 .. N-1`` (CPU ranks standing in for
accelerators), each with the tables sharded by rows and, where there are at least as many tables as sparse
ranks, placed whole (:func:`~adaptdist.hetero_layout.shard_tables`). The cheapest predicted step wins; a tie goes
to ``sync`` (no staleness), then to rows. A model without the two
parts (:func:`adaptdist.runtime.async_hetero.check_model`), or a single rank, is always ``sync``.

Beside them the prediction for *one rank* (the fastest device alone, no collective): where it beats the chosen mode,
:func:`mode_lines` says so (a model this small gains nothing from more ranks), but the choice never changes the
job's world size, which is the user's (``--nproc`` / the cluster file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn as nn

from ... import _torch_compat as compat
from ...cost_models.recsys import ModeCost, RecsysShape, async_cost, sync_cost
from ...errors import UsageError
from ...hetero_layout import HeteroLayout, make_layout


@dataclass(frozen=True)
class ModeChoice:
    """The chosen mode, its layout (None for sync), the prediction of every candidate (``candidates``: text ->
    cost) and why."""

    mode: str
    layout: HeteroLayout | None
    cost: ModeCost
    candidates: dict = field(default_factory=dict)
    reason: str = ""
    one_rank: ModeCost | None = None
    sync_plan: str = ""
    """What the ``sync`` candidate priced: the plan ``--mode sync`` runs (``"plan 'auto': mesh tp=2, batch
    replicated"``), or ``"priced as data parallel"`` where it was not planned first."""

    @property
    def one_rank_faster(self) -> bool:
        """Whether one rank alone is predicted faster than the chosen mode on every rank."""
        return self.one_rank is not None and self.one_rank.step_s < self.cost.step_s

    def describe(self) -> dict:
        """JSON fields for ``summary.json`` / ``adaptdist plan --out``."""
        return {"mode": self.mode, "reason": self.reason, "sync_plan": self.sync_plan,
                "predicted_step_s": self.cost.step_s,
                "predicted_samples_per_s": self.cost.items_per_s,
                "candidates": {k: {"step_s": c.step_s, "samples_per_s": c.items_per_s}
                               for k, c in self.candidates.items()},
                **({"one_rank": {"step_s": self.one_rank.step_s, "samples_per_s": self.one_rank.items_per_s,
                                 "faster_than_chosen": self.one_rank_faster}} if self.one_rank is not None else {}),
                **(self.layout.describe() if self.layout is not None else {})}


def has_sparse_and_dense_parts(model: nn.Module) -> bool:
    """Whether ``model`` has the two parts ``--mode async-hetero`` places apart (``.sparse_arch.tables`` and
    ``.dense_arch``, as :func:`adaptdist.runtime.async_hetero.check_model` requires); never raises."""
    from ...runtime.async_hetero import check_model

    try:
        check_model(model)
    except UsageError:
        return False
    return True


def recsys_shape(model: nn.Module, example: Sequence[torch.Tensor], optimizer: str) -> RecsysShape:
    """The :class:`RecsysShape` of a DLRM-style ``model`` on its ``example`` batch ``(*inputs, target)``:
    FLOPs from ``torch.utils.flop_counter.FlopCounterMode`` and the dispatched ops of one forward + backward of
    the dense part on the example's lookups (measured on a copy; the model is not changed)."""
    import copy

    from torch.utils.flop_counter import FlopCounterMode

    from ...runtime.async_hetero import split_batch

    dense_in, ids, target = split_batch(model, example)
    B = target.shape[0]
    tables = model.sparse_arch.tables
    dim = tables[0].embedding_dim
    with torch.no_grad():
        emb = model.sparse_arch(*ids)
    arch = copy.deepcopy(model.dense_arch)
    counter = _OpCounter()
    with FlopCounterMode(display=False) as flops:
        with counter:
            out = arch(emb.detach().requires_grad_(True), dense_in)
    forward_flops, forward_bytes = flops.get_total_flops(), counter.bytes
    with counter:
        out.float().sum().backward()
    return RecsysShape(
        table_rows=tuple(t.weight.shape[0] for t in tables), dim=dim,
        ids_per_row=tuple(1 if i.dim() == 1 else i.shape[1] for i in ids),
        dense_flops_per_row=forward_flops / B, dense_bytes_per_row=forward_bytes / B,
        dense_params=sum(p.numel() for p in arch.parameters()), dense_ops=counter.ops, batch_size=B,
        optimizer=optimizer, dense_tensors=sum(1 for _ in arch.parameters()))


class _OpCounter(compat.torch_dispatch_mode_base()):
    """Counts the ATen ops a region dispatches and the bytes of their outputs (cumulative over uses)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.bytes += t.numel() * t.element_size()
        return out


def _dense_candidates(cluster, world: int) -> list[tuple[int, ...]]:
    kinds = [cluster.device(r).kind for r in range(world)]
    accel = tuple(r for r in range(world) if kinds[r] != "cpu")
    if accel and len(accel) < world:
        return [accel]
    fastest = sorted(range(world), key=lambda r: (-cluster.device(r).peak_flops["float32"], -r))
    return [tuple(sorted(fastest[:d])) for d in range(1, world)]


def choose_mode(shape: RecsysShape, cluster, mode: str = "auto", max_staleness: int = 1,
                dense_ranks: Sequence[int] | None = None, splittable: bool = True, sharding: str | None = None,
                sync: ModeCost | None = None, sync_plan: str | None = None) -> ModeChoice:
    """The mode and layout to run (see the module docstring).

    Args:
        shape: the recommender (:func:`recsys_shape`).
        cluster: the cluster description (:class:`~adaptdist.cluster.Cluster` or a cost-model cluster).
        mode: ``"sync"``, ``"async-hetero"`` or ``"auto"``.
        max_staleness: K of the asynchronous mode.
        dense_ranks: ``--dense-ranks`` (fixes the async layout's dense ranks), or None for the planner's choice.
        splittable: the model has the two parts; False: only ``sync`` is possible.
        sync: the synchronous candidate's prediction: the programs ``--mode sync`` will run, priced by
            :func:`~adaptdist.cost_models.recsys.program_sync_cost` (``sync_plan`` names their plan, e.g. ``"plan
            'auto': mesh tp=2, batch replicated"``); None: :func:`~adaptdist.cost_models.recsys.sync_cost`, data
            parallel over every rank (the synchronous programs could not be planned first: see
            :func:`adaptdist.cli.modes.resolve_mode`).

    Raises:
        UsageError: ``async-hetero`` asked for a model without the parts or on one rank; bad ``dense_ranks``.
    """
    world = cluster.world_size
    if sync is None:
        sync, sync_plan = sync_cost(shape, cluster), "priced as data parallel"
    one = one_rank_cost(shape, cluster) if world > 1 else None
    candidates = {f"sync on {world} rank{'s' if world > 1 else ''}": sync}
    if mode == "sync":
        return ModeChoice("sync", None, sync, candidates, "--mode sync", one, sync_plan)
    if not splittable or world < 2:
        if mode == "async-hetero":
            raise UsageError("--mode async-hetero needs a model with .sparse_arch and .dense_arch (as builtin:dlrm) and "
                             f"2 or more ranks; this job has {world}" if splittable else
                             "--mode async-hetero needs a model with .sparse_arch.tables and .dense_arch (as "
                             "builtin:dlrm's DLRM); use --mode sync")
        why = "one rank" if world < 2 else "the model has no separate embedding and dense parts"
        return ModeChoice("sync", None, sync, candidates, f"auto: {why}", one, sync_plan)
    best: tuple[ModeCost, HeteroLayout] | None = None
    for dense in ([tuple(dense_ranks)] if dense_ranks else _dense_candidates(cluster, world)):
        # the tables by rows and, where there are enough tables, whole: the cheaper layout by the cost model
        n_sparse = world - len(set(dense))
        for how in ([sharding] if sharding else ["row"] + (["table"] if len(shape.table_rows) >= n_sparse else [])):
            layout = make_layout(world, dense, shape.table_rows, max_staleness, how)
            shard_rows = [[(s.table, s.rows) for s in layout.shards_of(r)] for r in range(world)]
            cost = async_cost(shape, cluster, layout.roles, shard_rows, max_staleness)
            tables = "tables by rows" if layout.sharding == "row" else "whole tables"
            candidates[f"async-hetero, dense ranks {','.join(map(str, dense))}, {tables}"] = cost
            if best is None or cost.step_s < best[0].step_s:
                best = (cost, layout)
    assert best is not None
    if mode == "async-hetero":
        return ModeChoice("async-hetero", best[1], best[0], candidates,
                          "--mode async-hetero" + (" --dense-ranks" if dense_ranks else ", the planner's dense ranks"),
                          one, sync_plan)
    if best[0].step_s < sync.step_s:
        return ModeChoice("async-hetero", best[1], best[0], candidates,
                          f"auto: predicted {sync.step_s / best[0].step_s:.2f}x the samples/s of sync", one,
                          sync_plan)
    return ModeChoice("sync", None, sync, candidates,
                      f"auto: sync predicted {best[0].step_s / sync.step_s:.2f}x faster than the best async layout", one,
                      sync_plan)


def one_rank_cost(shape: RecsysShape, cluster) -> ModeCost:
    """The predicted step of the whole job on the cluster's fastest rank alone (the highest float32 peak, then the
    widest memory bandwidth): :func:`~adaptdist.cost_models.recsys.sync_cost` on that rank, no collective."""
    best = max(range(cluster.world_size), key=lambda r: (cluster.device(r).peak_flops["float32"],
                                                         float(cluster.device(r).memory_bandwidth_bytes_per_s), -r))
    return sync_cost(shape, cluster, [best])


def mode_lines(choice: ModeChoice) -> list[str]:
    """Lines for ``adaptdist plan``/``train``: the mode and why, each candidate's prediction, each rank's role."""
    lines = [f"execution mode: {choice.mode} ({choice.reason})"]
    for name, c in sorted(choice.candidates.items(), key=lambda kv: kv[1].step_s):
        what = f" ({choice.sync_plan})" if name.startswith("sync") and choice.sync_plan else ""
        lines.append(f"  predicted {name}{what}: {1e3 * c.step_s:.3f} ms per step, {c.items_per_s:,.0f} samples/s")
    if choice.one_rank is not None:
        o = choice.one_rank
        lines.append(f"  predicted one rank alone: {1e3 * o.step_s:.3f} ms per step, {o.items_per_s:,.0f} samples/s"
                     + (f" -- {o.items_per_s / choice.cost.items_per_s:.2f}x the chosen mode: this model gains nothing "
                        f"from {len(choice.cost.rank_s)} ranks; run it on one (--nproc 1 or a 1-rank cluster) unless "
                        "you need the ranks' memory" if choice.one_rank_faster else " (slower than the chosen mode)"))
    if choice.layout is not None:
        lay = choice.layout
        lines.append(f"  max staleness {lay.max_staleness} (lookups of step t see the table updates of steps up to "
                     f"t-{lay.max_staleness + 1}); tables sharded by {lay.sharding}s")
        for r, role in enumerate(lay.roles):
            what = (", ".join(map(repr, lay.shards_of(r))) if role == "sparse"
                    else "the dense part (data parallel over the dense ranks)")
            lines.append(f"  rank {r}: {role}: {what}")
    return lines
