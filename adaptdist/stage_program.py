"""Pipeline stage programs: what one rank runs in a pipeline-parallel step (data model layer).

A pipeline plan cuts the captured joint graph at layer boundaries into ``num_stages`` stages; each
stage runs on a sub-mesh of ranks (its intra-stage SPMD mesh, e.g. ``{"dp": 2}`` or ``{"tp": 2}``,
lowered by the ordinary passes). The global batch of each pipeline replica (its rows:
:attr:`PipelineRankProgram.batch_slice`) is cut into ``num_microbatches`` equal microbatches of
:attr:`PipelineRankProgram.microbatch_rows` rows each. Per microbatch ``m`` a rank runs, for each of
its stages (one, or several for interleaved schedules), three GraphModules:

``forward(*state, *recv, *batch_mb, *normalizers) -> (*send, *saved)``
    ``state``: this rank's tensors named by :attr:`StageProgram.state_names` (its own shards);
    ``recv``: the tensors received from the previous stage for microbatch ``m``
    (:attr:`StageProgram.recv_specs`, empty on stage 0); ``batch_mb``: EVERY batch tensor of the step,
    rows ``[off + m*rows, off + (m+1)*rows)`` (``off, _ = batch_slice``), in the batch's order (a
    stage ignores those it does not use); ``normalizers``: the prologue's reduced outputs
    (:attr:`PipelineRankProgram.prologue`, empty if None). Outputs: ``send`` (to the next stage,
    :attr:`StageProgram.send_specs`), then ``saved`` (kept for this microbatch's backward). On the LAST
    stage ``send`` is empty and the FIRST output is this microbatch's loss term, a 0-dim tensor, scaled
    so that the sum over microbatches (and over the batch group, :attr:`PipelineRankProgram.batch_group`)
    is the global loss of the step: ``(loss_term, *saved)``.
``backward_input(*saved, *grad_in) -> (*grad_out, *saved_w)``
    ``grad_in``: received from the next stage (:attr:`StageProgram.grad_in_specs`; empty on the last
    stage, whose backward starts from the loss); ``grad_out``: sent to the previous stage
    (:attr:`StageProgram.grad_out_specs`; empty on stage 0); ``saved_w``: kept for ``backward_weight``.
    Usually ``grad_in`` are the gradients of this stage's ``send`` tensors and ``grad_out`` those of
    its ``recv`` tensors (same specs), but the cut may carry other backward values (e.g. a gradient
    summed on the earlier stage): always use ``grad_in_specs`` / ``grad_out_specs``.
``backward_weight(*saved_w) -> (*grads)``
    This microbatch's contribution to the gradient of each parameter of :attr:`StageProgram.grad_fqns`
    (its local shard), in that order. The runtime ADDS the contributions of all microbatches, then
    all-reduces (sum) each accumulated gradient over :attr:`PipelineRankProgram.grad_groups` ``[fqn]``
    (the ranks holding the same shard: data-parallel peers of the stage and, for a tied weight, the
    ranks of the other stages holding it), when that group has more than one rank. Schedules other
    than zero-bubble run ``backward_weight`` right after ``backward_input``. A rank holding one parameter on
    two of its stages (interleaved, tied) adds both stages' contributions before the all-reduce.

Collectives inside the three programs (tensor parallelism within a stage) are ``_c10d_functional``
ops on group names ``adaptdist:<axis>`` mapped to global ranks by :attr:`PipelineRankProgram.groups`;
all ranks of such a group run the same stage on the same microbatch in the same order. Data-parallel
reductions inside a stage (normalizers, gradients, the loss) are NOT in the programs: they are the
runtime's (prologue, ``grad_groups``, ``batch_group``) as described here.

Shared memory (``--comm auto|shm``): a group whose ranks share a host is listed in
:attr:`PipelineRankProgram.shm_groups` under its shared-memory name (:func:`adaptdist.mesh.shm_group_name`:
``adaptdist:tp[0,1]``); the programs' collectives of such an intra-stage group are then
``torch.ops.adaptdist.shm_*`` ops naming it, and the runtime's all-reduces over such a rank set (the data-parallel
peers' gradients and normalizers, a tied weight's holders: ``adaptdist:dp[..]``, ``adaptdist:grads[..]``) go
through the kernels for float32/bfloat16/float16 sums and maxima. Sends and receives between stages, the float64
loss and integer normalizers stay on gloo.

Prologue (``prologue(*local_batch) -> (*normalizers)``): evaluated once per step, before the schedule,
on this replica's whole local batch (rows ``batch_slice``, every batch tensor); its outputs are the
per-replica partial values of the batch-only reductions the forward needs (e.g. the number of valid,
non-ignored tokens of a cross-entropy over all microbatches). The runtime all-reduces output ``i`` with
op :attr:`PrologueProgram.reduce_ops` ``[i]`` (``"sum"``, ``"max"`` or ``"min"``) over
:attr:`PipelineRankProgram.batch_group`, then passes them to every ``forward``.

Sends and receives: stage ``s`` of this rank receives from :attr:`StageProgram.recv_from` and sends to
:attr:`StageProgram.send_to` (global ranks, None at the ends); gradients travel the other way (to
``recv_from``, from ``send_to``). Every tensor is contiguous, with the shapes and dtypes of the specs,
identical for all microbatches, so receivers preallocate.

Tied weights (a weight used on two stages, e.g. GPT's token embedding and output head): each stage
holding it has it in ``state_names`` and ``grad_fqns``; its ``grad_groups`` entry names all the
ranks holding it, so the all-reduce sums the contributions and the copies stay identical after an
identical optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor sent or received per microbatch (local, i.e. this rank's shard)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def empty(self) -> torch.Tensor:
        """A preallocated receive buffer."""
        return torch.empty(self.shape, dtype=self.dtype)


@dataclass(frozen=True)
class StageProgram:
    """What one rank runs for one (virtual) stage, per microbatch (signatures in the module docstring).

    Attributes:
        stage, num_stages: this stage's index (0 = first) and the pipeline's number of stages.
        forward, backward_input, backward_weight: the three GraphModules.
        state_names: fqns of the state tensors ``forward`` takes first, in order (params, frozen
            params, buffers this stage uses; a subset of :attr:`PipelineRankProgram.state`).
        grad_fqns: parameters whose gradient contribution ``backward_weight`` returns, in order.
        recv_specs, send_specs: per-microbatch specs of the forward's ``recv`` / ``send``.
        grad_in_specs, grad_out_specs: per-microbatch specs of ``backward_input``'s ``grad_in`` (received
            from ``send_to``) / ``grad_out`` (sent to ``recv_from``).
        recv_from, send_to: global rank of the previous / next stage's peer, None at the pipeline's ends.
        num_saved, num_saved_w: number of ``saved`` / ``saved_w`` values.
        layers: the layers (module names) the stage holds, for reports.
        coords: this rank's coordinates in the stage's sub-mesh (axis -> index).
        submesh: the stage's sub-mesh (axis -> size); ``{}`` for one rank.
        routes: where the previous or next stage runs on a sub-mesh of another data-parallel size, the
            :class:`~adaptdist.stage_routes.StageRoutes` of every tensor crossing the boundary (pieces of the
            batch rows to or from several peers); ``recv_from`` / ``send_to`` then name only the first peer.
            None: whole tensors to and from ``recv_from`` / ``send_to``.
    """

    stage: int
    num_stages: int
    forward: torch.nn.Module
    backward_input: torch.nn.Module
    backward_weight: torch.nn.Module
    state_names: tuple[str, ...]
    grad_fqns: tuple[str, ...]
    recv_specs: tuple[TensorSpec, ...]
    send_specs: tuple[TensorSpec, ...]
    grad_in_specs: tuple[TensorSpec, ...]
    grad_out_specs: tuple[TensorSpec, ...]
    recv_from: int | None
    send_to: int | None
    num_saved: int
    num_saved_w: int
    layers: tuple[str, ...] = ()
    coords: Mapping[str, int] = field(default_factory=dict)
    submesh: Mapping[str, int] = field(default_factory=dict)
    routes: Any = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


@dataclass(frozen=True)
class PrologueProgram:
    """The step's batch-only reductions (module docstring): ``module(*local_batch) -> (*normalizers)``.

    Attributes:
        module: the GraphModule.
        reduce_ops: per output, how the batch group combines it: ``"sum"``, ``"max"`` or ``"min"``.
        names: per output, the joint-graph node it replaces (for messages and reports).
    """

    module: torch.nn.Module
    reduce_ops: tuple[str, ...]
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class PipelineRankProgram:
    """One rank's whole pipeline step.

    Attributes:
        rank, world_size: this rank and the number of ranks.
        stages: this rank's stage programs, in increasing stage order (one; several for interleaved).
        prologue: the batch-only reductions, or None (no normalizers: ``forward`` takes none).
        num_microbatches: microbatches per step (per replica).
        microbatch_rows: rows of each microbatch (all equal).
        batch_slice: ``(offset, size)`` of this replica's rows of the global batch; ``size ==
            num_microbatches * microbatch_rows``.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` or ``"zb"`` (the plan's).
        stage_ranks: stage -> global ranks running it, in sub-mesh rank order (all ranks' layout).
        batch_group: global ranks that run the same stages on other rows of the batch (data-parallel
            peers, this rank included): the prologue's normalizers and the last stage's loss are
            all-reduced (sum) over it.
        grad_groups: fqn -> global ranks holding the same shard of that parameter (this rank included):
            the accumulated gradient is all-reduced (sum) over it when it has more than one rank.
        groups: collective group name used in the programs (``adaptdist:<axis>``) -> global ranks of
            this rank's group.
        state: this rank's tensors at step 0 (its own shards), by fqn: the union of its stages' state.
        param_fqns: the trainable parameters among them (the optimizer's), in order.
        global_shapes: fqn -> global (unsharded) shape of each state tensor.
        state_placements: fqn -> placement text per intra-stage mesh axis of sharded state tensors.
        loss_rank: True on the ranks whose last stage computes the loss.
        plan: the pipeline :class:`~adaptdist.plan.Plan` the program was lowered from.
        shm_groups: shared-memory group name -> its global ranks (ascending), for every group of this rank carried
            by adaptdist's shared-memory kernels (module docstring); empty under ``--comm gloo``.
        microbatch_stride: rows between the starts of two microbatches of this rank; 0: ``microbatch_rows`` (the
            replica's rows ``batch_slice`` are contiguous). Stages of different data-parallel sizes cut the global
            batch into ``num_microbatches`` contiguous microbatches of ``stride`` rows first, then each microbatch
            over the replicas: replica ``d`` of ``D`` reads rows ``[m*stride + d*rows, m*stride + (d+1)*rows)``
            (``batch_slice = (d*rows, M*rows)``), so every stage sees microbatch ``m`` as the same rows.
    """

    rank: int
    world_size: int
    stages: tuple[StageProgram, ...]
    prologue: PrologueProgram | None
    num_microbatches: int
    microbatch_rows: int
    batch_slice: tuple[int, int]
    schedule: str
    stage_ranks: Mapping[int, tuple[int, ...]]
    batch_group: tuple[int, ...]
    grad_groups: Mapping[str, tuple[int, ...]]
    groups: Mapping[str, tuple[int, ...]]
    state: Mapping[str, torch.Tensor]
    param_fqns: tuple[str, ...]
    global_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    state_placements: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    loss_rank: bool = False
    plan: Any = None
    # ModuleList experts held stacked: stacked name -> the user's names (model.safetensors is written under those)
    stacked: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    microbatch_stride: int = 0
    shm_groups: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    comm: str = ""  # the --comm it was lowered under ("": not recorded); auto: a group not made at the start -> gloo

    def transports(self) -> dict[str, str]:
        """Each axis of the plan's mesh -> how its communication travels on this rank: ``"gloo"`` (``pp``: sends
        and receives; an axis whose groups cross hosts), ``"shm"`` (an axis with a shared-memory group here),
        ``"none"`` (size 1). What ``summary.json`` and the artifacts' manifest record."""
        from .mesh import Mesh, base_group_name

        mesh = dict(self.plan.mesh) if self.plan is not None else {}
        shm = {base_group_name(n) for n in self.shm_groups}
        return {a: "none" if int(n) == 1 else "shm" if Mesh.group_name(a) in shm else "gloo" for a, n in mesh.items()}

    def microbatch(self, batch: tuple[torch.Tensor, ...], m: int) -> tuple[torch.Tensor, ...]:
        """Microbatch ``m``'s rows of the GLOBAL batch (every tensor, dim 0)."""
        off = self.batch_slice[0] + m * (self.microbatch_stride or self.microbatch_rows)
        return tuple(t[off:off + self.microbatch_rows] for t in batch)

    def local_batch(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """This replica's rows of the global batch (the prologue's input): its microbatches in order."""
        if self.microbatch_stride and self.microbatch_stride != self.microbatch_rows:
            mbs = [self.microbatch(batch, m) for m in range(self.num_microbatches)]
            return tuple(torch.cat([mb[i] for mb in mbs]) for i in range(len(batch)))
        off, size = self.batch_slice
        return tuple(t[off:off + size] for t in batch)
