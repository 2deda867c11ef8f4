"""What gloo's point-to-point ops do on this machine (2 ranks), the facts the pipeline executor's design rests on:

1. ``rendezvous``: does a send complete before the peer posts its receive? Rank 1 posts its receive ``--delay-ms``
   late; printed: when rank 0's ``isend`` returned and when its ``wait`` did, per message size.
2. ``progress``: does a posted ``isend`` move while its sender computes without calling ``wait``? Rank 0 posts,
   then computes for ``--compute-ms``; rank 1 posts its receive 10 ms after the start: printed, when rank 1's
   receive completed (well before ``--compute-ms``: gloo's own thread moves it).
3. ``polling``: does a rank blocked in a wait burn CPU? Rank 1 waits ``--delay-ms`` for a message; printed, the
   CPU time of its whole process (every thread) over the wait, for 1 and 2 torch threads.

Outside CI::

    PYTHONPATH=. .venv/bin/python benchmarks/probe_gloo_p2p.py [--delay-ms 50] [--compute-ms 100]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

SIZES_BYTES = (64, 4096, 512 * 1024, 2 * 1024 * 1024)


def worker(delay_s: float, compute_s: float) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    r = dist.get_rank()
    out: dict = {"rendezvous": {}, "progress": {}, "polling": {}}
    try:
        for n in SIZES_BYTES:
            buf = torch.zeros(n // 4)
            dist.barrier()
            if r == 0:
                t0 = time.perf_counter()
                work = dist.isend(buf, 1)
                t1 = time.perf_counter()
                work.wait()
                out["rendezvous"][n] = (t1 - t0, time.perf_counter() - t0)
            else:
                time.sleep(delay_s)
                dist.recv(buf, 0)
        a = torch.randn(256, 256)
        for n in SIZES_BYTES:
            buf = torch.ones(n // 4)
            dist.barrier()
            t0 = time.perf_counter()
            if r == 0:
                work = dist.isend(buf, 1)
                while time.perf_counter() - t0 < compute_s:
                    a @ a
                work.wait()
            else:
                time.sleep(0.01)
                dist.irecv(buf, 0).wait()
                out["progress"][n] = time.perf_counter() - t0
        for threads in (1, 2):
            torch.set_num_threads(threads)
            buf = torch.zeros(128 * 1024)
            dist.barrier()
            if r == 1:
                c0, t0 = time.process_time(), time.perf_counter()
                dist.recv(buf, 0)
                out["polling"][threads] = (time.perf_counter() - t0, time.process_time() - c0,
                                           len(os.listdir("/proc/self/task")))
            else:
                time.sleep(delay_s)
                dist.send(buf, 1)
        return out
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay-ms", type=float, default=50.0)
    ap.add_argument("--compute-ms", type=float, default=100.0)
    args = ap.parse_args()
    from adaptdist.runtime.launch import launch_local

    load = os.getloadavg()[0]
    res = launch_local(worker, (args.delay_ms / 1e3, args.compute_ms / 1e3), 2)
    print(f"gloo point-to-point, 2 ranks, load average {load:.1f} on {os.cpu_count()} cores")
    print(f"1. rendezvous (rank 1 posts its receive {args.delay_ms:g} ms late):")
    for n, (post_s, done_s) in res[0]["rendezvous"].items():
        print(f"   {n:>8} bytes: isend returned after {1e3 * post_s:.2f} ms, its wait after {1e3 * done_s:.2f} ms")
    print(f"2. progress (rank 0 computes {args.compute_ms:g} ms after isend, before its wait; rank 1 receives at 10 ms):")
    for n, s in res[1]["progress"].items():
        print(f"   {n:>8} bytes: rank 1's receive completed after {1e3 * s:.1f} ms")
    print("3. polling (rank 1 blocked in a receive):")
    for threads, (wall_s, cpu_s, tasks) in res[1]["polling"].items():
        print(f"   torch threads {threads}: blocked {1e3 * wall_s:.0f} ms, process CPU {1e3 * cpu_s:.2f} ms "
              f"({tasks} threads in the process)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
