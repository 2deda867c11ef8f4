"""``adaptdist cluster detect``: a cluster file describing this machine, with estimated figures."""

from __future__ import annotations

from ..cluster import Cluster, Device, Host
from ..errors import ClusterSpecError
from . import hardware
from .local import default_links, local_cluster


def cuda_device_count() -> int:
    """Number of visible CUDA devices (0 without CUDA; imports torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device_kind(device_kind: str) -> str:
    """``auto`` -> ``cuda`` when CUDA devices are visible, else ``cpu``; other values pass through."""
    if device_kind == "auto":
        return "cuda" if cuda_device_count() > 0 else "cpu"
    return device_kind


def detect_local(nproc: int | None = None, device_kind: str = "auto") -> Cluster:
    """This machine as one host named ``localhost`` with ``nproc`` ranks, uncalibrated.

    CPU: the ranks share the usable cores and RAM (``/proc/meminfo``, cgroup limit) evenly;
    peak FLOP/s from the CPU's vector units (see :mod:`.hardware`). ``nproc`` defaults to 2.
    CUDA: one rank per visible device (``nproc`` defaults to all of them), memory from
    ``torch.cuda.get_device_properties``, FLOP/s and bandwidth from the datasheet of the device
    model when known.

    Raises:
        ClusterSpecError: ``nproc`` not positive, unknown kind, or more CUDA ranks than devices.
    """
    kind = resolve_device_kind(device_kind)
    if kind == "cpu":
        return local_cluster(2 if nproc is None else nproc, "cpu")
    if kind != "cuda":
        raise ClusterSpecError(f"--device-kind {device_kind!r} is not one of auto, cpu, cuda")
    import torch

    count = cuda_device_count()
    if count == 0:
        raise ClusterSpecError("--device-kind cuda, but torch sees no CUDA device here (torch "
                               f"{torch.__version__}); use --device-kind cpu")
    n = count if nproc is None else nproc
    if not isinstance(n, int) or n < 1:
        raise ClusterSpecError(f"--nproc must be a positive number of local ranks, got {nproc!r}; try --nproc 2")
    if n > count:
        raise ClusterSpecError(f"--nproc {n} cuda ranks, but this machine has {count} visible CUDA device(s); "
                               f"use --nproc {max(count, 1)} or --device-kind cpu")
    devices = []
    for r in range(n):
        props = torch.cuda.get_device_properties(r)
        fig = hardware.cuda_figures(props.name, int(props.total_memory))
        devices.append(Device(r, "localhost", "cuda", fig.peak_flops, fig.memory_bytes,
                              fig.memory_bandwidth_bytes_per_s))
    hosts = (Host("localhost", tuple(devices)),)
    return Cluster(hosts, default_links(hosts))


def describe_machine() -> str:
    """One line about this machine's CPU and memory, for file headers."""
    info = hardware.cpu_info()
    return (f"{info.model_name or 'unknown CPU'}, {info.cores} usable cores, "
            f"{info.memory_bytes / 2**30:.1f} GiB RAM")
