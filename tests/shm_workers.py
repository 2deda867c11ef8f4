"""Multi-process harness and rank functions for the shared-memory collective tests (tests/test_shm_*.py)
and benchmarks (benchmarks/bench_comm.py, benchmarks/stress_shm.py).

:func:`run_ranks` starts ``world`` spawned processes joined by a gloo process group (a fresh loopback port,
which is also the segments' job key), runs ``fn(rank, world, *args)`` in each and returns {rank: result};
a rank that died has no entry; a rank that raised returns ``{"error": text}``. Bounded by ``timeout_s``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, args: tuple, out_dir: str, pg_timeout_s: float) -> None:
    os.environ["MASTER_PORT"] = str(port)
    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's deprecated *_tensor names: the reference
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_timeout_s))
    try:
        result = fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 -- reported to the test
        result = {"error": traceback.format_exc()}
    torch.save(result, Path(out_dir) / f"{rank}.pt")
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def run_ranks(fn, world: int, args: tuple = (), timeout_s: float = 240.0, pg_timeout_s: float = 60.0,
              port: int | None = None) -> dict[int, object]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; {rank: result}. Raises TimeoutError if a rank
    is still running after ``timeout_s`` (all are killed first)."""
    ctx = mp.get_context("spawn")
    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="adaptdist-shm-test-") as out_dir:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, out_dir, pg_timeout_s), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in alive:
            os.kill(procs[r].pid, signal.SIGKILL)
            procs[r].join(5)
        if alive:
            raise TimeoutError(f"ranks {alive} still running after {timeout_s} s (killed)")
        out = {}
        for r in range(world):
            f = Path(out_dir) / f"{r}.pt"
            if f.exists():
                out[r] = torch.load(f, weights_only=False)
        return out


def segments(job_key: int | str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"adaptdist-{job_key}-*"))


# --------------------------------------------------------------------------------------------------------
# correctness


