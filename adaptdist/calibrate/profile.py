"""``adaptdist cluster profile``: launch the ranks, measure, and build a calibrated cluster.

The ranks run :func:`.bench.profile_rank` under torch's elastic launcher (gloo on CPU, nccl
on CUDA). Their timings become:

- per collective, an alpha-beta fit (:func:`.fit.fit_alpha_beta`) of the time a call costs inside a
  training step (the functional collective the rank programs issue, after a burst of compute; the
  median over rounds of batch means: :mod:`.bench`), stored in the cluster's calibration block under
  the tier the ranks span (``intra_host`` for a local run); on CPU, where adaptdist's C++ kernels are loaded,
  the shared-memory collectives too (``torch.ops.adaptdist.shm_*``, timed the same way), filed under ``shm``;
- the tier's link: latency_s = alpha and bandwidth_bytes_per_s = 1 / beta of the send_recv fit;
- per device, ``peak_flops`` = the measured matmul FLOP/s per dtype,
  ``memory_bandwidth_bytes_per_s`` = the elementwise add rate and (CPU) ``op_overhead_s`` = the host time
  of one tiny dispatched op, every rank busy at once.

Memory sizes and core shares stay as :func:`.detect.detect_local` found them.
"""

from __future__ import annotations

import datetime
import logging
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..cluster import COLLECTIVES, SHM_COLLECTIVES, SHM_TIER, Calibration, Cluster, CollectiveFit, FrozenMap, Host, Link
from ..errors import ClusterSpecError
from . import hardware
from .bench import BenchConfig, profile_rank
from .detect import detect_local
from .fit import fit_alpha_beta

DEFAULT_SIZES_BYTES = tuple(2**k for k in range(10, 25, 2))
"""Message sizes timed by default: 1 KiB, 4 KiB, ..., 16 MiB (x4 apart)."""

log = logging.getLogger("adaptdist.calibrate")


@dataclass(frozen=True)
class ProfileResult:
    """A calibrated cluster, the seconds the profile took, and the raw per-rank measurements."""

    cluster: Cluster
    wall_s: float
    raw: dict


