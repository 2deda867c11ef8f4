"""What every rank runs during ``adaptdist cluster profile``.

:func:`profile_rank` is the entry point launched on every rank (by
:func:`adaptdist.runtime.launch.launch_local`). All ranks run every measurement at the same
time, so ranks that share cores or memory channels slow each other down exactly as they will
while training.

Collective timing, as a training step pays for its collectives:

- the call is the one the generated rank programs make: the functional collective
  (``torch.ops._c10d_functional.all_reduce`` / ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor`` / ``all_to_all_single``, which allocate their output) followed by
  ``wait_tensor``, on the world group registered under a name (send_recv, which programs do not
  issue, stays a ``dist.send`` / ``dist.recv`` ping-pong between ranks 0 and 1: half the round trip);
- on CPU each timed call follows a burst of compute, the same fixed number of small matmuls on
  every rank (about ``busy_s`` seconds, 1 ms by default; not timed), because in a step a
  collective is issued between kernels: by then the backend's threads have gone idle and the
  ranks arrive with the small skew of equal work. Measured on the 2-core development machine
  (2 gloo ranks, one thread each; ``benchmarks/RESULTS.md``, cost-model accuracy) a 256 KiB
  all_reduce took 0.5 ms per call back to back but 1.0-1.4 ms after 0.5-2 ms of compute (1.7 ms
  after 4 ms), and the tensor-parallel all_reduces (384 KiB) inside real steps 1.4 ms on average,
  counted from the last rank's arrival; the in-place
  ``dist.all_reduce`` on a reused buffer that was timed before missed the functional op's output
  allocation (16 MiB: 13.9 vs 21.4 ms per call);
- the time of a call is the slowest rank's mean over a batch of ``k`` calls (``k`` from one warm
  call, about ``target_s`` of calls per batch); ``repeats`` rounds each time one batch of every
  (collective, size) between barriers, and a point's time is the *median* of its batches. The
  mean over a batch keeps the occasional slow call (on shared cores a thread sometimes waits a
  scheduler time slice: a 384 KiB all_reduce here has p50 0.6-0.7 ms, p90 3-4 ms), which every step with
  many collectives pays; the median over rounds spread through the run drops a batch spoiled by
  a burst of outside load. (Before, the fastest batch was taken: the calibrated all_reduce was
  0.67 ms at 384 KiB where steps paid 1.4 ms.)

Message sizes follow nccl-tests' convention (see :mod:`adaptdist.cluster`).

Compute: for each dtype an n x n matmul (2 n^3 FLOP, n = 1024 on CPU, 8192 on CUDA, smaller when
one call would take over a quarter of the window), and an
elementwise ``add(a, b, out=c)`` over 64 MiB float32 tensors (3 x 64 MiB of memory traffic per
call), each run for ``compute_window_s`` seconds on all ranks at once.

Op overhead (CPU only): the host time of one dispatched ATen op with no work to speak of -- calls of
``torch.ops.aten.add.Tensor`` (which allocates its output) and ``torch.ops.aten.view.default`` on
64-element tensors, alternating, the way the generated rank programs call ops -- for
``compute_window_s`` seconds on all ranks at once (ranks sharing cores slow each other here too).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one profile run (picklable: it travels to every rank).

    Attributes:
        backend: ``gloo`` or ``nccl``.
        device_kind: ``cpu`` or ``cuda``.
        sizes_bytes: collective message sizes, bytes (whole tensor per rank).
        collectives: which collectives to time.
        shm_collectives: which of adaptdist's shared-memory collectives to time too (``torch.ops.adaptdist.shm_*``
            on a shared-memory group of all ranks; one host, kernels loaded), reported as ``shm:<name>``.
        threads_per_rank: torch threads per rank (CPU).
        target_s: seconds of calls per timed batch.
        repeats: timed batches per message size.
        max_iters: most calls per batch.
        compute_dtypes: dtypes whose matmul rate is measured.
        busy_s: seconds of compute every rank runs before each timed collective call (CPU only; 0:
            back to back); see the module docstring.
        compute_window_s: seconds each compute measurement runs.
        elementwise_bytes: bytes of each elementwise operand.
        progress_file: where rank 0 writes ``{"done": i, "total": n, "label": str}`` (None: nowhere).
        timeout_s: collective timeout, seconds (a hang becomes an error).
        cpus_of_rank: rank -> the CPU core ids to pin it to (the cluster file's ``cpus``; None: not pinned),
            applied before anything is measured, so each device's figures are its own; empty: none pinned.
    """

    backend: str
    device_kind: str
    sizes_bytes: tuple[int, ...]
    collectives: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
    shm_collectives: tuple[str, ...] = ()
    threads_per_rank: int = 1
    target_s: float = 0.025
    repeats: int = 7
    max_iters: int = 200
    busy_s: float = 1e-3
    compute_dtypes: tuple[str, ...] = COMPUTE_DTYPES
    compute_window_s: float = 0.4
    elementwise_bytes: int = 64 * 2**20
    progress_file: str | None = None
    timeout_s: float = 60.0
    cpus_of_rank: tuple = ()
    total_steps: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_steps",
                           len(self.names) * (1 + self.repeats) + len(self.compute_dtypes) + 2)

    @property
    def names(self) -> tuple[str, ...]:
        """Every collective timed: gloo's by name, then the shared-memory ones as ``shm:<name>``."""
        return tuple(self.collectives) + tuple(f"shm:{c}" for c in self.shm_collectives)


