"""Facts about this machine and the default (uncalibrated) figures estimated from them.

Nothing here imports torch, so :class:`adaptdist.cluster.Cluster` can build a local
cluster cheaply. Every estimate starts from the hardware's datasheet arithmetic (units per
cycle x clock), not a measurement; ``adaptdist cluster profile`` replaces them with measured
ones. The CPU figures are deliberately conservative (half the peak FLOP/s, a per-op host
overhead, gloo links as slow as measured on a shared 2-core machine, see :data:`_LINK_DEFAULTS`),
so that an uncalibrated estimate errs on the slow side (benchmarks/RESULTS.md, "Uncalibrated
estimates": the built-in GPT's estimate was 0.6-0.9x its measured step before, 1.0-1.5x after, on a
lightly loaded machine).

Sources of the per-cycle figures: Intel 64 and IA-32 Architectures Optimization
Reference Manual (two 512-bit FMA units: 32 float32 FMAs = 64 FLOP per cycle per core;
AVX2 + FMA: 32 FLOP; AMX-BF16: 1024 bf16 FLOP per cycle per core); NVIDIA A100 / H100
datasheets for the CUDA defaults.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CLOCK_HZ = 2.5e9
"""Clock assumed when /proc/cpuinfo's model name does not state one (e.g. ``Xeon(R) Processor``)."""

MEMORY_BANDWIDTH_PER_CORE_BYTES_PER_S = 10e9
"""Rough DRAM bandwidth one busy core can draw (STREAM-like copy), bytes/s (``cluster profile`` measured
13-14 GB/s per rank for an elementwise add on a quiet machine, 7 GB/s under load)."""

CPU_PEAK_FRACTION = 0.5
"""Fraction of the datasheet peak FLOP/s an uncalibrated CPU rank is assumed to reach: the small GEMMs
of a model ran at 0.75-0.87 of the large-matmul rate on a quiet machine, and a shared machine gives
less; 0.5 keeps the estimate on the slow side."""

CPU_OP_OVERHEAD_S = 5e-6
"""Host time of one dispatched ATen op on a CPU rank with a core of its own, seconds (``cluster profile``
measured 2.3-3.5 us with every core busy, 8.6 us under load); scaled by ranks per core when the ranks
outnumber the cores (7-10 us measured with 4 ranks on 2 cores)."""

HOST_MEMORY_BANDWIDTH_CAP_BYTES_PER_S = 200e9
"""Upper bound on one host's DRAM bandwidth (a two-socket DDR5 server), bytes/s."""


@dataclass(frozen=True)
class CpuInfo:
    """This machine's CPU and memory.

    Attributes:
        cores: cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``).
        memory_bytes: usable RAM: ``MemTotal`` of /proc/meminfo, capped by a cgroup
            ``memory.max`` limit when one is set.
        model_name: /proc/cpuinfo's ``model name`` (``""`` when unknown).
        flags: the CPU feature flags (``avx512f``, ``amx_bf16``, ...).
        clock_hz: clock from the model name (``@ 2.10GHz``), else :data:`DEFAULT_CLOCK_HZ`.
    """

    cores: int
    memory_bytes: int
    model_name: str
    flags: frozenset[str]
    clock_hz: float

    def peak_flops_per_core(self) -> dict[str, float]:
        """Peak FLOP/s of one core per dtype name (float32, float64, bfloat16, float16).

        float32: 64 FLOP/cycle with AVX-512 (2 FMA units x 16 lanes x 2), 32 with AVX2+FMA,
        16 with AVX, 8 otherwise. bfloat16: AMX-BF16 1024 FLOP/cycle, AVX512-BF16 twice
        float32, else a quarter of float32 (converted to float32 to compute). float16 the
        same with AMX-FP16 / AVX512-FP16. float64 half of float32.
        """
        f = self.flags
        per_cycle = 64 if "avx512f" in f else 32 if ("avx2" in f and "fma" in f) else 16 if "avx" in f else 8
        fp32 = per_cycle * self.clock_hz
        bf16 = 1024 * self.clock_hz if "amx_bf16" in f else 2 * fp32 if "avx512_bf16" in f else fp32 / 4
        fp16 = 1024 * self.clock_hz if "amx_fp16" in f else 2 * fp32 if "avx512_fp16" in f else fp32 / 4
        return {"float32": fp32, "float64": fp32 / 2, "bfloat16": bf16, "float16": fp16}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def total_memory_bytes() -> int:
    """Usable RAM in bytes: /proc/meminfo ``MemTotal``, capped by cgroup v2 ``memory.max`` / v1
    ``memory.limit_in_bytes``; falls back to ``os.sysconf`` and then to 8 GiB."""
    mem = 0
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", _read("/proc/meminfo"), re.M)
    if m:
        mem = int(m.group(1)) * 1024
    else:
        try:
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            mem = 8 * 2**30
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = _read(limit_file).strip()
        if text.isdigit() and 0 < int(text) < mem:
            mem = int(text)
    return mem


