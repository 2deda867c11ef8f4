"""Where a builtin:dlrm step's time goes in each execution mode (issue 17): every part of a step timed alone in
one process pinned to one core, 1 thread, beside the cost model's figure for the same part
(:mod:`adaptdist.cost_models.recsys` on ``adaptdist cluster detect``'s 2-rank cluster of this machine).

    PYTHONPATH=. .venv/bin/python benchmarks/profile_recsys_step.py [--data DIR] [--reps 60] [--optimizer adamw,sgd]

Parts (batch 256; sync ranks take 128 rows each):

- ``sync: fwd+bwd (128 rows)``: eager whole-model forward + backward (the dense table gradients included);
- ``sync: optimizer (all params)``: ``torch.optim`` step over every parameter (tables included);
- ``async sparse: lookup`` / ``apply``: :class:`~adaptdist.runtime.async_hetero.SparseWorker` of the whole tables;
- ``async dense: fwd+bwd (256 rows)`` / ``optimizer``: :class:`~adaptdist.runtime.async_hetero.DenseWorker`.

- ``data: one global batch``: ``next()`` of builtin:dlrm's ``data()`` (every rank of both modes draws each batch);
- ``gloo p2p: ...``: two processes pinned to cores 0 and 1: one exchange of the queues' message
  (``float32[256, 3, 32]``, isend + irecv each way, as one async step sends lookups and gets their gradients back).
  Sync's one all_reduce (shared memory) is not timed here: benchmarks/bench_comm.py has it.

Each figure is the minimum and the median over ``--reps`` repetitions (the minimum: the part's own cost on a shared
machine, the median: what a run sees at the load of the moment).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn, reps: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts)


def _pair(rank: int, port: int, reps: int, numel_msg: int, q, sizes: tuple[int, ...] = ()) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    msg, back = torch.ones(numel_msg), torch.empty(numel_msg)

    def exchange():  # rank 0 sends lookups, rank 1 answers with their gradients
        if rank == 0:
            w = [dist.isend(msg, 1, tag=1), dist.irecv(back, 1, tag=2)]
        else:
            w = [dist.irecv(back, 0, tag=1)]
            w[0].wait()
            w = [dist.isend(msg, 0, tag=2)]
        for x in w:
            x.wait()

    out = {"p2p": timed(exchange, reps)}
    for n_bytes in sizes:  # blocking round trips of n_bytes each way: the fit behind recsys.LOCAL_GLOO_P2P_*
        a, b = torch.ones(max(1, n_bytes // 4)), torch.empty(max(1, n_bytes // 4))

        def round_trip(a=a, b=b):
            if rank == 0:
                dist.send(a, 1)
                dist.recv(b, 1)
            else:
                dist.recv(b, 0)
                dist.send(a, 0)

        out[n_bytes] = timed(round_trip, reps)
    dist.barrier()
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def two_process(reps: int, numel_msg: int, sizes: tuple[int, ...] = ()) -> dict:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_pair, args=(r, port, reps, numel_msg, q, sizes)) for r in range(2)]
    for p in procs:
        p.start()
    out = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=None)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--optimizer", default="adamw,sgd")
    ap.add_argument("--p2p-sizes", default="4,98304,393216",
                    help="bytes each way of the blocking gloo round trips timed beside the queue message (the figures "
                         "behind adaptdist/cost_models/recsys.py's LOCAL_GLOO_P2P_*: alpha = half the smallest, beta "
                         "from the slope)")
    args = ap.parse_args()
    from adaptdist.calibrate.local import local_cluster
    from adaptdist.compiler.planner.modes import recsys_shape
    from adaptdist.cost_models import recsys as rc
    from adaptdist.hetero_layout import make_layout
    from adaptdist.models import dlrm
    from adaptdist.runtime.async_hetero import DenseWorker, SparseWorker, split_batch
    from adaptdist.runtime.worker import make_optimizer

    cluster = local_cluster(2)  # before pinning: the figures of a 2-rank job on the whole machine
    dev = cluster.device(0)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with contextlib.redirect_stderr(io.StringIO()):
        model, example, loss_fn = dlrm.factory(args.batch_size, 1, data_path=args.data)
    batch = next(dlrm.data(args.batch_size, 1, path=args.data, seed=0))
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load average {load}, torch {torch.__version__}; "
          f"min / median of {args.reps} reps, ms; model: the cost model's figure (this machine, detect's figures: "
          f"{dev.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s, op overhead {rc._op_s(dev) * 1e6:.1f} us)")
    print("| optimizer | part | measured min | measured median | model |")
    print("|---|---|---:|---:|---:|")
    half = [t[: args.batch_size // 2] for t in batch]
    layout = make_layout(2, (1,), tuple(t.weight.shape[0] for t in model.sparse_arch.tables), 1, None)
    for opt_name in args.optimizer.split(","):
        shape = rc.RecsysShape(**{**recsys_shape(model, example, opt_name).__dict__})
        params = list(model.parameters())
        opt = make_optimizer(opt_name, params, 1e-3)

        def sync_fb():
            for p in params:
                p.grad = None
            loss_fn(model(*half[:-1]), half[-1]).backward()

        sync_fb()
        rows = args.batch_size // 2
        m_fb = (rc._dense_s(shape, dev, rows) + rc._lookup_bytes(shape, rows) / dev.memory_bandwidth_bytes_per_s
                + len(shape.table_rows) * rc.SPARSE_OPS_PER_SHARD * rc._op_s(dev)
                + 2 * shape.table_params * rc.BYTES / dev.memory_bandwidth_bytes_per_s)
        m_opt = rc._optimizer_s(shape, dev, shape.dense_params + shape.table_params,
                                shape.dense_tensors + len(shape.table_rows))
        sparse = SparseWorker(model, layout.shards_of(0), opt_name, 1e-3)
        dense = DenseWorker(model, loss_fn, opt_name, 1e-3)
        dense_in, ids, target = split_batch(model, batch)
        parts, ctx = sparse.lookup(ids, [slice(0, args.batch_size)])
        emb = parts[0]
        _, g = dense.forward_backward(emb, dense_in, target, 1.0)
        share = [1.0] * len(shape.table_rows)
        m_lookup = (rc._lookup_bytes(shape, args.batch_size, share) / dev.memory_bandwidth_bytes_per_s
                    + len(shape.table_rows) * rc.SPARSE_OPS_PER_SHARD * rc._op_s(dev))
        m_apply = len(shape.table_rows) * rc.SPARSE_APPLY_OPS_PER_SHARD * rc._op_s(dev) + (
            2 * shape.table_params * rc.BYTES / dev.memory_bandwidth_bytes_per_s
            + rc._optimizer_s(shape, dev, shape.table_params, len(shape.table_rows)) if opt_name != "sgd" else 0.0)

        def dense_fb():
            dense.zero_grad()
            dense.forward_backward(emb, dense_in, target, 1.0)

        rows_out = [
            ("sync: fwd+bwd (128 rows, whole model)", timed(sync_fb, args.reps), m_fb),
            ("sync: optimizer step (all params)", timed(opt.step, args.reps), m_opt),
            ("async sparse: lookup (256 rows)", timed(lambda: sparse.lookup(ids, [slice(0, args.batch_size)]),
                                                      args.reps), m_lookup),
            ("async sparse: apply (update of the tables)", timed(lambda: sparse.apply(ctx, [g]), args.reps), m_apply),
            ("async dense: fwd+bwd (256 rows)", timed(dense_fb, args.reps), rc._dense_s(shape, dev, args.batch_size)),
            ("async dense: optimizer step", timed(dense.step, args.reps),
             rc._optimizer_s(shape, dev, shape.dense_params, shape.dense_tensors)),
        ]
        for name, (lo, med), m in rows_out:
            print(f"| {opt_name} | {name} | {lo * 1e3:.3f} | {med * 1e3:.3f} | {m * 1e3:.3f} |", flush=True)
    it = dlrm.data(args.batch_size, 1, path=args.data, seed=0)
    lo, med = timed(lambda: next(it), args.reps)
    print(f"| both | data: one global batch (every rank, both modes; not modelled: the same in both) | "
          f"{lo * 1e3:.3f} | {med * 1e3:.3f} | - |")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    numel_msg = args.batch_size * len(model.sparse_arch.tables) * model.sparse_arch.tables[0].embedding_dim
    sizes = tuple(int(x) for x in args.p2p_sizes.split(",") if x.strip())
    pair = two_process(args.reps, numel_msg, sizes)
    lo, med = pair["p2p"]
    model_p2p = 2 * rc._p2p_s(cluster, 0, 1, numel_msg * 4)
    print(f"| both | gloo p2p: lookups there, gradients back ({numel_msg * 4 / 1e3:.0f} kB each way) | "
          f"{lo * 1e3:.3f} | {med * 1e3:.3f} | {model_p2p * 1e3:.3f} |")
    for n_bytes in sizes:
        lo, med = pair[n_bytes]
        print(f"| both | gloo blocking round trip, {n_bytes:,} B each way | {lo * 1e3:.3f} | {med * 1e3:.3f} | "
              f"{2 * rc._p2p_s(cluster, 0, 1, n_bytes) * 1e3:.3f} |")


if __name__ == "__main__":
    main()
