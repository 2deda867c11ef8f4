"""A gradient bucket's flatten + all_reduce on shared memory: ``torch.cat`` + ``shm_all_reduce_start`` (what the dp
lowering emitted before it used the fused op) vs the fused ``shm_flatten_all_reduce_start`` (the gradients copied
straight into the rank's registered input region, then the all_reduce reads them in place: no copy-in), each waited with ``shm_wait``.
Issue 16 point 2's "fused gradient-bucket flatten, kept only if it beats torch's own".

    .venv/bin/python benchmarks/bench_bucket_flatten.py [--ranks 2 4] [--rounds 3] [--min-time-s 0.4]

Buckets (float32): 16 MiB in 8 tensors, 1 MiB in 64 tensors, 16 MiB in one tensor (no cat: its own all_reduce). Per call: the slowest rank's mean over a timed loop;
the two forms alternate per round. Prints the load average before and after (this machine is shared).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

# "16MiB/1": one tensor, no cat: its plain all_reduce (the copy-in of the peers' slices) vs copying all of it into
# the region first (the lowering fuses only cat buckets since this measured the plain form faster)
BUCKETS = {"16MiB/8": (16 << 20, 8), "1MiB/64": (1 << 20, 64), "16MiB/1": (16 << 20, 1)}


def worker(rank: int, world: int, rounds: int, min_time_s: float) -> list[dict]:
    from bench_comm import _time  # the slowest rank's mean per call, as bench_comm times its collectives

    from adaptdist.kernels import shm

    group = shm.init_group(dist.group.WORLD, name="bucket", timeout_s=300)
    ops = torch.ops.adaptdist
    rows = []
    for label, (size_bytes, k) in BUCKETS.items():
        per = size_bytes // 4 // k
        grads = [torch.randn(per // 16, 16) for _ in range(k)]
        want = ops.shm_wait(ops.shm_all_reduce_start(torch.cat([g.reshape(-1) for g in grads]), "sum", group.name))
        got = ops.shm_wait(ops.shm_flatten_all_reduce_start(grads, 0, "sum", group.name))
        assert torch.equal(got, want), "fused result differs from cat + all_reduce"
        del want, got

        def cat_form():
            flat = grads[0].reshape(-1) if k == 1 else torch.cat([g.reshape(-1) for g in grads])
            ops.shm_wait(ops.shm_all_reduce_start(flat, "sum", group.name))

        def fused_form():
            ops.shm_wait(ops.shm_flatten_all_reduce_start(grads, 0, "sum", group.name))

        for rnd in range(rounds):
            rows.append({"bucket": label, "round": rnd, "ranks": world, "cat_s": _time(cat_form, min_time_s, world),
                         "fused_s": _time(fused_form, min_time_s, world)})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time-s", type=float, default=0.4)
    args = ap.parse_args(argv)
    import shm_workers

    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}  (nproc {os.cpu_count()})")
    print(f"{'bucket':<9}{'n':>2}{'round':>6} | {'cat+start us':>13}{'fused us':>10} | {'fused/cat':>9}")
    for n in args.ranks:
        res = shm_workers.run_ranks(worker, n, (args.rounds, args.min_time_s), timeout_s=900)
        if 0 not in res or isinstance(res[0], dict):
            raise SystemExit(f"{n} ranks failed: {res}")
        for r in res[0]:
            print(f"{r['bucket']:<9}{r['ranks']:>2}{r['round']:>6} | {r['cat_s'] * 1e6:>13.1f}{r['fused_s'] * 1e6:>10.1f}"
                  f" | {r['fused_s'] / r['cat_s']:>9.2f}")
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