class _Progress:
    """Rank 0's progress reports, written atomically to a small JSON file the launcher polls."""

    def __init__(self, path: str | None, total: int, enabled: bool) -> None:
        self.path, self.total, self.enabled, self.done = path, total, enabled and path is not None, 0

    def step(self, label: str, advance: int = 1) -> None:
        self.done += advance
        if self.enabled:
            tmp = f"{self.path}.tmp"
            Path(tmp).write_text(json.dumps({"done": self.done, "total": self.total, "label": label}))
            os.replace(tmp, self.path)


PROFILE_GROUP = "adaptdist:profile"
"""The name the world group is registered under for the functional collectives timed here (and the name of the
shared-memory group of all ranks that times the ``shm:`` collectives)."""


def _collective_call(name: str, nbytes: int, world: int, rank: int, device):
    """A zero-argument function issuing one ``name`` call on a message of ``nbytes`` bytes the way a
    generated rank program does: the functional collective on the group registered as
    :data:`PROFILE_GROUP`, then ``wait_tensor`` (send_recv: a ``dist.send`` / ``dist.recv`` round trip)."""
    import torch
    import torch.distributed as dist

    from .. import _torch_compat as compat

    numel = max(world, (nbytes // 4) // world * world)  # float32, divisible by the world size
    x = torch.ones(numel, dtype=torch.float32, device=device)
    wait = compat.functional_wait_op()
    g = PROFILE_GROUP
    if name.startswith("shm:"):  # the shared-memory ops: complete on return, no wait (adaptdist.kernels.shm)
        ops = torch.ops.adaptdist
        kind = name[len("shm:"):]
        if kind == "all_reduce":
            return lambda: ops.shm_all_reduce(x, "sum", g)
        if kind == "all_gather":
            inp = torch.ones(numel // world, dtype=torch.float32, device=device)
            return lambda: ops.shm_all_gather_into_tensor(inp, world, g)
        if kind == "reduce_scatter":
            return lambda: ops.shm_reduce_scatter_tensor(x, "sum", world, g)
        if kind == "all_to_all":
            return lambda: ops.shm_all_to_all_single(x, [], [], g)
        raise ValueError(f"unknown shared-memory collective {name!r}")
    if name == "all_reduce":
        op = compat.functional_all_reduce_op()
        return lambda: wait(op(x, "sum", g))
    if name == "all_gather":  # nbytes = the gathered output
        inp = torch.ones(numel // world, dtype=torch.float32, device=device)
        op = compat.functional_all_gather_op()
        return lambda: wait(op(inp, world, g))
    if name == "reduce_scatter":  # nbytes = the unscattered input
        op = compat.functional_reduce_scatter_op()
        return lambda: wait(op(x, "sum", world, g))
    if name == "all_to_all":
        op = compat.functional_all_to_all_op()
        splits = [numel // world] * world
        return lambda: wait(op(x, splits, splits, g))
    if name == "send_recv":  # ping-pong between ranks 0 and 1; one call = one round trip
        if rank == 0:
            return lambda: (dist.send(x, 1), dist.recv(x, 1))
        if rank == 1:
            return lambda: (dist.recv(x, 0), dist.send(x, 0))
        return lambda: None
    raise ValueError(f"unknown collective {name!r}")


def _compute_burst(busy_s: float, device):
    """A zero-argument function running about ``busy_s`` seconds of compute, the same work on every
    rank: repeated ``[256, 256] x [256, 256]`` matmuls, as many as the slowest rank runs in ``busy_s``
    (a collective call; every rank must call this together). A no-op when ``busy_s`` is 0 or off CPU
    (a GPU's collectives run on their own stream: a compute burst there would time stream waits)."""
    import torch

    if busy_s <= 0 or device.type != "cpu":
        return lambda: None
    a = torch.randn(256, 256, device=device)
    b = torch.randn(256, 256, device=device)
    c = torch.empty(256, 256, device=device)
    torch.mm(a, b, out=c)
    t0 = time.perf_counter()
    for _ in range(8):
        torch.mm(a, b, out=c)
    one = _slowest((time.perf_counter() - t0) / 8, device)
    reps = max(1, round(busy_s / max(one, 1e-9)))

    def burst() -> None:
        for _ in range(reps):
            torch.mm(a, b, out=c)

    return burst


def _slowest(seconds: float, device) -> float:
    """The largest of every rank's ``seconds`` (an all_reduce MAX)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_collectives(cfg: BenchConfig, rank: int, world: int, device, progress: "_Progress"
                     ) -> dict[str, list[list[float]]]:
    """Seconds per call of every collective at every size: {name: [[nbytes, seconds], ...]}
    (each call after a compute burst on every rank; the slowest rank's mean over a batch; the median of
    ``cfg.repeats`` batches spread over rounds; see the module docstring)."""
    import torch.distributed as dist

    from .. import _torch_compat as compat

    compat.register_process_group(PROFILE_GROUP, dist.group.WORLD)
    if cfg.shm_collectives:
        from ..kernels.shm import destroy_group, group_names, init_group

        if PROFILE_GROUP in group_names():
            destroy_group(PROFILE_GROUP)
        init_group(dist.group.WORLD, name=PROFILE_GROUP, timeout_s=cfg.timeout_s)
    burst = _compute_burst(cfg.busy_s, device)
    points = []  # (name, nbytes, call, iterations)
    for name in cfg.names:
        progress.step(f"{name}: warm-up", 0)
        for nbytes in cfg.sizes_bytes:
            call = _collective_call(name, nbytes, world, rank, device)
            call()
            _sync(device)
            dist.barrier()
            burst()
            t0 = time.perf_counter()
            call()
            _sync(device)
            one = _slowest(time.perf_counter() - t0, device)
            iters = int(min(cfg.max_iters, max(1, math.ceil(cfg.target_s / max(one, 1e-7)))))
            points.append((name, nbytes, call, iters))
        progress.step(f"{name}: warm-up")
    batches: list[list[float]] = [[] for _ in points]
    for r in range(cfg.repeats):
        for i, (name, nbytes, call, iters) in enumerate(points):
            if i == 0 or points[i - 1][0] != name:
                progress.step(f"round {r + 1}/{cfg.repeats} {name}", 0)
            dist.barrier()
            spent = 0.0
            for _ in range(iters):
                burst()
                t0 = time.perf_counter()
                call()
                _sync(device)
                spent += time.perf_counter() - t0
            batches[i].append(_slowest(spent, device) / iters)
            if i + 1 == len(points) or points[i + 1][0] != name:
                progress.step(f"round {r + 1}/{cfg.repeats} {name}")
    out: dict[str, list[list[float]]] = {}
    for (name, nbytes, _, _), ts in zip(points, batches):
        out.setdefault(name, []).append([nbytes, point_seconds(name, ts)])
    return out


def point_seconds(name: str, batch_means_s: list[float]) -> float:
    """Seconds per call of one (collective, size) from its batches' per-call means: their median (a batch
    spoiled by outside load does not move it; module docstring); send_recv's call is a round trip, so one
    way is half of it."""
    t = statistics.median(batch_means_s)
    return t / 2 if name == "send_recv" else t


def _run_window(fn, window_s: float, device) -> tuple[int, float]:
    """Call ``fn`` until ``window_s`` seconds have passed (at least twice); returns (calls, seconds)."""
    calls = 0
    t0 = time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls >= 2:
            _sync(device)
            elapsed = time.perf_counter() - t0
            if elapsed >= window_s:
                return calls, elapsed


def matmul_flops(dtype_name: str, window_s: float, device) -> float:
    """FLOP/s of an n x n ``dtype`` matmul on this rank (2 n^3 FLOP per call).

    n starts large, 1024 on CPU and 8192 on CUDA, since peak rates are reached only by large
    matmuls (small ones on CPU mostly time thread start-up); it halves, down to 128, while one
    call takes more than a quarter of ``window_s``.

    Raises:
        RuntimeError: torch has no matmul for this dtype on this device.
    """
    import torch

    dtype = getattr(torch, dtype_name)
    n = 8192 if device.type == "cuda" else 1024
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        c = torch.empty(n, n, device=device, dtype=dtype)
        torch.mm(a, b, out=c)  # warm-up (and fails early when unsupported)
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        _sync(device)
        if n <= 128 or time.perf_counter() - t0 <= window_s / 4:
            break
        n //= 2
    return _window_rate(lambda: torch.mm(a, b, out=c), 2.0 * n ** 3, window_s, device)


def _window_rate(fn, work_per_call: float, window_s: float, device) -> float:
    import torch.distributed as dist

    dist.barrier()  # every rank starts the window together
    calls, elapsed = _run_window(fn, window_s, device)
    return calls * work_per_call / elapsed


def elementwise_bandwidth(nbytes: int, window_s: float, device) -> float:
    """Bytes/s of ``torch.add(a, b, out=c)`` on float32 tensors of ``nbytes`` bytes each
    (3 x nbytes of memory traffic per call: two reads, one write)."""
    import torch

    numel = max(1, nbytes // 4)
    a = torch.ones(numel, device=device)
    b = torch.ones(numel, device=device)
    c = torch.empty(numel, device=device)
    torch.add(a, b, out=c)
    _sync(device)
    return _window_rate(lambda: torch.add(a, b, out=c), 3.0 * numel * 4, window_s, device)


def op_overhead_s(window_s: float, device) -> float:
    """Seconds per dispatched op: alternating ``aten.add.Tensor`` and ``aten.view.default`` calls on
    64-element float32 tensors through their op overloads, for ``window_s`` seconds (all ranks at once)."""
    import torch

    a = torch.ones(64, device=device)
    add, view = torch.ops.aten.add.Tensor, torch.ops.aten.view.default

    def pair():
        for _ in range(50):
            add(a, a)
            view(a, [8, 8])

    pair()
    return 1.0 / _window_rate(pair, 100.0, window_s, device)


def profile_rank(cfg: BenchConfig) -> dict:
    """Run every measurement on this rank (launched on all ranks at once).

    Returns:
        {"rank", "collectives": {name: [[nbytes, seconds], ...]} (rank 0 only, identical on all),
        "peak_flops": {dtype: FLOP/s}, "failed_dtypes": {dtype: reason},
        "memory_bandwidth_bytes_per_s", "op_overhead_s" (seconds per op; None on cuda), "threads", "affinity"
        (the cores this rank ran on),
        "device_name", "memory_bytes"}.
    """
    import datetime

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    from ..runtime.affinity import pin_to_cpus

    if pin_to_cpus(cfg.cpus_of_rank[rank] if rank < len(cfg.cpus_of_rank) else None, rank) is None:
        torch.set_num_threads(cfg.threads_per_rank)
    if cfg.device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(cfg.backend, timeout=datetime.timedelta(seconds=cfg.timeout_s),
                            **({"device_id": device} if cfg.device_kind == "cuda" else {}))
    progress = _Progress(cfg.progress_file, cfg.total_steps, rank == 0)
    try:
        if world > 1:
            timings = time_collectives(cfg, rank, world, device, progress)
        else:
            timings = {}
            progress.step("collectives: skipped (one rank)", len(cfg.names) * (1 + cfg.repeats))
        flops: dict[str, float] = {}
        failed: dict[str, str] = {}
        for dt in cfg.compute_dtypes:
            progress.step(f"matmul {dt}", 0)
            try:
                flops[dt] = matmul_flops(dt, cfg.compute_window_s, device)
            except (RuntimeError, NotImplementedError, TypeError) as e:
                failed[dt] = str(e).splitlines()[0][:200]
                dist.barrier()  # the others' windows began with a barrier this rank skipped
            progress.step(f"matmul {dt}")
        progress.step("elementwise add", 0)
        bw = elementwise_bandwidth(cfg.elementwise_bytes, cfg.compute_window_s, device)
        progress.step("elementwise add")
        progress.step("op overhead", 0)
        ovh = op_overhead_s(cfg.compute_window_s, device) if device.type == "cpu" else None
        progress.step("op overhead")
        dist.barrier()
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            name, mem = props.name, int(props.total_memory)
        else:
            name, mem = "cpu", None
        return {"rank": rank, "collectives": timings if rank == 0 else {}, "peak_flops": flops,
                "failed_dtypes": failed, "memory_bandwidth_bytes_per_s": bw, "op_overhead_s": ovh,
                "threads": torch.get_num_threads(),
                "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "device_name": name, "memory_bytes": mem}
    finally:
        dist.destroy_process_group()


def _fmt_bytes(n: int) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"
