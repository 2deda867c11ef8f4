"""Where the time of a large shared-memory all_reduce goes: per rank, the chunked all_reduce's phases
(copy-in to the segment, reduction of the rank's slice, copy-out of the peers' slices, barrier waits)
from the kernel's own timers (torch.ops.adaptdist._shm_group_profile), with the bytes each phase moves
and its bandwidth, beside one core's memcpy.

    .venv/bin/python benchmarks/profile_shm.py [--ranks 2 4] [--size-mib 16] [--iters 30]
        [--slot-bytes N] [--spin-us US] [--registered]

--registered: the input lies in the rank's registered input region (shm.input_buffer): no copy-in.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

PHASES = ("copy_in", "reduce", "copy_out", "barrier")


def profile_worker(rank: int, world: int, size_bytes: int, iters: int, slot_bytes: int, spin_us,
                   registered: bool = False) -> dict:
    from adaptdist.kernels import shm

    group = shm.init_group(dist.group.WORLD, name="prof", timeout_s=300, slot_bytes=slot_bytes, spin_us=spin_us)
    x = torch.randn(size_bytes // 4)
    if registered:
        x = group.input_buffer(x.numel()).copy_(x)
    for _ in range(3):
        group.all_reduce(x)
    dist.barrier()
    torch.ops.adaptdist._shm_group_profile("prof")
    # Per call: the phases' times; reported: the median call's phases and the fastest call (this machine
    # is shared, so means mix in other processes' time slices).
    calls = []
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    for _ in range(iters):
        group.all_reduce(x)
        calls.append(torch.ops.adaptdist._shm_group_profile("prof"))
    wall = (time.perf_counter() - t0) / iters
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / iters
    calls.sort(key=lambda c: c[4])
    med = calls[len(calls) // 2]
    return {"wall_s": wall, "faults": faults, **{p: med[k] for k, p in enumerate(PHASES)}, "call_s": med[4],
            "min_call_s": calls[0][4]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--size-mib", type=float, default=16)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--slot-bytes", type=int, default=None)
    ap.add_argument("--spin-us", type=float, default=None)
    ap.add_argument("--registered", action="store_true", help="input in the registered region (no copy-in)")
    args = ap.parse_args(argv)
    import shm_workers

    from adaptdist.kernels import shm

    size = int(args.size_mib * (1 << 20))
    print(f"load average: {' '.join(f'{v:.2f}' for v in os.getloadavg())}  (nproc {os.cpu_count()})")
    for n in args.ranks:
        res = shm_workers.run_ranks(profile_worker, n, (size, args.iters, args.slot_bytes or shm.DEFAULT_SLOT_BYTES,
                                                        args.spin_us, args.registered), timeout_s=600)
        # Bytes each rank moves per call in each phase (read + written), for S = size and n ranks, with the outputs
        # in the ranks' shared regions (the calls here drop each output): the reduction reads S and writes its
        # slice into every rank's output (S); no copy-out. (Private outputs: reduction S + 2S/n, copy-out 2S(n-1)/n.)
        moved = {"copy_in": 0 if args.registered else 2 * size * (n - 1) / n, "reduce": 2 * size, "copy_out": 0}
        print(f"{n} ranks, {args.size_mib:g} MiB all_reduce{' (registered input)' if args.registered else ''} (ms per call; GB/s = bytes read + written / time)")
        for r in sorted(res):
            row = res[r]
            if "error" in row:
                print(f"  rank {r}: {row['error']}")
                continue
            parts = "  ".join(f"{p} {row[p] * 1e3:6.2f}" + (f" ({moved[p] / row[p] / 1e9:5.1f} GB/s)" if moved.get(p) and row[p] > 0 else "")
                              for p in PHASES)
            print(f"  rank {r}: median call {row['call_s'] * 1e3:6.2f} (fastest {row['min_call_s'] * 1e3:6.2f}, mean wall "
                  f"{row['wall_s'] * 1e3:6.2f}, {row['faults']:.0f} page faults/call) | {parts}")
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
