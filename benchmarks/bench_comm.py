"""Shared-memory collectives (torch.ops.adaptdist.shm_*) vs gloo, with single-core memcpy beside them.

For each world size (2 and 4 ranks by default), collective (all_reduce, all_gather, reduce_scatter,
all_to_all, broadcast) and size (4 KiB, 1 MiB, 16 MiB, 64 MiB, float32), both transports run in the same
processes, alternating per size; per call the time is the slowest rank's mean over a timed loop (after
warm-up). Reported: latency (us), algorithm bandwidth and bus bandwidth, with nccl-tests' conventions
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): the size S is the whole buffer
(all_gather: the output; reduce_scatter: the input), algbw = S / t, busbw = algbw x factor with factor
2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for broadcast. Beside
them: one core's `torch.Tensor.copy_` of the same S (bandwidth = S / t), the physical limit of moving S
bytes once; and ``x n``: the same copy made by all n ranks at once (each rank's bandwidth, the slowest's: what a
core gets while the others move data too, as they do inside a collective). Ratios: shm busbw / gloo busbw, shm
busbw / memcpy bandwidth, and shm busbw / the ``x n`` bandwidth.

The row ``all_reduce[reg]`` (with ``all_reduce`` in --ops) is the shm all_reduce whose input already lies in the
rank's registered input region (``shm.input_buffer``, as NCCL's user-buffer registration: no copy-in); its gloo
column is the same gloo all_reduce as the plain row's. The plain ``all_reduce`` row copies its input in.

    .venv/bin/python benchmarks/bench_comm.py [--ranks 2 4] [--sizes 4K 1M 16M 64M] [--min-time-s 0.3]
        [--ops all_reduce ...] [--slot-bytes N] [--spin-us US] [--json out.json]

Prints the load average before and after: this machine is shared, and 4 ranks on 2 cores are
oversubscribed by construction.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
REGISTERED = "all_reduce[reg]"  # the all_reduce of an input in the registered region (no copy-in)
SIZES = {"4K": 4 << 10, "1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor (doc/PERFORMANCE.md)."""
    if op in ("all_reduce", REGISTERED):
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


