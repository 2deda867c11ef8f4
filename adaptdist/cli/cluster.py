"""The ``adaptdist cluster`` subcommand: ``detect`` and ``profile``."""

from __future__ import annotations

import argparse
import sys

from ..errors import UsageError
from .common import local_ranks, positive

QUICK_SIZES_BYTES = (256, 4096, 65536)
"""Message sizes of ``profile --quick`` (a smoke test, not a calibration to plan with)."""


_positive_int = positive(int)
_positive_float = positive(float)


def add_parser(sub) -> None:
    """Register ``cluster detect`` and ``cluster profile`` on the top-level subparsers ``sub``."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    c = sub.add_parser("cluster", help="describe (detect) or measure (profile) this machine as a cluster file")
    csub = c.add_subparsers(dest="cluster_command", required=True)
    d = csub.add_parser("detect", formatter_class=fmt,
                        help="write a cluster file for this machine with estimated (uncalibrated) figures")
    p = csub.add_parser("profile", formatter_class=fmt,
                        help="launch the ranks, measure collectives (alpha-beta per link tier), matmul and "
                             "memory bandwidth with all ranks busy, and write a calibrated cluster file")
    for q in (d, p):
        q.add_argument("--out", metavar="FILE", default="cluster.yaml", help="file to write (.json: JSON, else YAML)")
        q.add_argument("--nproc", type=local_ranks, default=None,
                       help="local ranks; default 2 on cpu, every visible GPU on cuda")
        q.add_argument("--device-kind", choices=("auto", "cpu", "cuda"), default="auto",
                       help="auto: cuda when a GPU is visible, else cpu")
    p.add_argument("--max-message-mib", type=positive(float, 4096.0, "4 GiB"), default=16.0,
                   help="largest collective message, MiB (sizes from 1 KiB, x4 apart)")
    p.add_argument("--timeout-s", type=_positive_float, default=60.0, help="collective timeout, seconds")
    p.add_argument("--cluster", metavar="FILE", default=None,
                   help="measure the ranks this cluster file describes (one host; a device's 'cpus: [0]' pins its "
                        "rank while it is measured); default: --nproc ranks, unpinned")
    p.add_argument("--quick", action="store_true",
                   help="tiny messages and short windows: a smoke test, not figures to plan with")


def cmd_cluster(args) -> int:
    """``adaptdist cluster detect|profile``; returns the exit code.

    Raises:
        ClusterSpecError, RuntimeLaunchError, UsageError: printed by ``main`` as one paragraph.
    """
    from rich.console import Console

    from ..calibrate.detect import describe_machine, detect_local

    from .common import check_out_file

    check_out_file(args.out)
    console = Console(stderr=True, emoji=False)
    if not console.is_terminal:
        console = Console(stderr=True, emoji=False, width=140)
    if args.cluster_command == "detect":
        cluster = detect_local(args.nproc, args.device_kind)
        _write(cluster, args.out, f"written by `adaptdist cluster detect` on {describe_machine()}")
        _show(console, cluster)
        console.print(f"wrote {args.out}: {cluster!r}, uncalibrated (estimated figures); "
                      f"topology fingerprint {cluster.topology_fingerprint()}; "
                      f"`adaptdist cluster profile` measures them")
        return 0
    from ..calibrate.profile import DEFAULT_SIZES_BYTES, profile_local

    if args.quick:
        sizes, extra = QUICK_SIZES_BYTES, dict(target_s=0.002, repeats=2, compute_window_s=0.05,
                                               elementwise_bytes=16 * 2**20)
    else:
        top = int(args.max_message_mib * 2**20)
        if top < 4096:
            raise UsageError(f"--max-message-mib {args.max_message_mib} is below 4 KiB; give at least 0.004")
        sizes = tuple(s for s in DEFAULT_SIZES_BYTES if s < top) + (top,)
        extra = {}
    base = None
    if args.cluster:
        from ..calibrate.local import load_cluster

        base = load_cluster(args.cluster)
        if args.nproc is not None and args.nproc != base.world_size:
            raise UsageError(f"--nproc {args.nproc} differs from the {base.world_size} ranks of --cluster "
                             f"{args.cluster}; drop --nproc")
    result = profile_local(2 if args.nproc is None and args.device_kind != "cuda" else args.nproc,
                           args.device_kind, sizes, console=console, timeout_s=args.timeout_s, base=base, **extra)
    cluster = result.cluster
    _write(cluster, args.out, f"written by `adaptdist cluster profile` on {describe_machine()}"
                              + (" (--quick: smoke test)" if args.quick else ""))
    _show(console, cluster)
    n = cluster.world_size
    console.print(f"profiled {n} {cluster.device_kind} rank{'s' if n > 1 else ''} in {result.wall_s:.1f} s; "
                  f"wrote {args.out}: {cluster!r}; topology fingerprint {cluster.topology_fingerprint()}")
    return 0


def _write(cluster, out: str, comment: str) -> None:
    from ..cluster_file import save_cluster

    try:
        save_cluster(cluster, out, comment)
    except OSError as e:
        raise UsageError(f"cannot write --out {out!r}: {e.strerror or e}") from None


def _show(console, cluster) -> None:
    """Tables of the devices, links and (when calibrated) the collective fits."""
    from rich.table import Table

    from ..cluster import COLLECTIVES

    dev = Table(title="devices (FLOP/s: " + ("measured matmul" if cluster.calibrated else "estimated, uncalibrated") + ")")
    dtypes = sorted({dt for d in cluster.devices for dt in d.peak_flops}, key=lambda s: (s != "float32", s))
    short = {"float32": "f32", "float64": "f64", "bfloat16": "bf16", "float16": "f16"}
    for col in ("rank", "host", "kind", "cores", *[f"{short.get(dt, dt)} TFLOP/s" for dt in dtypes], "memory GiB",
                "memory GB/s", "op us"):
        dev.add_column(col, justify="right")
    for d in cluster.devices:
        dev.add_row(str(d.rank), d.host, d.kind,
                    ("" if d.cores is None else f"{d.cores:g}") + (f" cpus {list(d.cpus)}" if d.cpus is not None else ""),
                    *[f"{d.peak_flops[dt] / 1e12:.3f}" if dt in d.peak_flops else "" for dt in dtypes],
                    f"{d.memory_bytes / 2**30:.1f}", f"{d.memory_bandwidth_bytes_per_s / 1e9:.1f}",
                    "" if d.op_overhead_s is None else f"{d.op_overhead_s * 1e6:.2f}")
    console.print(dev)
    links = Table(title="links")
    for col in ("tier / ranks", "bandwidth GB/s", "latency us"):
        links.add_column(col, justify="right")
    for link in cluster.links:
        links.add_row(link.tier if link.ranks is None else str(list(link.ranks)),
                      f"{link.bandwidth_bytes_per_s / 1e9:.3f}", f"{link.latency_s * 1e6:.1f}")
    if cluster.links:
        console.print(links)
    if cluster.calibrated and cluster.calibration.collectives:
        fits = Table(title="collectives: time(n) = alpha + beta n   (n: bytes of the whole tensor)")
        for col in ("tier", "collective", "ranks", "alpha us", "1/beta GB/s", "rms rel. error"):
            fits.add_column(col, justify="right")
        for (tier, name), f in sorted(cluster.calibration.collectives.items(),
                                      key=lambda kv: (kv[0][0], COLLECTIVES.index(kv[0][1]))):
            fits.add_row(tier, name, str(f.num_ranks or ""), f"{f.alpha_s * 1e6:.1f}",
                         f"{f.bandwidth_bytes_per_s / 1e9:.3f}",
                         "" if f.rms_rel_error is None else f"{f.rms_rel_error:.0%}")
        console.print(fits)
    sys.stderr.flush()