def usable_cores() -> int:
    """Cores this process may run on (affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cpu_info() -> CpuInfo:
    """Read this machine's CPU and memory facts (cheap: a few small /proc files)."""
    text = _read("/proc/cpuinfo")
    m = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    model = m.group(1).strip() if m else ""
    m = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    flags = frozenset(m.group(1).split()) if m else frozenset()
    m = re.search(r"@\s*([\d.]+)\s*GHz", model)
    clock = float(m.group(1)) * 1e9 if m else DEFAULT_CLOCK_HZ
    return CpuInfo(usable_cores(), total_memory_bytes(), model, flags, clock)


@dataclass(frozen=True)
class DeviceFigures:
    """Default figures for one device (rank): see :class:`adaptdist.cluster.Device` for units."""

    peak_flops: dict[str, float]
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    cores: float | None = None
    op_overhead_s: float | None = None


def cpu_rank_figures(info: CpuInfo, ranks_on_host: int) -> DeviceFigures:
    """Estimated (uncalibrated, conservative) figures of one CPU rank that shares the host with
    ``ranks_on_host - 1`` others.

    A rank gets ``cores / ranks_on_host`` cores (below 1 when oversubscribed), that share of
    :data:`CPU_PEAK_FRACTION` of the per-core peak FLOP/s, ``memory_bytes / ranks_on_host`` of RAM,
    that share of the host's DRAM bandwidth ``min(cores x 10 GB/s, 200 GB/s)``, and a host overhead per
    dispatched op of :data:`CPU_OP_OVERHEAD_S` x ``max(1, ranks_on_host / cores)`` seconds.
    """
    share = info.cores / ranks_on_host
    host_bw = min(info.cores * MEMORY_BANDWIDTH_PER_CORE_BYTES_PER_S, HOST_MEMORY_BANDWIDTH_CAP_BYTES_PER_S)
    return DeviceFigures(
        peak_flops={k: v * share * CPU_PEAK_FRACTION for k, v in info.peak_flops_per_core().items()},
        memory_bytes=info.memory_bytes // ranks_on_host,
        memory_bandwidth_bytes_per_s=host_bw / ranks_on_host,
        cores=share,
        op_overhead_s=CPU_OP_OVERHEAD_S * max(1.0, 1.0 / share),
    )


# name substring -> (float32, bfloat16/float16 dense tensor-core, float64, memory bandwidth B/s); datasheets
_CUDA_TABLE: tuple[tuple[str, float, float, float, float], ...] = (
    ("H200", 67e12, 989e12, 34e12, 4.8e12),
    ("H100", 67e12, 989e12, 34e12, 3.35e12),
    ("A100", 19.5e12, 312e12, 9.7e12, 2.0e12),
    ("L40S", 91.6e12, 362e12, 1.4e12, 0.864e12),
    ("V100", 15.7e12, 125e12, 7.8e12, 0.9e12),
)
_CUDA_GENERIC = ("generic", 19.5e12, 312e12, 9.7e12, 2.0e12)  # A100 figures
_CUDA_GENERIC_MEMORY_BYTES = 80 * 10**9


def cuda_figures(name: str = "", memory_bytes: int | None = None) -> DeviceFigures:
    """Datasheet figures of a CUDA device whose name contains H200, H100, A100, L40S or V100;
    A100-80GB figures otherwise. ``memory_bytes`` defaults to 80 GB."""
    row = next((r for r in _CUDA_TABLE if r[0].lower() in name.lower()), _CUDA_GENERIC)
    _, fp32, half, fp64, bw = row
    return DeviceFigures(
        peak_flops={"float32": fp32, "float64": fp64, "bfloat16": half, "float16": half},
        memory_bytes=memory_bytes if memory_bytes is not None else _CUDA_GENERIC_MEMORY_BYTES,
        memory_bandwidth_bytes_per_s=bw,
    )


# tier -> kind -> (bandwidth bytes/s, latency s)
_LINK_DEFAULTS = {
    # gloo over loopback TCP, per message of the ring formulas (communication.py): 0.9 GB/s and 0.5 ms give
    # a whole all_reduce of 2 ranks alpha 1.0 ms, 0.9 GB/s and of 4 ranks alpha 3.0 ms, 0.6 GB/s -- the slow
    # end of what was measured on the 2-core machine (DESIGN.md: 16 MiB 1.47 GB/s on 2 ranks, 0.60 GB/s on 4;
    # cluster profile inside steps: alpha 0.35-1.06 ms, 0.95-1.23 GB/s on 2 ranks, 3.1-5.2 ms, 0.49-0.62 GB/s
    # on 4); NVLink-class for cuda
    "intra_host": {"cpu": (9e8, 5e-4), "cuda": (1.0e11, 1e-5)},
    # 10 Gb/s Ethernet (1.25 GB/s raw) for gloo, assumed no faster than loopback (unmeasured);
    # 100 Gb/s InfiniBand / RoCE for nccl
    "inter_host": {"cpu": (8e8, 5e-4), "cuda": (1.25e10, 1e-5)},
}


def default_link(tier: str, kinds: set[str] | frozenset[str]) -> tuple[float, float]:
    """(bandwidth_bytes_per_s, latency_s) assumed for ``tier`` between devices of ``kinds``:
    the slowest kind wins (a CPU rank talks through gloo even on a GPU host)."""
    table = _LINK_DEFAULTS[tier]
    return min((table[k] for k in kinds), key=lambda bl: bl[0])
