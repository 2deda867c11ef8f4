"""Issue 16 point 4 at 64 MiB: every shared-memory op x dtype x layout (contiguous and a transposed view) on 2
ranks, numel 2**24 (64 MiB of float32), against gloo and the documented float32 rank-order reference
(tests/shm_workers.py::_check_group); prints each rank's failures (none expected) and the /dev/shm segments left.
Outside CI (about 2 minutes on 2 loaded cores):

    PYTHONPATH=. .venv/bin/python benchmarks/check_shm_64mib.py
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import shm_workers as w  # noqa: E402


def worker(rank, world, sizes):
    import os
    from adaptdist.kernels import shm
    import torch.distributed as dist
    g = shm.init_group(dist.group.WORLD, name="world", timeout_s=120)
    failures = []
    t0 = time.monotonic()
    cases = w._check_group(g, dist.group.WORLD, 5, sizes, failures, "world(2)")
    return {"failures": failures, "cases": cases, "s": time.monotonic() - t0,
            "segments": w.segments(os.environ["MASTER_PORT"])}


if __name__ == "__main__":
    port = w.free_port()
    res = w.run_ranks(worker, 2, ([1 << 24],), timeout_s=900, pg_timeout_s=300, port=port)
    print(res)
    left = w.segments(port)
    print("segments after:", left)
    ok = sorted(res) == [0, 1] and all(not r.get("failures") and "error" not in r for r in res.values()) and not left
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)