def _load_average() -> float:
    """The 1-minute load average (0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def _poll_progress(path: Path, console, total: int, stop: threading.Event) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("[bold]profile[/] {task.description:<28}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task("starting the ranks", total=total)
        while True:
            stopping = stop.wait(0.1)
            try:
                state = json.loads(path.read_text())
            except (OSError, ValueError):
                state = None
            if state:
                bar.update(task, completed=state["done"], description=state["label"])
            if stopping:
                if state and state["done"] >= total:
                    bar.update(task, description="done")
                return


def profile_local(nproc: int = 2, device_kind: str = "auto",
                  sizes_bytes: tuple[int, ...] = DEFAULT_SIZES_BYTES, *, console=None,
                  threads_per_rank: int | None = None, target_s: float = 0.025, repeats: int = 7,
                  busy_s: float = 1e-3, compute_window_s: float = 0.4, elementwise_bytes: int = 64 * 2**20,
                  compute_dtypes: tuple[str, ...] | None = None, timeout_s: float = 60.0,
                  base: Cluster | None = None) -> ProfileResult:
    """Measure this machine with ``nproc`` ranks all running at once; return a calibrated cluster.

    Args:
        nproc: ranks to launch.
        device_kind: ``cpu`` (gloo), ``cuda`` (nccl) or ``auto``.
        sizes_bytes: collective message sizes, bytes; at least two distinct sizes.
        console: a rich Console to draw a progress bar on (None: silent).
        threads_per_rank: torch threads per rank; default usable cores // nproc, at least 1.
        target_s, repeats: seconds per timed batch and batches per size (see :mod:`.bench`).
        busy_s: seconds of compute every rank runs before each timed collective call (CPU; see :mod:`.bench`).
        compute_window_s: seconds each matmul / elementwise measurement runs.
        elementwise_bytes: bytes of each elementwise operand (well beyond the caches).
        compute_dtypes: matmul dtypes to measure (default float32, bfloat16, float16, float64).
        timeout_s: collective timeout, seconds: a hung rank becomes an error.
        base: the cluster to measure (one host, as read from a cluster file): its devices' ``cpus`` pin each
            rank while it is measured, so ranks sharing cores measure slower than a rank alone; its memory and
            core figures are kept. None: :func:`.detect.detect_local` of ``nproc`` ranks.

    Raises:
        ClusterSpecError: bad ``nproc`` / kind / sizes.
        RuntimeLaunchError: a rank failed (its error in the message).
    """
    from ..runtime.launch import launch_local
    from .bench import COMPUTE_DTYPES

    if base is None:
        base = detect_local(nproc, device_kind)
    elif len(base.hosts) != 1:
        raise ClusterSpecError(f"profile: {base!r} has {len(base.hosts)} hosts; `cluster profile` measures the ranks "
                               "of this machine (one host)")
    kind = base.device_kind
    sizes = tuple(sorted({int(s) for s in sizes_bytes}))
    if len(sizes) < 2 or sizes[0] < 4:
        raise ClusterSpecError(f"profile: message sizes must be at least two distinct sizes >= 4 bytes, "
                               f"got {sizes_bytes!r}")
    world = base.world_size
    threads = threads_per_rank or max(1, hardware.usable_cores() // world)
    from ..kernels import available

    shm = SHM_COLLECTIVES if kind == "cpu" and world > 1 and available() else ()
    busy = _load_average()
    if console is not None and busy > 0.5 * hardware.usable_cores():
        console.print(f"[yellow]warning: this machine is busy (load average {busy:.1f} on {hardware.usable_cores()} "
                      f"cores) before the ranks start; the figures will include that load (slower)[/]")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="adaptdist-profile-") as tmp:
        progress_file = Path(tmp) / "progress.json"
        cfg = BenchConfig(backend=base.backend, device_kind=kind, sizes_bytes=sizes, threads_per_rank=threads,
                          target_s=target_s, repeats=repeats, busy_s=busy_s, compute_window_s=compute_window_s,
                          elementwise_bytes=elementwise_bytes, shm_collectives=shm,
                          compute_dtypes=tuple(compute_dtypes or COMPUTE_DTYPES),
                          progress_file=str(progress_file), timeout_s=timeout_s,
                          cpus_of_rank=tuple(base.device(r).cpus for r in range(world)))
        stop = threading.Event()
        poller = None
        if console is not None:
            poller = threading.Thread(target=_poll_progress, args=(progress_file, console, cfg.total_steps, stop),
                                      daemon=True)
            poller.start()
        try:
            results = launch_local(profile_rank, (cfg,), world)
        finally:
            stop.set()
            if poller is not None:
                poller.join(timeout=5)
    calibrated = calibrate(base, results, time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    calibrated = calibrated.with_calibration(replace(calibrated.calibration, wall_s=round(wall, 3)))
    return ProfileResult(calibrated, wall, results)


def calibrate(base: Cluster, results: dict[int, dict], wall_s: float | None = None) -> Cluster:
    """``base`` with the measured figures of ``results`` ({rank: :func:`.bench.profile_rank` output}).

    Collectives are filed under the tier the ranks span: ``intra_host`` when all ranks are on one
    host (the only kind of run :func:`profile_local` launches), else ``inter_host``.

    Raises:
        ClusterSpecError: a rank is missing, or float32 matmul could not be measured.
    """
    import torch

    world = base.world_size
    missing = sorted(set(range(world)) - set(results))
    if missing:
        raise ClusterSpecError(f"profile: no measurements from rank(s) {missing}")
    tier = "intra_host" if len(base.hosts) == 1 else "inter_host"
    fits: dict[tuple[str, str], CollectiveFit] = {}
    for name, points in results[0]["collectives"].items():
        key = (SHM_TIER, name[len("shm:"):]) if name.startswith("shm:") else (tier, name)
        assert key[1] in COLLECTIVES, name
        if key[0] == SHM_TIER and tier != "intra_host":
            continue  # shared memory joins the ranks of one host only
        ab = fit_alpha_beta([p[0] for p in points], [p[1] for p in points])
        fits[key] = CollectiveFit(ab.alpha_s, ab.beta_s_per_byte, 2 if name == "send_recv" else world,
                                           round(ab.rms_rel_error, 4))
    hosts = []
    for h in base.hosts:
        devices = []
        for d in h.devices:
            r = results[d.rank]
            if "float32" not in r["peak_flops"]:
                raise ClusterSpecError(f"profile: rank {d.rank} could not time a float32 matmul: "
                                       f"{r['failed_dtypes'].get('float32', 'no result')}")
            for dt, why in sorted(r["failed_dtypes"].items()):  # kept out of the file, said aloud
                log.warning("profile: rank %d could not time a %s matmul (%s); its peak_flops has no %s entry",
                            d.rank, dt, why, dt)
            devices.append(replace(d, peak_flops=dict(r["peak_flops"]),
                                   memory_bandwidth_bytes_per_s=r["memory_bandwidth_bytes_per_s"],
                                   op_overhead_s=r.get("op_overhead_s")))
        hosts.append(Host(h.name, tuple(devices)))
    links = list(base.links)
    sr = fits.get((tier, "send_recv"))
    if sr is not None:
        links = [Link(tier, sr.bandwidth_bytes_per_s, sr.alpha_s) if (link.ranks is None and link.tier == tier)
                 else link for link in links]
    calibration = Calibration(
        FrozenMap(fits),
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        backend=base.backend, torch_version=str(torch.__version__),
        wall_s=None if wall_s is None else round(wall_s, 3))
    return Cluster(tuple(hosts), tuple(links), calibration)
