"""Step time of a DLRM-style recommender in the two execution modes (issue 17): synchronous data parallelism
over every rank, and the asynchronous heterogeneous pipeline of :mod:`adaptdist.hetero_layout` (sparse ranks
hold the tables, dense ranks the MLP).

The parts of a step, per rank (figures of :class:`RecsysShape`, devices and links of the cluster):

- embedding work (memory bound): each lookup of a ``dim``-vector reads it once in forward and, in backward,
  reads and writes it again for the gradient and the update: ``3 * dim * 4`` bytes per looked-up id, at the
  device's memory bandwidth, plus ``SPARSE_OPS_PER_SHARD`` dispatched ops per table shard;
- dense work: ``3 x`` the forward FLOPs (forward + backward, Kaplan et al. 2020's rule) of the rank's rows, on
  the roofline (:func:`~adaptdist.cost_models.compute.roofline_time_s`) with its activations' bytes, plus
  ``dense_ops`` dispatched ops, and the optimizer's step over the dense parameters (``OPTIMIZER_BYTES_PER_PARAM``, ``OPTIMIZER_OPS_PER_TENSOR``);
- synchronous mode (:func:`sync_cost`), as the compiled data-parallel programs run it: the loss's all_reduce, one
  bucketed all_reduce of the dense parameters' gradients and of the small tables', whose whole ``[rows, dim]``
  gradients are copied into the bucket and out (``2 x 4`` bytes per element); a large table's gradient is built on
  every rank from the batch's gathered gradient rows and ids (one all_gather for all such tables,
  :data:`GATHER_OPS` ops: ``passes/gather_embedding_rows.py``, :func:`gathered_tables`) instead of all-reduced
  whole; every table's
  gradient is dense (zeroed and accumulated, ``2 x 4`` bytes per element) and the optimizer steps every
  parameter on every rank; the step takes the slowest rank's time (a synchronous step waits for everyone);
- asynchronous mode: the lookups (``float32[B_d, T, dim]``) travel from each sparse rank to each dense rank and
  their gradients back (point-to-point, Hockney's ``latency + bytes / bandwidth``: :func:`_p2p_s`, measured
  figures for two ranks of one host: :data:`LOCAL_GLOO_P2P_ALPHA_S`); the dense ranks all-reduce the
  dense gradients only. With ``max_staleness >= 1`` the sides overlap (the pipeline's step is its slowest
  stage's; both sides' messages are charged to each side, so the bound of K + 1 steps in flight never binds);
  with 0 they alternate: the step is the sparse side's work, then the dense forward + backward and the two
  messages, while the dense all_reduce and optimizer step overlap the sparse side's next update and lookups (the
  dense loop sends the gradients first), or the dense side's whole cycle where that is longer. The sparse rank's update: ``SPARSE_APPLY_OPS_PER_SHARD`` ops per shard and,
  with AdamW, the shard's dense gradient zeroed and accumulated (``2 x 4`` bytes per held parameter, as sync's
  table gradients) before the optimizer's passes;
- sync's all_reduce runs through adaptdist's shared-memory kernels where they are loaded and the ranks share a
  host (as the compiled programs do under ``--comm auto``: :func:`shm_kernels_loaded`), at the cluster's
  measured ``shm`` fit or the estimated shared-memory figures, not gloo's.

Per-op overhead: the device's ``op_overhead_s`` (measured by ``adaptdist cluster profile``) where given, else
:data:`DEFAULT_OP_OVERHEAD_S` (a CPU dispatch ~5 µs, as profiled on this project's machines; a CUDA kernel
launch ~10 µs from the host, NVIDIA's launch-latency figures): tiny recommender MLPs are overhead bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .communication import collective_time_s, link_cost
from .compute import overlaps_compute_and_memory, peak_flops_per_s, roofline_time_s
from .hardware import ClusterLike

DEFAULT_OP_OVERHEAD_S = {"cpu": 5e-6, "cuda": 1e-5}
SPARSE_OPS_PER_SHARD = 12
"""Dispatched ops per table shard per step of the lookups (mask, clamp, embedding_bag, ...: adaptdist/runtime/
async_hetero.py's SparseWorker.lookup)."""
SPARSE_APPLY_OPS_PER_SHARD = 12
"""Dispatched ops per table shard per step of the update (mul, reshape, unique, zeros, index_add, index_add_, ...:
SparseWorker.apply). Measured (benchmarks/profile_recsys_step.py, 2026-12-03): SGD's apply of builtin:dlrm's 3
shards takes 0.19 ms, which the model before this term put at 0."""
OPTIMIZER_BYTES_PER_PARAM = {"sgd": 12, "adamw": 28}
"""float32 bytes the optimizer step moves from memory per parameter: SGD reads p and g and writes p; AdamW reads p,
g, m and v and writes p, m and v once (28 B). torch's single-tensor AdamW (torch/optim/adamw.py, the CPU default: no
foreach) makes 8 passes over each tensor (p *= 1 - lr*wd, m.lerp_(g), v *= b2, v.addcmul_(g, g), sqrt, div, add
eps, p.addcdiv_(m, denom): 84 B if every pass went to memory), but one tensor's passes follow each other, so after
the first they find it in cache (builtin:dlrm's largest, 9,742 x 32: 5 MB with its gradient and state, under this
machine's 32 MiB L3). Measured (``benchmarks/profile_recsys_step.py``, one process on one core; benchmarks/RESULTS.md
"AdamW's cost"): the step over builtin:dlrm's 340,449 parameters in 9 tensors takes 1.32 ms (min), which the 84 B
put at 3.31 ms and 28 B puts at 1.40 ms (10 GB/s, 5 us per op). A tensor whose gradient and state exceed the last-level
cache moves up to 84 B (not modelled: no cache size in the device description)."""
OPTIMIZER_OPS_PER_TENSOR = {"sgd": 1, "adamw": 10}
"""Dispatched ops of the optimizer step per parameter tensor (single-tensor implementations, as above)."""
LOCAL_GLOO_P2P_ALPHA_S = 46e-6
LOCAL_GLOO_P2P_BETA_S_PER_BYTE = 0.38e-9
"""One gloo message between two processes of one host (blocking send + recv, each pinned to its core, 1 thread):
measured on this project's 2-core machine, round trips of two processes on cores 0 and 1 (minimum of 300,
2026-12-03 20:00 UTC, load 15: 93 us for 4 B, 168 us for 98 KB -- the queues' message of builtin:dlrm -- and 387 us
for 393 KB each way; again with ``benchmarks/profile_recsys_step.py --reps 100`` (``--p2p-sizes``' default), 20:28
UTC, load 19: 91, 177, 406 us) -> 46 us + 0.38 ns/B (2.6 GB/s) per message (benchmarks/RESULTS.md). Used for an uncalibrated
cluster's intra-host pair (its link's estimated 0.5 ms latency is a TCP figure, ~10x the loopback's)."""
BYTES = 4  # float32
INDEX_BYTES = 8  # int64 ids
GATHER_OPS = 10
"""Dispatched ops per table whose gradient rows the synchronous programs gather (for the rows and for the indices:
constant_pad_nd, reshape into the merged buffer, reshape out of it, slice; the indices' float32 copy there and
int64 copy back: the compiled rank program of ``adaptdist train builtin:dlrm --plan dp``,
``passes/bucket_gathered_rows.py``)."""
GATHER_SHARED_OPS = 3
"""Dispatched ops of the merged gather once per step (cat, reshape, split_with_sizes; the collective is priced in
:func:`sync_comm_s`)."""


@dataclass(frozen=True)
class RecsysShape:
    """What the cost model needs of a recommender and its batch.

    Attributes:
        table_rows: rows of each embedding table.
        dim: embedding width.
        ids_per_row: looked-up ids per batch row, per table (a bag's width; 1 for a single id).
        dense_flops_per_row: forward FLOPs of the dense part per batch row.
        dense_bytes_per_row: forward activation bytes of the dense part per batch row.
        dense_params: parameters of the dense part.
        dense_ops: dispatched ops of one dense forward + backward (independent of the batch).
        batch_size: the global batch.
        optimizer: ``"sgd"`` or ``"adamw"``.
        dense_tensors: parameter tensors of the dense part (the optimizer's ops are per tensor).
    """

    table_rows: tuple[int, ...]
    dim: int
    ids_per_row: tuple[int, ...]
    dense_flops_per_row: float
    dense_bytes_per_row: float
    dense_params: int
    dense_ops: int
    batch_size: int
    optimizer: str = "adamw"
    dense_tensors: int = 1

    @property
    def table_params(self) -> int:
        return sum(self.table_rows) * self.dim


@dataclass(frozen=True)
class ModeCost:
    """A predicted step: ``step_s`` and, per rank, the seconds of its own work (``rank_s``) and of communication
    (``comm_s``); ``items_per_s`` the samples per second it implies."""

    mode: str
    step_s: float
    rank_s: tuple[float, ...]
    comm_s: tuple[float, ...]
    batch_size: int

    @property
    def items_per_s(self) -> float:
        return self.batch_size / self.step_s if self.step_s > 0 else float("inf")


def _op_s(device) -> float:
    v = getattr(device, "op_overhead_s", None)
    return float(v) if v is not None else DEFAULT_OP_OVERHEAD_S.get(str(device.kind), 5e-6)


def _p2p_s(cluster: ClusterLike, a: int, b: int, n_bytes: float) -> float:
    """One point-to-point message between ranks ``a`` and ``b``: ``alpha_s + n_bytes * beta_s_per_byte`` (Hockney)
    of one hop of their gloo ring (:func:`~adaptdist.cost_models.communication.link_cost`: the cluster's calibrated
    ``all_reduce`` fit of that tier where ``adaptdist cluster profile`` measured one, else, for two ranks of one
    host, :data:`LOCAL_GLOO_P2P_ALPHA_S` and :data:`LOCAL_GLOO_P2P_BETA_S_PER_BYTE`, else the link's ``latency_s``
    and ``bandwidth_bytes_per_s``)."""
    c = link_cost(cluster, "all_reduce", [a, b])
    if not c.calibrated and c.tier == "intra_host":
        return LOCAL_GLOO_P2P_ALPHA_S + n_bytes * LOCAL_GLOO_P2P_BETA_S_PER_BYTE
    return float(c.alpha_s) + n_bytes * float(c.beta_s_per_byte)


def _dense_s(shape: RecsysShape, device, rows: float) -> float:
    return (roofline_time_s(3 * shape.dense_flops_per_row * rows, 3 * shape.dense_bytes_per_row * rows,
                            peak_flops_per_s(device, "float32"), float(device.memory_bandwidth_bytes_per_s),
                            overlap=overlaps_compute_and_memory(device))
            + shape.dense_ops * _op_s(device))


def _lookup_bytes(shape: RecsysShape, rows: float, share: Sequence[float] | None = None) -> float:
    """Bytes of the lookups and updates of ``rows`` batch rows (``share[t]``: the part of table t's ids held)."""
    share = share if share is not None else [1.0] * len(shape.table_rows)
    return sum(3 * shape.dim * BYTES * rows * n * s for n, s in zip(shape.ids_per_row, share))


def _optimizer_s(shape: RecsysShape, device, params: int, tensors: int) -> float:
    return (params * OPTIMIZER_BYTES_PER_PARAM.get(shape.optimizer, 28) / float(device.memory_bandwidth_bytes_per_s)
            + tensors * OPTIMIZER_OPS_PER_TENSOR.get(shape.optimizer, 10) * _op_s(device))


def all_reduce_s(cluster: ClusterLike, members: Sequence[int], n_bytes: float, shm: bool = False) -> float:
    """Ring all_reduce of ``n_bytes`` over ``members`` (:func:`~adaptdist.cost_models.communication.link_cost`;
    ``shm``: through adaptdist's shared-memory kernels where the members share a host, as the compiled
    synchronous programs run it)."""
    if len(members) < 2:
        return 0.0
    c = link_cost(cluster, "all_reduce", members, shm=shm)
    return float(collective_time_s("all_reduce", n_bytes, len(members), c.alpha_s, c.beta_s_per_byte))


def shm_kernels_loaded() -> bool:
    """Whether adaptdist's shared-memory collectives can run here (``adaptdist.kernels``): then the compiled
    synchronous programs carry a one-host all_reduce through them (``--comm auto``), not through gloo."""
    try:
        from ..kernels import available
    except ImportError:
        return False
    return bool(available())


def gathered_tables(shape: RecsysShape, world: int) -> tuple[bool, ...]:
    """Per table, whether the compiled synchronous programs on ``world`` ranks build its gradient from the batch's
    gathered rows (``passes/gather_embedding_rows.py``'s rule, on the global batch: the table's gradient at least
    ``MIN_TABLE_BYTES`` and no smaller than the rows + indices gathered) rather than all-reducing it whole."""
    from ..passes.gather_embedding_rows import worth_gathering_bytes

    out = []
    for rows, n in zip(shape.table_rows, shape.ids_per_row):
        table = rows * shape.dim * BYTES
        gathered = shape.batch_size * n * (shape.dim * BYTES + INDEX_BYTES)
        out.append(world > 1 and worth_gathering_bytes(gathered, table))
    return tuple(out)


def sync_comm_s(shape: RecsysShape, cluster: ClusterLike, ranks: Sequence[int], shm: bool) -> float:
    """The collectives of one synchronous step over ``ranks``, as the compiled programs issue them: the loss's
    all_reduce (a scalar), one bucketed all_reduce of the dense parameters' and the all-reduced tables'
    gradients, and one all_gather of the gradient rows ``float32[B, ids, dim]`` and the indices (as float32
    values, ``passes/bucket_gathered_rows.py``; a table of more than 2**24 rows: its ``int64`` indices in a
    second all_gather) of every table of :func:`gathered_tables`."""
    if len(ranks) < 2:
        return 0.0
    from ..passes.bucket_gathered_rows import FLOAT32_EXACT_IDS

    gathered = gathered_tables(shape, len(ranks))
    bucket = shape.dense_params + sum(r * shape.dim for r, g in zip(shape.table_rows, gathered) if not g)
    comm = all_reduce_s(cluster, ranks, BYTES, shm=shm) + all_reduce_s(cluster, ranks, bucket * BYTES, shm=shm)
    c = link_cost(cluster, "all_gather", ranks, shm=shm)
    floats = ints = 0.0  # the merged gather's bytes; ids of a table too big for float32 values travel apart
    for rows, n, g in zip(shape.table_rows, shape.ids_per_row, gathered):
        if g:
            floats += shape.batch_size * n * shape.dim * BYTES
            if rows <= FLOAT32_EXACT_IDS:
                floats += shape.batch_size * n * BYTES
            else:
                ints += shape.batch_size * n * INDEX_BYTES
    for n_bytes in (floats, ints):
        if n_bytes:
            comm += float(collective_time_s("all_gather", n_bytes, len(ranks), c.alpha_s, c.beta_s_per_byte))
    return comm


def sync_cost(shape: RecsysShape, cluster: ClusterLike, ranks: Sequence[int] | None = None,
              shm: bool | None = None) -> ModeCost:
    """Synchronous data parallelism over ``ranks`` (default all): each rank the whole step on its
    :func:`torch.chunk` share of the batch, the collectives of :func:`sync_comm_s`, and the optimizer over every
    parameter (the tables' gradients are dense: zeroed and accumulated whole each step, as in eager). ``shm``: the
    collectives run on the shared-memory kernels where the ranks share a host (None: where
    :func:`shm_kernels_loaded`, as ``--comm auto`` lowers them). On one rank: no collective, and the step of
    ``adaptdist train`` on one rank (eager's work)."""
    ranks = list(ranks if ranks is not None else range(cluster.world_size))
    rows = -(-shape.batch_size // len(ranks))
    shm = shm_kernels_loaded() if shm is None else shm
    comm = sync_comm_s(shape, cluster, ranks, shm)
    gathered = gathered_tables(shape, len(ranks))
    bucket = shape.dense_params + sum(r * shape.dim for r, g in zip(shape.table_rows, gathered) if not g)
    own = []
    for r in ranks:
        d = cluster.device(r)
        bw = float(d.memory_bandwidth_bytes_per_s)
        lookups = (_lookup_bytes(shape, rows) / bw + len(shape.table_rows) * SPARSE_OPS_PER_SHARD * _op_s(d))
        # the dense embedding gradient: zeroed and accumulated over whole tables each step
        table_grad = 2 * shape.table_params * BYTES / bw
        if len(ranks) > 1:
            # the bucket's gradients copied in (cat) and out of the all_reduce; per gathered table, pad + gather +
            # slice of rows and indices, and the other ranks' rows accumulated too
            table_grad += 2 * bucket * BYTES / bw + sum(
                GATHER_OPS * _op_s(d) + (shape.batch_size - rows) * n * 2 * shape.dim * BYTES / bw
                for n, g in zip(shape.ids_per_row, gathered) if g) + (GATHER_SHARED_OPS * _op_s(d) if any(gathered)
                                                                       else 0.0)
        own.append(lookups + table_grad + _dense_s(shape, d, rows)
                   + _optimizer_s(shape, d, shape.dense_params + shape.table_params,
                                  shape.dense_tensors + len(shape.table_rows)))
    return ModeCost("sync", max(own) + comm, tuple(own), (comm,) * len(ranks), shape.batch_size)


def async_cost(shape: RecsysShape, cluster: ClusterLike, roles: Sequence[str],
               shard_rows: Sequence[Sequence[tuple[int, int]]], max_staleness: int) -> ModeCost:
    """The asynchronous heterogeneous pipeline: ``roles[r]`` ``"sparse"``/``"dense"``, ``shard_rows[r]`` the
    ``(table, rows held)`` of sparse rank ``r`` (ids assumed spread evenly over a table's rows).

    Returns per-rank seconds in rank order; ``step_s`` as the module docstring says.
    """
    sparse = [r for r, x in enumerate(roles) if x == "sparse"]
    dense = [r for r, x in enumerate(roles) if x == "dense"]
    rows_d = -(-shape.batch_size // len(dense))
    msg_bytes = rows_d * len(shape.table_rows) * shape.dim * BYTES
    own, comm = [0.0] * len(roles), [0.0] * len(roles)
    for r in sparse:
        d = cluster.device(r)
        share = [0.0] * len(shape.table_rows)
        for t, n in shard_rows[r]:
            share[t] += n / shape.table_rows[t]
        held = sum(n for _, n in shard_rows[r]) * shape.dim
        own[r] = (_lookup_bytes(shape, shape.batch_size, share) / float(d.memory_bandwidth_bytes_per_s)
                  + len(shard_rows[r]) * (SPARSE_OPS_PER_SHARD + SPARSE_APPLY_OPS_PER_SHARD) * _op_s(d)
                  # AdamW's state is dense: the shard's gradient is materialized (zeroed, accumulated) and stepped
                  + ((2 * held * BYTES / float(d.memory_bandwidth_bytes_per_s)
                      + _optimizer_s(shape, d, held, len(shard_rows[r])))
                     if shape.optimizer != "sgd" else 0.0))
        comm[r] = sum(2 * _p2p_s(cluster, r, x, msg_bytes) for x in dense)
    reduce_s = all_reduce_s(cluster, dense, (shape.dense_params + 1) * BYTES)
    chain = {}  # a dense rank's part of a K=0 step's critical path: its forward + backward and the messages
    for r in dense:
        d = cluster.device(r)
        fb = _dense_s(shape, d, rows_d)
        p2p = sum(2 * _p2p_s(cluster, r, x, msg_bytes) for x in sparse)
        own[r] = fb + _optimizer_s(shape, d, shape.dense_params, shape.dense_tensors)
        comm[r] = p2p + reduce_s
        chain[r] = fb + p2p
    if max_staleness >= 1:
        step = max(o + c for o, c in zip(own, comm))
    else:
        # the dense ranks send the gradients before their all_reduce and optimizer step (runtime/async_hetero.py's
        # dense loop), which overlap the sparse ranks' update and next lookups
        step = max(max(own[r] for r in sparse) + max(chain.values()), max(own[r] + comm[r] for r in dense))
    return ModeCost("async-hetero", step, tuple(own), tuple(comm), shape.batch_size)


def program_sync_cost(shape: RecsysShape, cluster: ClusterLike, programs: dict) -> ModeCost:
    """The synchronous step of an already lowered plan (``programs``: :func:`~adaptdist.compiler.lowering.
    compile_model`'s rank programs, whatever plan the planner chose: data parallel, a replicated batch, a mesh with
    tp), priced with this module's terms, so that ``--mode auto`` weighs the programs ``--mode sync`` will run against
    :func:`async_cost`, not a data-parallel stand-in (:func:`sync_cost`).

    Per rank ``r``: the lookups, the dense forward + backward and the per-op overheads of :func:`sync_cost` on the
    batch rows the rank looks up (its ``aten.embedding`` lookups' rows: its ``batch_slice`` under dp, all of them
    when the plan replicates the batch and the work, a share when a model-parallel axis splits the rows), the dense
    table gradients and the optimizer over every parameter (the tables' gradients stay dense, as in eager), the
    bucket's copies in and out (``2 x 4`` bytes per all-reduced element) and, per all_gather the program issues, the
    gathered elements the rank did not hold accumulated (``2 x 4`` bytes each) and :data:`GATHER_SHARED_OPS` ops, and
    :data:`GATHER_OPS` per table gradient built from gathered rows (an ``embedding_dense_backward`` whose indices come
    from a gather); the
    collectives are the ones in the program's graph, each priced as :func:`sync_comm_s` prices its own
    (:func:`~adaptdist.cost_models.communication.link_cost` over the group's ranks, shared memory where the program
    issues adaptdist's shared-memory ops or where :func:`shm_kernels_loaded`, as ``--comm auto`` lowers them). The
    step is the slowest rank's work plus rank 0's collectives.

    The dense part is priced on the same rows as the lookups (a plan that splits the lookups' rows but runs the MLP
    whole, or the reverse, is priced as if both were split alike).
    """
    import torch

    from .. import _torch_compat as compat
    from ..mesh import Mesh, base_group_name
    from .communication import functional_collective_kind

    ranks = sorted(programs)
    p0 = programs[ranks[0]]
    mesh = Mesh(tuple(p0.mesh.items()))
    shm_default = shm_kernels_loaded()
    comm = 0.0
    reduced = gathered_extra = gathers = 0
    for n in p0.graph_module.graph.nodes:
        if n.op != "call_function":
            continue
        kind = functional_collective_kind(n.target)
        if kind in (None, "wait"):
            continue
        args = n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]
        vals = [a.meta["val"] for a in args if isinstance(a, torch.fx.Node)]
        n_bytes = sum(v.numel() * v.element_size() for v in vals)
        axis = base_group_name(str(n.args[-1])).removeprefix("adaptdist:")
        members = mesh.group(axis, ranks[0]) if axis in mesh.names else tuple(ranks)
        p = len(members)
        shm = shm_default or not compat.is_functional_collective(n.target)
        c = link_cost(cluster, kind, members, shm=shm)
        if kind == "all_gather":
            comm += float(collective_time_s(kind, n_bytes * p, p, c.alpha_s, c.beta_s_per_byte))
            gathered_extra += sum(v.numel() for v in vals) * (p - 1)
            gathers += 1
        else:
            comm += float(collective_time_s(kind, n_bytes, p, c.alpha_s, c.beta_s_per_byte))
            if kind == "all_reduce":
                reduced += sum(v.numel() for v in vals)
    tables = _gathered_table_gradients(p0.graph_module.graph) if gathers else 0
    gather_ops = tables * GATHER_OPS + gathers * GATHER_SHARED_OPS
    own = []
    for r in ranks:
        d = cluster.device(r)
        bw = float(d.memory_bandwidth_bytes_per_s)
        rows = _rows_looked_up(programs[r].graph_module.graph, programs[r].batch_slice[1])
        lookups = _lookup_bytes(shape, rows) / bw + len(shape.table_rows) * SPARSE_OPS_PER_SHARD * _op_s(d)
        table_grad = (2 * shape.table_params * BYTES / bw + 2 * reduced * BYTES / bw
                      + gather_ops * _op_s(d) + gathered_extra * 2 * BYTES / bw)
        own.append(lookups + table_grad + _dense_s(shape, d, rows)
                   + _optimizer_s(shape, d, shape.dense_params + shape.table_params,
                                  shape.dense_tensors + len(shape.table_rows)))
    return ModeCost("sync", max(own) + comm, tuple(own), (comm,) * len(ranks), shape.batch_size)


def _gathered_table_gradients(graph) -> int:
    """How many ``embedding_dense_backward`` nodes of ``graph`` take their indices from an all_gather (a table
    gradient built from the batch's gathered rows and ids: ``passes/gather_embedding_rows.py``)."""
    import torch

    from .communication import functional_collective_kind

    count = 0
    for n in graph.find_nodes(op="call_function", target=torch.ops.aten.embedding_dense_backward.default):
        seen, todo = set(), [n.args[1]] if isinstance(n.args[1], torch.fx.Node) else []
        while todo:
            m = todo.pop()
            if m in seen or len(seen) > 64:
                continue
            seen.add(m)
            if m.op == "call_function" and functional_collective_kind(m.target) == "all_gather":
                count += 1
                break
            todo.extend(m.all_input_nodes)
    return count


def _rows_looked_up(graph, default: int) -> int:
    """The batch rows a rank program looks up: the largest leading dim of the ids of its forward ``aten.embedding``
    lookups (``[rows, bag]`` after ``passes/embedding_bag.py``; ``[rows]`` for a plain embedding), else ``default``."""
    import torch

    rows = [n.args[1].meta["val"].shape[0] for n in graph.find_nodes(op="call_function",
                                                                    target=torch.ops.aten.embedding.default)
            if isinstance(n.args[1], torch.fx.Node) and n.args[1].meta["val"].dim() >= 1]
    return max(rows) if rows else default