def _calls(op: str, n: int, size_bytes: int, group, rank: int):
    """(shm call, gloo call) for one collective on float32 buffers of nccl-tests size S."""
    elems = max(n, size_bytes // 4 // n * n)
    if op == "all_gather":
        x = torch.randn(elems // n)
        out = torch.empty(elems)
        return (lambda: group.all_gather(x)), (lambda: dist.all_gather_into_tensor(out, x))
    if op == "reduce_scatter":
        x = torch.randn(elems)
        out = torch.empty(elems // n)
        return (lambda: group.reduce_scatter(x)), (lambda: dist.reduce_scatter_tensor(out, x))
    x = torch.randn(elems)
    if op == REGISTERED:
        buf = group.input_buffer(elems)
        buf.copy_(x)
        return (lambda: group.all_reduce(buf)), (lambda: dist.all_reduce(x))
    if op == "all_reduce":
        return (lambda: group.all_reduce(x)), (lambda: dist.all_reduce(x))
    if op == "all_to_all":
        out = torch.empty(elems)
        return (lambda: group.all_to_all(x)), (lambda: dist.all_to_all_single(out, x))
    return (lambda: group.broadcast(x, 0)), (lambda: dist.broadcast(x, 0))


def _time(fn, min_time_s: float, world: int) -> float:
    """Mean seconds per call, the slowest rank's; the iteration count is agreed on from rank 0's estimate."""
    for _ in range(2):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    est = torch.tensor([time.perf_counter() - t0])
    dist.broadcast(est, 0)
    iters = int(max(3, min(2000, min_time_s / max(float(est), 1e-7))))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t = torch.tensor([(time.perf_counter() - t0) / iters])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def bench_worker(rank: int, world: int, ops: list[str], sizes: list[str], min_time_s: float,
                 slot_bytes: int, spin_us: float | None = None) -> list[dict]:
    import warnings

    from adaptdist.kernels import shm

    warnings.filterwarnings("ignore", category=FutureWarning)
    group = shm.init_group(dist.group.WORLD, name="bench", timeout_s=300, slot_bytes=slot_bytes,
                           spin_us=spin_us)
    rows = []
    ops = [o for op in ops for o in ((op, REGISTERED) if op == "all_reduce" else (op,))]
    # every rank copying S at the same time (the slowest rank's mean): what the memory system gives a core while
    # the others move data too, as they do in a collective
    together_s = {}
    for size in sizes:
        src, dst = torch.randn(SIZES[size] // 4), torch.empty(SIZES[size] // 4)
        together_s[size] = _time(lambda: dst.copy_(src), min_time_s, world)
        del src, dst
    for op in ops:
        for size in sizes:
            s_bytes = SIZES[size]
            shm_call, gloo_call = _calls(op, world, s_bytes, group, rank)
            t_gloo = _time(gloo_call, min_time_s, world)
            t_shm = _time(shm_call, min_time_s, world)
            rows.append({"op": op, "ranks": world, "size": size, "size_bytes": s_bytes, "shm_s": t_shm,
                         "gloo_s": t_gloo, "factor": bus_factor(op, world), "memcpy_together_s": together_s[size]})
            del shm_call, gloo_call
    return rows


def memcpy_bandwidth(sizes: list[str], min_time_s: float) -> dict[str, float]:
    """One core's `dst.copy_(src)` bandwidth (bytes/s) per size."""
    torch.set_num_threads(1)
    out = {}
    for size in sizes:
        n = SIZES[size] // 4
        src, dst = torch.randn(n), torch.empty(n)
        for _ in range(3):
            dst.copy_(src)
        t0 = time.perf_counter()
        dst.copy_(src)
        iters = int(max(3, min(20000, min_time_s / max(time.perf_counter() - t0, 1e-7))))
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        out[size] = SIZES[size] / ((time.perf_counter() - t0) / iters)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    ap.add_argument("--min-time-s", type=float, default=0.3, help="timed loop length per measurement")
    ap.add_argument("--slot-bytes", type=int, default=None, help="shm slot size (default: init_group's)")
    ap.add_argument("--spin-us", type=float, default=None, help="shm spin before sleeping (default: init_group's)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    import shm_workers

    from adaptdist.kernels import shm

    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}  (nproc {os.cpu_count()})")
    memcpy = memcpy_bandwidth(args.sizes, args.min_time_s)
    rows = []
    for n in args.ranks:
        res = shm_workers.run_ranks(bench_worker, n, (args.ops, args.sizes, args.min_time_s, args.slot_bytes or shm.DEFAULT_SLOT_BYTES,
                                                       args.spin_us), timeout_s=1800,
                                    pg_timeout_s=600)
        if 0 not in res or isinstance(res[0], dict):
            raise SystemExit(f"{n} ranks failed: {res}")
        rows += res[0]
    load_after = os.getloadavg()
    print(f"{'op':<16}{'n':>2}{'size':>5} | {'shm us':>9}{'gloo us':>10} | {'shm busbw':>10}{'gloo busbw':>11}"
          f"{'memcpy':>8}{'x n':>7} GB/s | {'shm/gloo':>8}{'shm/memcpy':>11}{'/ x n':>7}")
    for r in rows:
        algbw_shm = r["size_bytes"] / r["shm_s"]
        algbw_gloo = r["size_bytes"] / r["gloo_s"]
        r["shm_busbw_bytes_per_s"] = algbw_shm * r["factor"]
        r["gloo_busbw_bytes_per_s"] = algbw_gloo * r["factor"]
        r["memcpy_bytes_per_s"] = memcpy[r["size"]]
        r["memcpy_together_bytes_per_s"] = together = r["size_bytes"] / r["memcpy_together_s"]
        print(f"{r['op']:<16}{r['ranks']:>2}{r['size']:>5} | {r['shm_s'] * 1e6:>9.1f}{r['gloo_s'] * 1e6:>10.1f} | "
              f"{r['shm_busbw_bytes_per_s'] / 1e9:>10.2f}{r['gloo_busbw_bytes_per_s'] / 1e9:>11.2f}"
              f"{memcpy[r['size']] / 1e9:>8.2f}{together / 1e9:>7.2f}      | "
              f"{r['shm_busbw_bytes_per_s'] / r['gloo_busbw_bytes_per_s']:>8.2f}"
              f"{r['shm_busbw_bytes_per_s'] / memcpy[r['size']]:>11.2f}{r['shm_busbw_bytes_per_s'] / together:>7.2f}")
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "memcpy_bytes_per_s": memcpy, "load_before": load_before,
                                         "load_after": load_after}, indent=1))


if __name__ == "__main__":
    main()
