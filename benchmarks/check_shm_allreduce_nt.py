"""The large all_reduce's non-temporal fast path (float32, 2 and 4 ranks, outputs in the shared regions, from
4 MiB on), which the tests' sizes (<= 1 MiB) do not reach: sum, avg and max at 16 MiB and at 16 MiB + 13 elements
(unaligned tail), each output compared bitwise with the documented rank-order float32 reference
(tests/shm_workers.py::_reference_reduce); the second call of each case reuses the shared region, and one call
per case keeps the previous output alive (a private output). Outside CI (about a minute on 2 cores):

    PYTHONPATH=. .venv/bin/python benchmarks/check_shm_allreduce_nt.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import shm_workers as w  # noqa: E402


def worker(rank, world, sizes):
    import torch
    import torch.distributed as dist
    from adaptdist.kernels import shm
    g = shm.init_group(dist.group.WORLD, name="world", timeout_s=120)
    failures, cases = [], 0
    for i, numel in enumerate(sizes):
        xs = w._inputs(9100 + i, world, numel, torch.float32, "c")
        for op in ("sum", "avg", "max"):
            want = w._reference_reduce(xs, op)
            held = g.all_reduce(xs[rank], op)  # shared region (or private)
            again = g.all_reduce(xs[rank], op)  # the region is held: a private output
            for got, what in ((held, "first"), (again, "second")):
                cases += 1
                if not torch.equal(got, want):
                    bad = (got != want).nonzero()[:3].flatten().tolist()
                    failures.append(f"{world} ranks numel={numel} {op} {what}: differs at {bad}")
            del held, again
    return {"failures": failures, "cases": cases}


if __name__ == "__main__":
    for n in (2, 4):
        res = w.run_ranks(worker, n, ([1 << 22, (1 << 22) + 13],), timeout_s=600, pg_timeout_s=300)
        for r in sorted(res):
            print(n, "ranks, rank", r, res[r] if isinstance(res[r], dict) and res[r].get("failures") else
                  f"{res[r].get('cases') if isinstance(res[r], dict) else res[r]} cases, 0 failures")
