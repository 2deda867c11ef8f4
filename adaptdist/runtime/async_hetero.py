"""``--mode async-hetero``: an asynchronous heterogeneous pipeline for DLRM-style recommenders (issue 17, point 2).

The sparse ranks hold the embedding tables, sharded (:class:`~adaptdist.hetero_layout.TableShard`); the dense
ranks hold the dense part (``model.dense_arch``), replicated, the global batch split over them
(:func:`torch.chunk`). One step ``t``, on gloo point-to-point messages (tag ``t``)::

    sparse rank s                                   dense rank d
    apply the table gradients of steps < t - K      (waits for every sparse rank's partial of step t)
    partial[d] = lookups of its rows, float32[B_d, T, dim]  --isend-->  emb = sum over s of partial[d]
                                                     loss_d = loss(dense_arch(emb), y_d) * B_d / B, backward
                      <--isend--  d emb, float32[B_d, T, dim]
                                                     all_reduce(dense grads, loss) over the dense ranks; step
    (the gradient of step t is applied before the lookups of step t + K + 1)

so the lookups of step ``t`` see the table updates of steps ``0 .. t-K-1`` exactly, never more nor fewer (a
deterministic schedule: :func:`simulate` runs the same one in one process). K = 0 is the synchronous step,
equal to single-process eager training; K > 0 lets the sparse side run up to K batches ahead, so that lookups
overlap the dense work. The queues are bounded: a sparse rank has at most K + 1 steps in flight, a dense rank
posts its receives at most K + 1 steps ahead.

Table rows are updated sparsely with SGD (only the rows a batch touched, ``index_add_``); with AdamW, whose
state is dense, each shard's gradient is materialized and stepped by ``torch.optim.AdamW`` as eager's would be
(AdamW is elementwise, so a shard's update equals the whole table's restricted to the shard).

The loss must be a mean over the batch rows (``rating_loss`` is): each dense rank weights its slice's loss by
``B_d / B``, and the sum over dense ranks is the global batch's loss.

A peer that dies or stalls surfaces as :class:`~adaptdist.errors.CollectiveTimeoutError` naming it
(:func:`~adaptdist.runtime.heartbeat.named_timeout`), within the collective timeout, never a hang.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import CheckpointError, UsageError
from ..hetero_layout import DENSE, HeteroLayout, TableShard
from .faults import Fault


def check_model(model: nn.Module) -> None:
    """The model has the two parts this mode places apart: ``sparse_arch`` (``tables``: ``nn.EmbeddingBag``s,
    ``padding_idx``: one per table) and ``dense_arch`` (``forward(sparse [B, T, dim], dense | None)``), as
    :class:`adaptdist.models.dlrm.DLRM`.

    Raises:
        UsageError: names what is missing.
    """
    sparse, dense = getattr(model, "sparse_arch", None), getattr(model, "dense_arch", None)
    tables = getattr(sparse, "tables", None)
    if sparse is None or dense is None or tables is None or not all(isinstance(t, nn.EmbeddingBag) for t in tables):
        raise UsageError(f"--mode async-hetero places a recommender's embedding tables and dense part apart: the model "
                         f"({type(model).__name__}) needs .sparse_arch.tables (nn.EmbeddingBag) and .dense_arch, as "
                         "adaptdist/models/dlrm.py's DLRM has; use --mode sync")
    if any(t.mode not in ("mean", "sum") for t in tables):
        raise UsageError("--mode async-hetero supports EmbeddingBag mode 'mean' and 'sum' tables only")


def split_batch(model: nn.Module, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, list, torch.Tensor]:
    """A DLRM batch ``(*inputs, target)`` -> ``(dense features or None, one id tensor per table, target)``."""
    inputs, target = list(batch[:-1]), batch[-1]
    dense = inputs.pop(0) if getattr(model, "dense_in", 0) else None
    return dense, inputs, target


def bag_weights(sparse_arch: nn.Module, ids: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each table, ``(ids int64[B, L], weights float32[B, L])``: the bag's lookup is ``sum_l w[b, l] *
    W[ids[b, l]]``, as :class:`~adaptdist.models.dlrm.SparseArch` computes it (mean: ``1/L``; a table with a
    padding id: ``1 / (ids that are not padding)``, 0 for padding; sum: 1)."""
    out = []
    for t, p, i in zip(sparse_arch.tables, sparse_arch.padding_idx, ids):
        i = i.unsqueeze(1) if i.dim() == 1 else i
        if p is not None:
            keep = (i != p).float()
            w = keep / keep.sum(1, keepdim=True).clamp(min=1.0)
        elif t.mode == "mean":
            w = torch.full(i.shape, 1.0 / i.shape[1])
        else:
            w = torch.ones(i.shape)
        out.append((i, w))
    return out


