"""Stress the shared-memory collectives: many iterations of random ops, sizes, dtypes and groups, checked.

Each iteration every rank draws the same (seeded) op, dtype, size (0 .. --max-mib of float32, log-uniform, odd sizes
included, some non-contiguous) and group (the world, or the two pairs {0,1},{2,3} at once); results are
checked against the documented float32 rank-order reference (exact; all_reduce also with its input in the
registered input region and as the fused bucket flatten) or, for the data-movement ops, against
the inputs (exact). Every 500 iterations each rank records its RSS; at the end /dev/shm must hold no
segment of the job, its private RSS (RssAnon) must not grow (beyond --rss-slack-mib between the first and last
quarter) and no iteration may hang (every rank runs under the collective timeout and the whole under --timeout-s).
The segment's pages a rank has touched (RssShmem) are reported beside it: they grow with the largest all_reduce
output seen so far (each rank writes into every rank's output region), bounded by the groups' segments.

    .venv/bin/python benchmarks/stress_shm.py [--iters 10000] [--ranks 4] [--max-mib 16] [--timeout-s 3000]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPS = ("all_reduce", "all_reduce_registered", "flatten_all_reduce", "all_gather", "reduce_scatter", "all_to_all",
       "broadcast")


def _rss_bytes() -> tuple[int, int]:
    """(private, shared-memory) resident bytes (RssAnon, RssShmem) after glibc returned its free memory
    (malloc_trim): live memory, not whatever freed blocks of the last, possibly 64 MiB-sized, iteration the
    allocator still holds."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("RssAnon", "RssShmem"):
            fields[key] = int(line.split()[1]) * 1024
    return fields.get("RssAnon", 0), fields.get("RssShmem", 0)


def stress_worker(rank: int, world: int, iters: int, max_mib: float, seed: int) -> dict:
    from adaptdist.kernels import shm

    import shm_workers as w

    g_world = shm.init_group(dist.group.WORLD, name="world", timeout_s=120)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else []
    g_pair = shm.init_group(pairs[rank // 2], name="pair", timeout_s=120, slot_bytes=1 << 20) if pairs else None
    rng = random.Random(seed)
    failures, rss, counts = [], [], {op: 0 for op in OPS}
    max_elems = int(max_mib * (1 << 20)) // 4
    t0 = time.monotonic()
    for it in range(iters):
        op = rng.choice(OPS)
        dtype = rng.choice(DTYPES)
        numel = 0 if rng.random() < 0.02 else int(math.exp(rng.uniform(0, math.log(max_elems))))
        kind = "nc" if rng.random() < 0.2 and numel >= 6 else "c"
        use_pair = g_pair is not None and rng.random() < 0.3
        grp = g_pair if use_pair else g_world
        n, me = grp.group_size, grp.group_rank
        xs = w._inputs(seed + it, n, numel, dtype, kind)
        x = xs[me]
        red = rng.choice(("sum", "avg", "max"))
        if op == "all_reduce":
            ok = torch.equal(grp.all_reduce(x, red), w._reference_reduce(xs, red))
        elif op in ("all_reduce_registered", "flatten_all_reduce"):
            # the input in the rank's registered region (same draws on every rank: the same offset), read in place
            # where every output is its shared region; a bucket flattened into it by the fused op
            offset = 64 * rng.randrange((32 << 20) // 64)
            flat = x.contiguous().reshape(-1)
            if op == "all_reduce_registered":
                buf = grp.input_buffer(flat.numel(), dtype, offset)
                buf.copy_(flat)
                out = grp.all_reduce(buf, red)
            else:
                pieces = list(flat.split(max(1, flat.numel() // 3 + 1))) or [flat]
                out = torch.ops.adaptdist.shm_wait(
                    torch.ops.adaptdist.shm_flatten_all_reduce_start(pieces, offset, red, grp.name))
            ok = torch.equal(out, w._reference_reduce(xs, red).reshape(-1))
        elif op == "all_gather":
            ok = torch.equal(grp.all_gather(x), torch.cat([t.contiguous().reshape(-1) for t in xs]).reshape(
                (n * x.shape[0],) + tuple(x.shape[1:])))
        elif op == "broadcast":
            src = rng.randrange(n)
            ok = torch.equal(grp.broadcast(x, src), xs[src].contiguous())
        else:
            xs2 = [torch.cat([t.reshape(-1)] * n).reshape(n, -1) for t in xs]
            if op == "reduce_scatter":
                red = "max" if red == "max" else "sum"
                ok = torch.equal(grp.reduce_scatter(xs2[me], red), w._reference_reduce([t[me:me + 1] for t in xs2], red))
            else:
                ok = torch.equal(grp.all_to_all(xs2[me]), torch.stack([t[me] for t in xs2]))
        counts[op] += 1
        if not ok:
            failures.append(f"iter {it}: {op} {red} {dtype} numel={numel} {kind} group={grp.name}")
        if it % 500 == 0 or it == iters - 1:
            rss.append((it, _rss_bytes()))
            if rank == 0:
                print(f"  iteration {it}: {time.monotonic() - t0:.0f} s, rank 0 RssAnon {rss[-1][1][0] / 2**20:.0f} MiB, "
                      f"RssShmem {rss[-1][1][1] / 2**20:.0f} MiB, "
                      f"{len(failures)} failures", flush=True)
    return {"failures": failures[:50], "n_failures": len(failures), "rss": rss, "counts": counts,
            "seconds": time.monotonic() - t0, "segments": w.segments(os.environ["MASTER_PORT"])}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10_000)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--max-mib", type=float, default=16.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=3000.0)
    ap.add_argument("--rss-slack-mib", type=float, default=64.0)
    args = ap.parse_args(argv)
    import shm_workers as w

    port = w.free_port()
    print(f"load average before: {os.getloadavg()}")
    t0 = time.monotonic()
    res = w.run_ranks(stress_worker, args.ranks, (args.iters, args.max_mib, args.seed), timeout_s=args.timeout_s,
                      pg_timeout_s=600, port=port)
    wall_s = time.monotonic() - t0
    ok = True
    for rank in range(args.ranks):
        out = res.get(rank)
        if out is None or "error" in out:
            print(f"rank {rank}: FAILED {out and out.get('error')}")
            ok = False
            continue
        rss = out["rss"]
        quarter = max(1, len(rss) // 4)
        first = max(b[0] for _, b in rss[:quarter])
        last = max(b[0] for _, b in rss[-quarter:])
        grow_mib = (last - first) / 2**20
        print(f"rank {rank}: {out['n_failures']} failures, ops {out['counts']}, {out['seconds']:.0f} s, "
              f"RssAnon first quarter max {first / 2**20:.0f} MiB -> last quarter max {last / 2**20:.0f} MiB "
              f"({grow_mib:+.0f}), RssShmem {rss[0][1][1] / 2**20:.0f} -> {rss[-1][1][1] / 2**20:.0f} MiB, "
              f"segments seen {out['segments']}")
        ok &= out["n_failures"] == 0 and grow_mib <= args.rss_slack_mib and not out["segments"]
        for f in out["failures"][:5]:
            print("   ", f)
    left = w.segments(port)
    print(f"/dev/shm segments of the job after exit: {left}; wall {wall_s:.0f} s; load average after: {os.getloadavg()}")
    ok &= not left
    print("PASS" if ok else "FAIL")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