def _inputs(seed: int, n_ranks: int, numel: int, dtype, kind: str) -> list[torch.Tensor]:
    """Every rank's input for one case (all ranks can rebuild all of them): contiguous or a transposed view."""
    out = []
    for r in range(n_ranks):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        if kind == "nc":  # non-contiguous: a transposed [cols, rows] view of numel elements
            rows = max(1, numel // 6) if numel else 0
            base = torch.randn(6, rows, generator=g).to(dtype)
            out.append(base.t())
        else:
            out.append(torch.randn(numel, generator=g).to(dtype))
    return out


def _reference_reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The documented order: float32 accumulation over group ranks 0..n-1, one rounding."""
    acc = xs[0].float().contiguous().clone()
    for x in xs[1:]:
        acc = torch.maximum(acc, x.float()) if op == "max" else acc + x.float()
    if op == "avg":
        acc = acc / len(xs)
    return acc.to(xs[0].dtype)


def _close(ours: torch.Tensor, ref: torch.Tensor, xs: list[torch.Tensor]) -> bool:
    if ours.shape != ref.shape or ours.dtype != ref.dtype:
        return False
    if ours.numel() == 0:
        return True
    eps = torch.finfo(ours.dtype).eps
    bound = len(xs) * eps * sum(x.float().abs().reshape(ours.shape) for x in xs) + 1e-6
    return bool(((ours.float() - ref.float()).abs() <= bound).all())


def _check_group(group, pg, seed0: int, sizes, failures: list[str], tag: str) -> int:
    """Every op x dtype x size x layout on one group against gloo on ``pg``; returns the number of cases."""
    n, me = group.group_size, group.group_rank
    cases = 0
    for di, dtype in enumerate(DTYPES):
        for si, numel in enumerate(sizes):
            for kind in ("c", "nc"):
                if kind == "nc" and numel < 6:
                    continue
                seed = seed0 + di * 100 + si * 2 + (kind == "nc")
                xs = _inputs(seed, n, numel, dtype, kind)
                x = xs[me]
                what = f"{tag} {dtype} numel={numel} {kind}"
                for op in ("sum", "avg", "max"):
                    ours = group.all_reduce(x, op)
                    ref = _reference_reduce(xs, op)
                    if not torch.equal(ours, ref):
                        failures.append(f"all_reduce {op} {what}: not the documented float32 rank-order result")
                    g = x.contiguous().clone()
                    dist.all_reduce(g, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=pg)
                    if op == "avg":
                        g = (g.float() / n).to(dtype)
                    if not _close(ours, g, xs):
                        failures.append(f"all_reduce {op} {what}: differs from gloo beyond rounding")
                    cases += 1
                ours = group.all_gather(x)
                g = torch.empty_like(ours)
                dist.all_gather_into_tensor(g, x.contiguous(), group=pg)
                if not torch.equal(ours, g):
                    failures.append(f"all_gather {what}: not bitwise gloo's")
                cases += 1
                ours = group.broadcast(x, n - 1)
                g = x.contiguous().clone()
                dist.broadcast(g, src=group.global_ranks[n - 1], group=pg)
                if not torch.equal(ours, g):
                    failures.append(f"broadcast {what}: not bitwise gloo's")
                cases += 1
                # reduce_scatter / all_to_all: dim 0 of n * rows
                xs2 = [torch.cat([t.reshape(-1)] * n).reshape(n, -1) for t in xs]
                if kind == "nc":
                    xs2 = [t.t().contiguous().t() for t in xs2]  # same values, non-contiguous
                x2 = xs2[me]
                for op in ("sum", "max"):
                    ours = group.reduce_scatter(x2, op)
                    ref = _reference_reduce([t[me:me + 1] for t in xs2], op)
                    if not torch.equal(ours, ref):
                        failures.append(f"reduce_scatter {op} {what}: not the documented rank-order result")
                    g = torch.empty_like(ours)
                    dist.reduce_scatter_tensor(g, x2.contiguous(),
                                               op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=pg)
                    if not _close(ours, g, [t[me:me + 1] for t in xs2]):
                        failures.append(f"reduce_scatter {op} {what}: differs from gloo beyond rounding")
                    cases += 1
                ours = group.all_to_all(x2)
                g = torch.empty_like(x2.contiguous())
                dist.all_to_all_single(g, x2.contiguous(), group=pg)
                if not torch.equal(ours, g):
                    failures.append(f"all_to_all {what}: not bitwise gloo's")
                cases += 1
    return cases


def _check_specials_and_held_outputs(group, failures: list[str], tag: str) -> int:
    """Special values through the vectorised reductions (NaN, +-inf, -0.0, overflow, bfloat16 rounding ties,
    an odd length for the scalar tail) equal the documented reference exactly (NaN where it has NaN); and an
    output the caller still holds, or a view of it, is never overwritten by a later all_reduce."""
    n, me = group.group_size, group.group_rank
    cases = 0
    for dtype in DTYPES:
        # the small path, and the chunked one with non-temporal stores (outputs >= 4 MiB) and a tail
        for numel in (37, (1 << 21) + 5):
            xs = []
            for r in range(n):
                t = torch.randn(numel, generator=torch.Generator().manual_seed(900 + r))
                t[7], t[9] = -0.0, 1e38
                t[11] = 1.0 if r == 0 else (2.0 ** -8 if r == 1 else 0.0)  # bfloat16 ties: to even
                t[13] = 1.0078125 if r == 0 else (2.0 ** -8 if r == 1 else 0.0)
                if r == 1:
                    t[3] = float("nan")
                t[5] = float("inf") if r == 0 else (float("-inf") if r == n - 1 else t[5])
                xs.append(t.to(dtype))
            for op in ("sum", "avg", "max"):
                ours = group.all_reduce(xs[me], op)
                try:
                    torch.testing.assert_close(ours, _reference_reduce(xs, op), rtol=0, atol=0, equal_nan=True)
                except AssertionError as e:
                    failures.append(f"{tag} all_reduce {op} {dtype} numel={numel} special values: {str(e)[:200]}")
                cases += 1
    x = torch.randn(1 << 17, generator=torch.Generator().manual_seed(950 + me))
    ref = group.all_reduce(x).clone()
    y1 = group.all_reduce(x)
    y2 = group.all_reduce(x * 2)
    view = y2[:100]
    del y2
    y3 = group.all_reduce(x * 4)  # scaling by powers of two is exact: the sums scale exactly
    checks = {"held output": torch.equal(y1, ref), "view of a dropped output": torch.equal(view, (ref * 2)[:100]),
              "new output": torch.equal(y3, ref * 4)}
    for what, ok in checks.items():
        if not ok:
            failures.append(f"{tag} all_reduce: {what} wrong (overwritten by a later all_reduce?)")
    # Mixed outputs: rank 0 still holds its last output, so its next one is private (it copies the peers' results
    # out of the slots) while the others' are their shared regions (the peers write the results into them).
    del y1, view, y3
    held = group.all_reduce(x * 8)
    if me != 0:
        del held
    y4 = group.all_reduce(x * 16)
    if not torch.equal(y4, ref * 16):
        failures.append(f"{tag} all_reduce: wrong with rank 0's output private and the others' shared")
    if me == 0 and not torch.equal(held, ref * 8):
        failures.append(f"{tag} all_reduce: rank 0's held output overwritten while the others' were shared")
    return cases + 2


def _check_started(world_g, pairs, sizes, failures: list[str]) -> int:
    """The started ops (``shm_*_start`` + ``shm_wait``) with the comm threads on: two groups at once, started ones
    queued behind and before complete ones, waited for in reverse order; results equal the documented reference.
    Returns the number of cases."""
    ops = torch.ops.adaptdist
    cases = 0
    groups = (world_g, *pairs)
    for g in groups:
        ops._shm_group_set_comm_thread(g.name, True)
    for i, numel in enumerate(sizes):
        pending = []
        for g in groups:
            n, me = g.group_size, g.group_rank
            xs = _inputs(8000 + i, n, numel, torch.float32, "nc" if numel >= 6 else "c")
            xs2 = [torch.cat([t.reshape(-1)] * n).reshape(n, -1) for t in xs]
            pending.append((ops.shm_all_reduce_start(xs[me], "sum", g.name), _reference_reduce(xs, "sum"),
                            f"{g.name} all_reduce"))
            whole = g.all_reduce(xs[me], "max")  # run to completion behind the started one
            if not torch.equal(whole, _reference_reduce(xs, "max")):
                failures.append(f"started: {g.name} all_reduce max numel={numel} behind a started op: wrong")
            pending.append((ops.shm_all_gather_into_tensor_start(xs[me], n, g.name),
                            torch.cat([t.contiguous() for t in xs]), f"{g.name} all_gather"))
            pending.append((ops.shm_reduce_scatter_tensor_start(xs2[me], "sum", n, g.name),
                            _reference_reduce([t[me:me + 1] for t in xs2], "sum"), f"{g.name} reduce_scatter"))
        for out, want, what in reversed(pending):
            got = ops.shm_wait(out)
            if got.shape != want.shape or not torch.equal(got.reshape(-1), want.reshape(-1)):
                failures.append(f"started: {what} numel={numel}: wrong")
            cases += 1
    for g in groups:
        ops._shm_group_set_comm_thread(g.name, False)
    return cases


def correctness_worker(rank: int, world: int, sizes: list[int]) -> dict:
    """On 4 ranks: the world (4), ranks [0, 1, 2] (3), and two pairs of size-2 groups at once ({0,1},{2,3}
    named 'pair'; {0,2},{1,3} named 'pair2', used alternately). Returns failures, case count, segments."""
    from adaptdist.kernels import shm

    failures: list[str] = []
    cases = 0
    world_g = shm.init_group(dist.group.WORLD, name="world", timeout_s=60)
    pg3 = dist.new_group([0, 1, 2])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pairs2 = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    # small slots on some groups: every payload path (small, chunked, many chunks) runs on small tensors
    g3 = shm.init_group(pg3, name="three", timeout_s=60, slot_bytes=8192) if rank < 3 else None
    my_pair = pairs[rank // 2]
    my_pair2 = pairs2[rank % 2]
    gp = shm.init_group(my_pair, name="pair", timeout_s=60, slot_bytes=12288)
    gp2 = shm.init_group(my_pair2, name="pair2", timeout_s=60)
    timings = {}
    t0 = time.monotonic()
    cases += _check_group(world_g, dist.group.WORLD, 1, sizes, failures, "world(4)")
    timings["world"] = time.monotonic() - t0
    if g3 is not None:
        cases += _check_group(g3, pg3, 2, sizes, failures, "[0,1,2]")
    dist.barrier()
    timings["three"] = time.monotonic() - t0
    # two groups of the same size on one process, interleaved, and the same name on different pairs
    for i, numel in enumerate(sizes):
        for grp, pg, tag in ((gp, my_pair, "pair"), (gp2, my_pair2, "pair2")):
            xs = _inputs(7000 + i, 2, numel, torch.float32, "c")
            ours = grp.all_reduce(xs[grp.group_rank])
            if not torch.equal(ours, _reference_reduce(xs, "sum")):
                failures.append(f"{tag} all_reduce numel={numel}: wrong")
            ag = grp.all_gather(xs[grp.group_rank] + rank)
            peer_global = grp.global_ranks[1 - grp.group_rank]
            expect = torch.cat([xs[0] + grp.global_ranks[0], xs[1] + grp.global_ranks[1]])
            if not torch.equal(ag, expect):
                failures.append(f"{tag} all_gather numel={numel}: wrong (peer global rank {peer_global})")
            cases += 2
    cases += _check_group(gp, my_pair, 3, sizes, failures, "pair")
    timings["pairs"] = time.monotonic() - t0
    cases += _check_started(world_g, (gp, gp2), sizes, failures)
    cases += _check_specials_and_held_outputs(world_g, failures, "world(4)")
    cases += _check_specials_and_held_outputs(gp2, failures, "pair2")
    return {"failures": failures, "cases": cases, "pids": world_g.pids(), "timings": timings,
            "segments": segments(os.environ["MASTER_PORT"])}


def _registered_calls(group) -> int:
    """all_reduce calls of ``group`` since the last read that read registered inputs in place (kernel counter)."""
    return int(torch.ops.adaptdist._shm_group_profile(group.name)[6])


def _check_registered(group, pg, sizes, failures: list[str], tag: str) -> int:
    """all_reduce of an input in the registered input region (blocking and started), every dtype, op and size,
    equals the documented rank-order result, the copy-in path's result bitwise, and gloo's within rounding; the
    input is left unchanged; every call over 32 KiB took the in-place path (kernel counter)."""
    ops = torch.ops.adaptdist
    n, me = group.group_size, group.group_rank
    cases = 0
    expected_fast = 0
    _registered_calls(group)
    for di, dtype in enumerate(DTYPES):
        for si, numel in enumerate(sizes):
            xs = _inputs(5000 + di * 100 + si, n, numel, dtype, "c")
            buf = group.input_buffer(numel, dtype, offset_bytes=64 * si)
            buf.copy_(xs[me])
            what = f"{tag} registered {dtype} numel={numel}"
            for op in ("sum", "avg", "max"):
                ref = _reference_reduce(xs, op)
                plain = group.all_reduce(xs[me], op).clone()  # the copy-in path
                got = group.all_reduce(buf, op)
                if not (torch.equal(got, ref) and torch.equal(got, plain)):
                    failures.append(f"all_reduce {op} {what}: not bitwise the copy-in path's / rank-order result")
                del got
                got = ops.shm_wait(ops.shm_all_reduce_start(buf, op, group.name))
                if not torch.equal(got, ref):
                    failures.append(f"all_reduce_start {op} {what}: not the rank-order result")
                del got
                if op != "avg":
                    g = xs[me].clone()
                    dist.all_reduce(g, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=pg)
                    if not _close(ref, g, xs):
                        failures.append(f"all_reduce {op} {what}: differs from gloo beyond rounding")
                if not torch.equal(buf, xs[me]):
                    failures.append(f"all_reduce {op} {what}: the registered input was changed")
                expected_fast += 2 if numel * buf.element_size() > 32 * 1024 else 0
                cases += 2
    fast = _registered_calls(group)
    if fast != expected_fast:
        failures.append(f"{tag}: {fast} all_reduces read registered inputs in place, expected {expected_fast}")
    return cases


def _check_registered_mismatch(group, failures: list[str], tag: str) -> int:
    """Registration that the ranks do not share falls back to the copy-in path on every rank, with the right
    result: only rank 0 registered; different offsets per rank; registered inputs but rank 0's output range held
    by the output of an earlier call at that offset (so its output is private); then all registered at one offset
    again (the in-place path), also while every rank holds a plain all_reduce's output (it takes the top of the
    output region, out of the way)."""
    n, me = group.group_size, group.group_rank
    numel = (1 << 16) + 3
    xs = _inputs(6100, n, numel, torch.float32, "c")
    ref = _reference_reduce(xs, "sum")
    cases = 0
    _registered_calls(group)
    variants = (("only rank 0 registered", me == 0, 0, None, 0),
                ("offsets differ per rank", True, 64 * me, None, 0),
                ("rank 0's output held", True, 128, "registered", 0),
                ("all registered at one offset", True, 192, None, 1),
                ("a plain output held", True, 0, "plain", 1))
    for what, registered, offset, hold, want_fast in variants:
        held = None
        if hold == "registered":  # a collective: every rank calls it; only rank 0 keeps the output (its range)
            hx = group.input_buffer(numel, torch.float32, offset_bytes=offset)
            hx.copy_(xs[me])
            held = group.all_reduce(hx)
            if me != 0:
                held = None
        elif hold == "plain":
            held = group.all_reduce(xs[me].clone())
        _registered_calls(group)  # count the call below only
        if registered:
            x = group.input_buffer(numel, torch.float32, offset_bytes=offset)
            x.copy_(xs[me])
        else:
            x = xs[me]
        got = group.all_reduce(x)
        if not torch.equal(got, ref):
            failures.append(f"{tag} registration mismatch ({what}): wrong result")
        del got, held
        fast = _registered_calls(group)
        if fast != want_fast:
            failures.append(f"{tag} registration mismatch ({what}): {fast} in-place calls, expected {want_fast}")
        cases += 1
    return cases


def _check_flatten(group, failures: list[str], tag: str) -> int:
    """shm_flatten_all_reduce_start (a bucket's flatten into the registered region + started all_reduce) equals
    torch.cat + shm_all_reduce_start bitwise: two buckets in flight at once (their own offsets; float32: each output
    at its own range of the shared output region, both read in place), non-contiguous and 0-d gradients, bfloat16, and a bucket
    that does not fit the region (cat + all_reduce)."""
    ops = torch.ops.adaptdist
    me = group.group_rank
    cases = 0
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(6200 + me)
        b1 = [torch.randn(300, 257, generator=gen).to(dtype), torch.randn(1001, generator=gen).to(dtype),
              torch.randn((), generator=gen).to(dtype), torch.randn(64, 33, generator=gen).to(dtype).t()]
        b2 = [torch.randn(5, generator=gen).to(dtype), torch.randn(400, 201, generator=gen).to(dtype)]
        off2 = (sum(t.numel() for t in b1) * b1[0].element_size() + 63) // 64 * 64
        _registered_calls(group)
        f1 = ops.shm_flatten_all_reduce_start(b1, 0, "sum", group.name)
        f2 = ops.shm_flatten_all_reduce_start(b2, off2, "avg", group.name)
        r1 = ops.shm_wait(f1).clone()
        r2 = ops.shm_wait(f2).clone()
        del f1, f2
        # float32: both buckets >= 256 KiB, each output at its own range of the shared region: both read in place;
        # bfloat16: both under 256 KiB, outputs private: both fall back
        fast, want_fast = _registered_calls(group), (2 if dtype == torch.float32 else 0)
        if fast != want_fast:
            failures.append(f"{tag} flatten_all_reduce {dtype}: {fast} of 2 buckets in flight read in place, "
                            f"expected {want_fast}")
        for got, bucket, op, what in ((r1, b1, "sum", "bucket 1"), (r2, b2, "avg", "bucket 2")):
            want = ops.shm_wait(ops.shm_all_reduce_start(torch.cat([t.reshape(-1) for t in bucket]), op, group.name))
            if not torch.equal(got, want):
                failures.append(f"{tag} flatten_all_reduce {dtype} {what}: not bitwise cat + all_reduce")
            cases += 1
        too_far = (64 << 20) - 64  # does not fit: cat + all_reduce
        got = ops.shm_wait(ops.shm_flatten_all_reduce_start(b1, too_far, "sum", group.name))
        if not torch.equal(got, r1):
            failures.append(f"{tag} flatten_all_reduce {dtype}: the cat fall-back differs")
        cases += 1
    return cases


def registered_worker(rank: int, world: int, sizes: list[int]) -> dict:
    """Registered-input all_reduce (issue 16 point 5) on the world group and, on 4 ranks, on two pairs at once
    ({0,1} and {2,3}, both named 'pair'), with the comm thread off and on."""
    from adaptdist.kernels import shm

    failures: list[str] = []
    cases = 0
    world_g = shm.init_group(dist.group.WORLD, name="world", timeout_s=60, comm_thread=False)
    groups = [(world_g, dist.group.WORLD, f"world({world})")]
    if world == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        groups.append((shm.init_group(pairs[rank // 2], name="pair", timeout_s=60, comm_thread=False),
                       pairs[rank // 2], "pair"))
    for on in (False, True):
        for g, pg, tag in groups:
            torch.ops.adaptdist._shm_group_set_comm_thread(g.name, on)
            tag = f"{tag} comm_thread={on}"
            cases += _check_registered(g, pg, sizes, failures, tag)
            cases += _check_registered_mismatch(g, failures, tag)
            cases += _check_flatten(g, failures, tag)
    return {"failures": failures, "cases": cases, "segments": segments(os.environ["MASTER_PORT"])}


def fault_worker(rank: int, world: int, stall_timeout_s: float) -> dict:
    """3 ranks. (1) group 'stall' (timeout ``stall_timeout_s``): rank 2 sleeps past it while ranks 0 and 1 wait
    in an all_reduce. (2) group 'main': rank 2 SIGKILLs itself; ranks 0 and 1 then start all_reduces on the group's
    comm thread and wait for them.
    Returns per rank what each raised and how long it took."""
    from adaptdist.errors import ShmPeerError
    from adaptdist.kernels import shm

    out: dict = {"pid": os.getpid()}
    main = shm.init_group(dist.group.WORLD, name="main", timeout_s=60)
    stall_pg = dist.new_group([0, 1, 2])
    stall = shm.init_group(stall_pg, name="stall", timeout_s=stall_timeout_s)
    main.all_reduce(torch.ones(1000))
    dist.barrier()
    x = torch.ones(300_000)
    if rank == 2:
        time.sleep(stall_timeout_s + 2.5)
    t0, cpu0 = time.monotonic(), time.process_time()
    try:
        stall.all_reduce(x)
        out["stall"] = None
    except ShmPeerError as e:
        out["stall"] = (str(e), e.peer_group_rank, e.peer_global_rank, e.peer_pid)
    out["stall_s"] = time.monotonic() - t0
    out["stall_cpu_s"] = time.process_time() - cpu0  # every thread of this process while it waited
    dist.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    # not needed for the outcome (a peer's death is seen whenever it happens: its pid is checked every 50 ms);
    # it lets the kill land first, so "killed_s" measures detection of a dead peer, not rank 2's exit
    time.sleep(0.2)
    # a started collective on the group's comm thread: the death surfaces at its shm_wait, typed as from the ops
    torch.ops.adaptdist._shm_group_set_comm_thread("main", True)
    t0 = time.monotonic()
    try:
        for _ in range(3):
            shm._call(torch.ops.adaptdist.shm_wait, torch.ops.adaptdist.shm_all_reduce_start(x, "sum", "main"))
        out["killed"] = None
    except ShmPeerError as e:
        out["killed"] = (str(e), e.peer_group_rank, e.peer_global_rank, e.peer_pid)
    out["killed_s"] = time.monotonic() - t0
    out["segments"] = segments(os.environ["MASTER_PORT"])
    return out