def _local(shard: TableShard, ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` as rows of ``shard`` (others clamped into it) and ``w`` zero where the id is not the shard's."""
    mine = (ids >= shard.row_start) & (ids < shard.row_end)
    return (ids - shard.row_start).clamp(0, shard.rows - 1), w * mine


class SparseWorker:
    """One sparse rank's table shards, their lookups and their updates.

    Args:
        model: the whole model (its tables' initial values are copied; the model is not kept).
        shards: this rank's shards.
        optimizer: ``"sgd"`` (sparse row updates) or ``"adamw"`` (dense shard state).
        lr: learning rate.
    """

    def __init__(self, model: nn.Module, shards: Sequence[TableShard], optimizer: str, lr: float):
        self.shards = tuple(shards)
        self.sparse_arch = model.sparse_arch
        self.dim = model.sparse_arch.tables[0].embedding_dim
        self.num_tables = len(model.sparse_arch.tables)
        self.weights = [model.sparse_arch.tables[s.table].weight.detach()[s.row_start:s.row_end].clone()
                        for s in self.shards]
        self.optimizer_name = optimizer
        self.lr = lr
        self.opt = None
        if optimizer != "sgd":
            from .worker import make_optimizer

            self.weights = [nn.Parameter(w) for w in self.weights]
            self.opt = make_optimizer(optimizer, list(self.weights), lr)

    def lookup(self, ids: Sequence[torch.Tensor], slices: Sequence[slice]) -> tuple[list[torch.Tensor], Any]:
        """Each slice's partial lookups, ``float32[B_d, T, dim]`` (zeros for the tables and rows held elsewhere),
        and the context :meth:`apply` needs."""
        bags = bag_weights(self.sparse_arch, ids)
        B = bags[0][0].shape[0]
        full = torch.zeros(B, self.num_tables, self.dim)
        ctx = []
        with torch.no_grad():
            for shard, weight in zip(self.shards, self.weights):
                i, w = bags[shard.table]
                local, wm = _local(shard, i, w)
                full[:, shard.table] += F.embedding_bag(local, weight, per_sample_weights=wm, mode="sum")
                ctx.append((local, wm))
        return [full[s] for s in slices], ctx

    def apply(self, ctx: Any, grads: Sequence[torch.Tensor]) -> None:
        """Apply the gradient of one step's lookups: ``grads``, ``d loss / d lookups`` of each slice in order
        (``float32[B_d, T, dim]``), concatenated over the batch."""
        g = torch.cat(list(grads))  # [B, T, dim]
        with torch.no_grad():
            for k, (shard, (local, wm)) in enumerate(zip(self.shards, ctx)):
                contrib = (wm.unsqueeze(-1) * g[:, shard.table].unsqueeze(1)).reshape(-1, self.dim)
                flat = local.reshape(-1)
                weight = self.weights[k]
                if self.opt is None:  # SGD: only the rows the batch touched
                    rows, inverse = torch.unique(flat, return_inverse=True)
                    grad_rows = torch.zeros(rows.numel(), self.dim).index_add_(0, inverse, contrib)
                    weight.index_add_(0, rows, grad_rows, alpha=-self.lr)
                elif weight.grad is None:
                    weight.grad = torch.zeros_like(weight).index_add_(0, flat, contrib)
                else:  # the same buffer every step: no fresh allocation of a whole shard's gradient
                    weight.grad.zero_().index_add_(0, flat, contrib)
        if self.opt is not None:
            self.opt.step()

    def dense_grad(self, ctx: Any, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each shard's gradient as a dense ``[rows, dim]`` tensor (for tests: eager's ``weight.grad`` rows)."""
        g = torch.cat(list(grads))
        out = []
        for shard, (local, wm) in zip(self.shards, ctx):
            contrib = (wm.unsqueeze(-1) * g[:, shard.table].unsqueeze(1)).reshape(-1, self.dim)
            out.append(torch.zeros(shard.rows, self.dim).index_add_(0, local.reshape(-1), contrib))
        return out

    def state(self) -> dict[str, torch.Tensor]:
        """``{"table{t}.{start}": rows}`` of this rank's shards."""
        return {f"table{s.table}.{s.row_start}": w.detach().clone() for s, w in zip(self.shards, self.weights)}


class DenseWorker:
    """A dense rank's replica of ``model.dense_arch`` (a deep copy), its loss and its optimizer."""

    def __init__(self, model: nn.Module, loss_fn: Callable, optimizer: str, lr: float,
                 device: torch.device | None = None):
        import copy

        from .worker import make_optimizer

        self.dense_arch = copy.deepcopy(model.dense_arch).to(device or torch.device("cpu"))
        self.loss_fn = loss_fn
        self.params = [p for p in self.dense_arch.parameters() if p.requires_grad]
        self.opt = make_optimizer(optimizer, self.params, lr)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def forward_backward(self, emb: torch.Tensor, dense: torch.Tensor | None, target: torch.Tensor,
                         share: float) -> tuple[float, torch.Tensor]:
        """``loss(dense_arch(emb, dense), target) * share`` backward (gradients accumulate into the replica);
        returns the weighted loss and ``d loss / d emb`` (``float32[B_d, T, dim]``)."""
        emb = emb.detach().requires_grad_(True)
        loss = self.loss_fn(self.dense_arch(emb, dense), target) * share
        loss.backward()
        return float(loss.detach()), emb.grad

    def flat_grads(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])

    def set_flat_grads(self, flat: torch.Tensor) -> None:
        i = 0
        for p in self.params:
            p.grad = flat[i:i + p.numel()].view_as(p).clone()
            i += p.numel()

    def step(self) -> None:
        self.opt.step()


def dense_slices(batch_size: int, num_dense: int) -> list[slice]:
    """The rows of each dense rank, :func:`torch.chunk`'s split of ``batch_size`` rows into ``num_dense``.

    Raises:
        UsageError: fewer rows than dense ranks.
    """
    if batch_size < num_dense:
        raise UsageError(f"--batch-size {batch_size} is smaller than the {num_dense} dense ranks: each needs a row")
    size = -(-batch_size // num_dense)
    starts = list(range(0, batch_size, size))
    if len(starts) != num_dense:
        raise UsageError(f"--batch-size {batch_size} does not split into {num_dense} non-empty chunks (torch.chunk); "
                         "pick a batch size that is a multiple of the dense ranks")
    return [slice(a, min(batch_size, a + size)) for a in starts]


@dataclass
class SimulationResult:
    """:func:`simulate`'s outcome: the loss of each step, and (``record_grads``) each step's gradients: the dense
    part's by parameter name, the tables' by table (dense ``[rows, dim]``)."""

    losses: list[float]
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)


def simulate(model: nn.Module, loss_fn: Callable, batches: Iterator[Sequence[torch.Tensor]], layout: HeteroLayout,
             steps: int, optimizer: str = "sgd", lr: float = 1e-3, record_grads: bool = False,
             checkpoint_every: int | None = None, checkpoint_dir: str | os.PathLike | None = None,
             resume_from: str | os.PathLike | None = None, start_step: int = 0) -> SimulationResult:
    """Run steps ``start_step .. steps-1`` of the schedule in one process, in the order the ranks keep it (the module
    docstring), and write the trained weights back into ``model``. Every rank's result of :func:`run_rank` equals
    this up to the order of the dense ranks' all_reduce sum.

    With ``checkpoint_dir``, the queues are drained and a checkpoint (:mod:`.hetero_checkpoint`, in
    ``checkpoint_dir/step-XXXXXXXX``) written every ``checkpoint_every`` steps and after the last, as
    :func:`run_rank` does; ``resume_from`` (such a directory, any layout) starts from it (``batches`` must then
    begin at ``start_step``, the checkpoint's step).

    Raises:
        UsageError: the model lacks the parts (:func:`check_model`) or the batch does not split over the dense ranks.
        CheckpointError: ``resume_from`` does not fit the model or ``layout``.
    """
    from . import checkpoint_store
    from .hetero_checkpoint import load_dense, load_sparse, meta, write_dense, write_sparse

    check_model(model)
    sparse = {r: SparseWorker(model, layout.shards_of(r), optimizer, lr) for r in layout.sparse_ranks}
    dense = DenseWorker(model, loss_fn, optimizer, lr)  # the replicas are equal: one holds them all
    if resume_from is not None:
        for w in sparse.values():
            load_sparse(Path(resume_from), w)
        load_dense(Path(resume_from), dense)
    pending: deque = deque()
    out = SimulationResult([])
    K = layout.max_staleness
    tables = model.sparse_arch.tables

    def drain_and_save(done: int) -> None:
        while pending:
            _, ctxs, grads = pending.popleft()
            for r, w in sparse.items():
                w.apply(ctxs[r], grads)
        if checkpoint_dir is None:
            return
        tmp = checkpoint_store.prepare(Path(checkpoint_dir), done)
        for r, w in sparse.items():
            write_sparse(tmp, r, w)
        write_dense(tmp, dense)
        checkpoint_store.commit(tmp, meta(done, layout, optimizer, [t.weight.shape[0] for t in tables],
                                          tables[0].embedding_dim, "", out.losses))

    for t in range(start_step, steps):
        if checkpoint_dir is not None and checkpoint_every and t > start_step and t % checkpoint_every == 0:
            drain_and_save(t)
        batch = next(batches)
        dense_in, ids, target = split_batch(model, batch)
        B = target.shape[0]
        slices = dense_slices(B, len(layout.dense_ranks))
        while pending and pending[0][0] < t - K:
            _, ctxs, grads = pending.popleft()
            for r, w in sparse.items():
                w.apply(ctxs[r], grads)
        parts = {r: w.lookup(ids, slices) for r, w in sparse.items()}
        dense.zero_grad()
        loss, emb_grads = 0.0, []
        for k, s in enumerate(slices):
            emb = sum(parts[r][0][k] for r in sparse)
            part_loss, g = dense.forward_backward(emb, dense_in[s] if dense_in is not None else None, target[s],
                                                  (s.stop - s.start) / B)
            loss += part_loss
            emb_grads.append(g)
        out.losses.append(loss)
        if record_grads:
            grads = {f"dense_arch.{n}": p.grad.clone() for n, p in dense.dense_arch.named_parameters()}
            for r, w in sparse.items():
                for shard, g in zip(w.shards, w.dense_grad(parts[r][1], emb_grads)):
                    name = f"sparse_arch.tables.{shard.table}.weight"
                    rows = layout.table_rows()[shard.table]
                    grads.setdefault(name, torch.zeros(rows, g.shape[1]))[shard.row_start:shard.row_end] += g
            out.grads.append(grads)
        dense.step()
        pending.append((t, {r: parts[r][1] for r in sparse}, emb_grads))
    drain_and_save(steps)
    assemble(model, layout, {r: w.state() for r, w in sparse.items()}, dense.dense_arch.state_dict())
    return out


def assemble(model: nn.Module, layout: HeteroLayout, sparse_states: dict[int, dict[str, torch.Tensor]],
             dense_state: dict[str, torch.Tensor]) -> None:
    """Write the ranks' trained state into ``model``: each sparse rank's :meth:`SparseWorker.state` and one dense
    rank's ``dense_arch`` state."""
    with torch.no_grad():
        for r, state in sparse_states.items():
            for s in layout.shards_of(r):
                model.sparse_arch.tables[s.table].weight[s.row_start:s.row_end] = state[f"table{s.table}.{s.row_start}"]
        model.dense_arch.load_state_dict(dense_state)


# --- the gloo ranks ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HeteroConfig:
    """What every rank of :func:`run_rank` gets (pickled by the launcher).

    Attributes:
        model: the initial model (every rank takes its part), or None: built from ``spec``.
        loss_fn: ``loss_fn(predicted, target)``, a mean over the rows (None with ``spec``).
        spec: ``(model text, batch_size, seq_len, data path)`` of :class:`~adaptdist.model_spec.ModelSpec` for
            a model that cannot be pickled (a model file's classes): each rank builds it and loads ``initial_state``.
        data: a :class:`~adaptdist.runtime.worker.DataSpec` of the global batches (the same on every rank).
        layout: roles, shards and K.
        steps, optimizer, lr: the training.
        timeout_s: the collective timeout (gloo's; a message not matched in it fails, naming the peer).
        threads_per_rank: torch threads where a rank is not pinned.
        cpus_of_rank: per rank the cores to pin it to, or None (``()``: no pinning).
        warmup_steps: steps left out of the throughput (the first ones start the pipeline).
        fault: a :class:`~adaptdist.runtime.faults.Fault` to inject before its 1-based step (tests), or None.
        record_first_grads: also return the first step's gradients (tests).
        devices_of_rank: per rank its :class:`~adaptdist.runtime.devices.RankDevice` (a dense rank computes there;
            sparse ranks keep their tables on cpu); empty: every rank on cpu.
        backend: the ``init_process_group`` backend (:func:`~adaptdist.runtime.devices.process_group_backend`); the
            messages between the sparse and the dense ranks are CPU tensors (gloo) whatever it is.
        checkpoint_root: write checkpoints under this directory (:mod:`.hetero_checkpoint`) and start from its
            newest good one, if any (a restart, ``--resume``); None: no checkpoints.
        checkpoint_every: steps between two checkpoints (the last step always gets one), or None: the last only.
        keep: checkpoints kept (None: all).
        model_name: the model's text (``builtin:dlrm``), for the checkpoint's meta.
    """

    model: nn.Module | None
    loss_fn: Callable | None
    data: Any
    layout: HeteroLayout
    steps: int
    optimizer: str = "sgd"
    lr: float = 1e-3
    timeout_s: float = 300.0
    threads_per_rank: int = 1
    cpus_of_rank: tuple = ()
    warmup_steps: int = 5
    fault: Fault | None = None
    record_first_grads: bool = False
    spec: tuple | None = None
    initial_state: dict | None = None
    devices_of_rank: tuple = ()
    backend: str = "gloo"
    checkpoint_root: str | None = None
    checkpoint_every: int | None = None
    keep: int | None = None
    model_name: str = ""

    def built(self) -> "HeteroConfig":
        """This config with ``model`` and ``loss_fn`` (built from ``spec`` and ``initial_state`` when None)."""
        if self.model is not None:
            return self
        import dataclasses
        import contextlib
        import io

        from ..model_spec import ModelSpec

        text, batch_size, seq_len, path = self.spec
        with contextlib.redirect_stderr(io.StringIO()):  # the launcher has said which data it reads
            model, _, loss_fn = ModelSpec.parse(text).build(batch_size, seq_len, data_path=path)
        model.load_state_dict(self.initial_state)
        return dataclasses.replace(self, model=model, loss_fn=loss_fn)


def _fire(cfg: HeteroConfig, rank: int, step: int, attempt: int = 0) -> None:
    if cfg.fault is not None:
        cfg.fault.maybe_fire(rank, step, attempt=attempt)


def _attempt() -> int:
    """The launcher's restart count (0 for the first start): a fault fires in the first attempt only."""
    from .launch import restart_count

    return restart_count()


class _Checkpointer:
    """Writes this rank's part of an async-hetero checkpoint at step boundaries (every rank calls :meth:`save`
    at the same steps; the first dense rank prepares and commits, :mod:`.checkpoint_store`'s protocol)."""

    def __init__(self, cfg: HeteroConfig, rank: int, group):
        self.cfg, self.rank, self.group = cfg, rank, group
        self.writer = cfg.layout.dense_ranks[0]
        self.saved: list[int] = []

    def due(self, done: int) -> bool:
        """Whether a checkpoint follows ``done`` steps."""
        cfg = self.cfg
        if cfg.checkpoint_root is None or done == 0:
            return False
        return done == cfg.steps or (cfg.checkpoint_every is not None and done % cfg.checkpoint_every == 0)

    def save(self, done: int, write, losses: Sequence[float] = ()) -> None:
        import torch.distributed as dist

        from . import checkpoint_store
        from .hetero_checkpoint import meta

        cfg = self.cfg
        root = Path(cfg.checkpoint_root)
        tmp = [checkpoint_store.prepare(root, done) if self.rank == self.writer else None]
        dist.broadcast_object_list(tmp, src=self.writer, group=self.group)
        write(Path(tmp[0]))
        dist.barrier(group=self.group)
        if self.rank == self.writer:
            tables = cfg.model.sparse_arch.tables
            checkpoint_store.commit(Path(tmp[0]), meta(done, cfg.layout, cfg.optimizer,
                                                      [t.weight.shape[0] for t in tables], tables[0].embedding_dim,
                                                      cfg.model_name, losses), keep=cfg.keep)
        dist.barrier(group=self.group)  # committed before any rank goes on (a failure after it resumes from it)
        self.saved.append(done)


def _resume_point(cfg: HeteroConfig, rank: int, group) -> tuple[str | None, int, list[float]]:
    """``(checkpoint directory or None, steps done, losses so far)``: the newest good checkpoint under
    ``cfg.checkpoint_root``, found by the first dense rank and told to every rank.

    Raises:
        CheckpointError: it is not an async-hetero checkpoint of this model and optimizer.
    """
    import torch.distributed as dist

    from . import checkpoint_store
    from .hetero_checkpoint import check_meta

    if cfg.checkpoint_root is None:
        return None, 0, []
    found: list = [None]
    if rank == cfg.layout.dense_ranks[0]:
        try:
            info = checkpoint_store.latest_good(Path(cfg.checkpoint_root),
                                                lambda m: print(f"rank {rank}: {m}", file=sys.stderr, flush=True))
            if info is not None:
                tables = cfg.model.sparse_arch.tables
                check_meta(info.meta, info.path, cfg.optimizer, [t.weight.shape[0] for t in tables],
                           tables[0].embedding_dim)
                found[0] = (str(info.path), info.step, list(info.meta.get("losses", [])))
        except CheckpointError as e:  # told to every rank: all fail alike, none waits for the others
            found[0] = str(e)
    dist.broadcast_object_list(found, src=cfg.layout.dense_ranks[0], group=group)
    if isinstance(found[0], str):
        raise CheckpointError(found[0])
    return found[0] if found[0] is not None else (None, 0, [])


def run_rank(cfg: HeteroConfig) -> dict:
    """One rank of ``--mode async-hetero`` (under :func:`~adaptdist.runtime.launch.launch_local`, which sets
    the collective timeout). Returns ``{"role", "rank", "state"}`` (sparse: its shards; dense: ``dense_arch``'s
    state) and, on dense ranks, ``losses``, ``mean_step_time_s`` (the mean interval between two step ends after
    ``warmup_steps``), ``items_per_s`` (the batch over it) and ``step_time_s`` (the median interval).

    Raises:
        CollectiveTimeoutError: a peer died or stalled: names it (``named_timeout``).
    """
    from datetime import timedelta

    import torch.distributed as dist

    from .affinity import pin_to_cpus
    from .heartbeat import Heartbeat, named_timeout
    from .worker import positioned_batches

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pinned = cfg.cpus_of_rank[rank] if rank < len(cfg.cpus_of_rank) else None
    if pin_to_cpus(pinned, rank) is None:
        torch.set_num_threads(cfg.threads_per_rank)
    layout = cfg.layout
    if world != layout.world_size:
        raise UsageError(f"the layout is for {layout.world_size} ranks, the job has {world}")
    cfg = cfg.built()
    device = torch.device("cpu")
    if rank < len(cfg.devices_of_rank):
        from .devices import bind_device

        device = bind_device(cfg.devices_of_rank[rank])
    dist.init_process_group(cfg.backend, timeout=timedelta(seconds=cfg.timeout_s))
    role = layout.roles[rank]
    dense_group = dist.new_group(list(layout.dense_ranks)) if len(layout.dense_ranks) > 1 else None
    # checkpoints coordinate on a group of their own: its collectives never meet the queues' tagged messages
    ckpt_group = dist.new_group(list(range(world))) if cfg.checkpoint_root is not None else None
    resume_dir, start, prior_losses = _resume_point(cfg, rank, ckpt_group)
    if resume_dir is not None:
        print(f"rank {rank}: resuming from {resume_dir} (step {start})", file=sys.stderr, flush=True)
    ckpt = _Checkpointer(cfg, rank, ckpt_group)
    heartbeat = Heartbeat(rank, world, collective_timeout_s=cfg.timeout_s)
    heartbeat.beat(0)
    print(f"rank {rank}: {role}" + (f", shards {list(layout.shards_of(rank))}" if role != DENSE else "")
          + (f", pinned to cpus {list(pinned)}" if pinned is not None else "")
          + (f", on {device}" if role == DENSE and device.type != "cpu" else ""), file=sys.stderr, flush=True)
    import itertools

    batches = positioned_batches(cfg.data, start, lambda m: print(f"rank {rank}: {m}", file=sys.stderr, flush=True))
    # read the data before the first message: a rank still loading it must not time its peers out
    batches = itertools.chain([next(batches)], batches)
    dist.barrier()
    at = [0]  # the step this rank is in (1-based), for the error

    def beat(step: int) -> None:
        at[0] = step
        heartbeat.beat(step)

    try:
        at[0] = start
        if role == DENSE:
            out = _dense_loop(cfg, rank, batches, dense_group, beat, device, start, resume_dir, prior_losses, ckpt)
        else:
            out = _sparse_loop(cfg, rank, batches, beat, start, resume_dir, ckpt)
        dist.barrier()  # every message matched before any rank tears its group down
    except Exception as e:
        raise named_timeout(e, heartbeat, max(1, at[0])) from e
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"rank": rank, "role": role, "start_step": start, "checkpoints": ckpt.saved, **out}


def _wait(works: Sequence[Any]) -> None:
    for w in works:
        w.wait()


def _sparse_loop(cfg: HeteroConfig, rank: int, batches, beat, start: int = 0, resume_dir: str | None = None,
                 ckpt: _Checkpointer | None = None) -> dict:
    import torch.distributed as dist

    from .hetero_checkpoint import load_sparse, write_sparse

    layout = cfg.layout
    worker = SparseWorker(cfg.model, layout.shards_of(rank), cfg.optimizer, cfg.lr)
    if resume_dir is not None:
        load_sparse(Path(resume_dir), worker)
    dense_ranks = layout.dense_ranks
    K = layout.max_staleness
    inflight: deque = deque()  # (step, ctx, grad buffers, recv works, send works, sent tensors)
    wait_s = lookup_s = apply_s = post_s = 0.0
    first_grads = None
    wall0, cpu0 = time.perf_counter(), time.process_time()

    def apply_oldest() -> None:
        nonlocal wait_s, apply_s, first_grads
        t, ctx, grads, recvs, sends, _ = inflight.popleft()
        t0 = time.perf_counter()
        _wait(recvs)
        _wait(sends)
        t1 = time.perf_counter()
        if cfg.record_first_grads and t == 0:
            first_grads = {f"table{s.table}.{s.row_start}": g for s, g in zip(worker.shards,
                                                                              worker.dense_grad(ctx, grads))}
        worker.apply(ctx, grads)
        wait_s += t1 - t0
        apply_s += time.perf_counter() - t1

    for t in range(start, cfg.steps):
        if ckpt is not None and t > start and ckpt.due(t):  # drained first: every step < t applied
            while inflight:
                apply_oldest()
            ckpt.save(t, lambda d: write_sparse(d, rank, worker))
        beat(t + 1)
        _fire(cfg, rank, t + 1, _attempt())
        batch = next(batches)
        _, ids, target = split_batch(cfg.model, batch)
        slices = dense_slices(target.shape[0], len(dense_ranks))
        while inflight and inflight[0][0] < t - K:  # the staleness bound: steps < t-K applied before lookup t
            apply_oldest()
        t0 = time.perf_counter()
        parts, ctx = worker.lookup(ids, slices)
        parts = [p.contiguous() for p in parts]
        t1 = time.perf_counter()
        lookup_s += t1 - t0
        sends = [dist.isend(p, dst=d, tag=t) for p, d in zip(parts, dense_ranks)]
        grads = [torch.empty(s.stop - s.start, worker.num_tables, worker.dim) for s in slices]
        recvs = [dist.irecv(g, src=d, tag=t) for g, d in zip(grads, dense_ranks)]
        post_s += time.perf_counter() - t1
        inflight.append((t, ctx, grads, recvs, sends, parts))  # parts: alive until their sends complete
    while inflight:
        apply_oldest()
    if ckpt is not None and cfg.steps > start and ckpt.due(cfg.steps):
        ckpt.save(cfg.steps, lambda d: write_sparse(d, rank, worker))
    # loop_s: the loop's wall time; cpu_s: this process's CPU time in it (gloo's threads included), the work
    # a quiet core would need
    out = {"state": worker.state(), "wait_s": wait_s, "lookup_s": lookup_s, "apply_s": apply_s, "post_s": post_s,
           "loop_s": time.perf_counter() - wall0, "cpu_s": time.process_time() - cpu0}
    if first_grads is not None:
        out["first_grads"] = first_grads
    return out


def _dense_loop(cfg: HeteroConfig, rank: int, batches, dense_group, beat, device: torch.device, start: int = 0,
                resume_dir: str | None = None, prior_losses: Sequence[float] = (),
                ckpt: _Checkpointer | None = None) -> dict:
    import torch.distributed as dist

    from .devices import from_exchange, to_exchange
    from .hetero_checkpoint import load_dense, write_dense

    layout = cfg.layout
    worker = DenseWorker(cfg.model, cfg.loss_fn, cfg.optimizer, cfg.lr, device=device)
    if resume_dir is not None:
        load_dense(Path(resume_dir), worker)
    # the dense ranks' all_reduce: on their device when all are cuda (nccl), else on cpu (gloo)
    dense_kinds = {cfg.devices_of_rank[r].kind if r < len(cfg.devices_of_rank) else "cpu" for r in layout.dense_ranks}
    reduce_device = device if dense_kinds == {"cuda"} else torch.device("cpu")
    sparse_ranks = layout.sparse_ranks
    me = layout.dense_ranks.index(rank)
    num_tables = len(cfg.model.sparse_arch.tables)
    dim = cfg.model.sparse_arch.tables[0].embedding_dim
    K = layout.max_staleness
    posted: deque = deque()  # (step, buffers, recv works): at most K + 1 steps ahead
    losses, ends = list(prior_losses), []
    wait_s = compute_s = reduce_s = 0.0
    grads_of_step: list = []
    sends_pending: deque = deque()
    queue: deque = deque()  # the batches of the posted steps
    post_s = data_s = 0.0
    wall0, cpu0 = time.perf_counter(), time.process_time()

    def post(t: int) -> None:
        nonlocal data_s
        t0 = time.perf_counter()
        batch = next(batches)
        data_s += time.perf_counter() - t0
        dense_in, _, target = split_batch(cfg.model, batch)
        s = dense_slices(target.shape[0], len(layout.dense_ranks))[me]
        bufs = [torch.empty(s.stop - s.start, num_tables, dim) for _ in sparse_ranks]
        works = [dist.irecv(b, src=r, tag=t) for b, r in zip(bufs, sparse_ranks)]
        posted.append((t, bufs, works))
        queue.append((from_exchange(dense_in[s], device) if dense_in is not None else None,
                      from_exchange(target[s], device), (s.stop - s.start) / target.shape[0]))

    for t in range(start, min(start + K + 1, cfg.steps)):
        post(t)
    for t in range(start, cfg.steps):
        beat(t + 1)
        _fire(cfg, rank, t + 1, _attempt())
        _, bufs, works = posted.popleft()
        dense_in, target, share = queue.popleft()
        t0 = time.perf_counter()
        _wait(works)
        t1 = time.perf_counter()
        emb = from_exchange(sum(bufs[1:], bufs[0]), device)  # in sparse-rank order, as simulate() adds them
        worker.zero_grad()
        loss, g = worker.forward_backward(emb, dense_in, target, share)
        g = to_exchange(g)  # to the sparse ranks over gloo
        tp = time.perf_counter()
        sends = [dist.isend(g, dst=r, tag=t) for r in sparse_ranks]
        sends_pending.append((sends, g))
        if t + K + 1 < cfg.steps:
            post(t + K + 1)
        t2 = time.perf_counter()
        post_s += t2 - tp
        if dense_group is not None:
            flat = torch.cat([worker.flat_grads().to(reduce_device), torch.tensor([loss], device=reduce_device)])
            dist.all_reduce(flat, group=dense_group)
            worker.set_flat_grads(flat[:-1].to(device))
            loss = float(flat[-1])
        t3 = time.perf_counter()
        if cfg.record_first_grads and t == start:
            grads_of_step = {f"dense_arch.{n}": p.grad.cpu().clone() for n, p in worker.dense_arch.named_parameters()}
        worker.step()
        while len(sends_pending) > K + 1:
            _wait(sends_pending.popleft()[0])
        losses.append(loss)
        ends.append(time.perf_counter())
        wait_s += t1 - t0
        compute_s += (tp - t1) + (ends[-1] - t3)
        if ckpt is not None and ckpt.due(t + 1):  # this step's gradients sent before the state is saved
            while sends_pending:
                _wait(sends_pending.popleft()[0])
            ckpt.save(t + 1, lambda d: write_dense(d, worker) if rank == ckpt.writer else None, losses)
        reduce_s += t3 - t2
    while sends_pending:
        _wait(sends_pending.popleft()[0])
    import statistics

    warm = min(cfg.warmup_steps, max(0, len(ends) - 2))
    B = cfg.data.batch_size
    # the pipeline's step: the mean interval between step ends over the run (a queue K deep delivers steps in
    # bursts, so the median interval flatters it); the median beside it, as the synchronous worker reports
    intervals = [b - a for a, b in zip(ends[warm:], ends[warm + 1:])] or [float("nan")]
    mean_s = (ends[-1] - ends[warm]) / max(1, len(ends) - 1 - warm)
    out = {"state": {k: v.detach().cpu() for k, v in worker.dense_arch.state_dict().items()}, "losses": losses, "items_per_s": B / mean_s,
           "step_time_s": statistics.median(intervals), "mean_step_time_s": mean_s, "wait_s": wait_s,
           "compute_s": compute_s, "reduce_s": reduce_s, "post_s": post_s - data_s, "data_s": data_s,
           "loop_s": time.perf_counter() - wall0, "cpu_s": time.process_time() - cpu0}
    if cfg.record_first_grads:
        out["first_grads"] = grads_of_step
    return out
