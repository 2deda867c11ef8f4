"""A rank's device and the process-group backend of a job: one place that turns the cluster's device entries into
``torch.device``s.

- :func:`rank_devices`: each program rank's :class:`RankDevice` -- ``cpu``, or ``cuda:i`` where ``i`` counts the
  cuda devices of that rank's host in rank order (a host's cpu ranks take no GPU index).
- :func:`process_group_backend`: ``"gloo"`` for an all-cpu job; otherwise ``"cpu:gloo,cuda:nccl"`` (torch's
  per-device backend string, ``torch.distributed.init_process_group``): CUDA tensors go through nccl, CPU tensors
  through gloo. An all-cuda job keeps gloo for its CPU tensors too: the runtime's own small messages (the stop
  agreement, ``broadcast_object_list`` of paths, checkpoint flags) are CPU tensors, which nccl alone refuses.
- :func:`bind_device`: (in the rank's process) checks the device exists and makes it the current CUDA device
  (before ``init_process_group``, as nccl wants); :class:`~adaptdist.errors.DeviceUnavailableError` otherwise.
- :func:`to_exchange` / :func:`from_exchange`: where a CPU rank and a CUDA rank meet (``--mode async-hetero``'s
  messages) the tensor crosses as a CPU tensor over gloo, moved at that boundary.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..cluster import DEVICE_KINDS
from ..errors import ClusterSpecError, DeviceUnavailableError

CPU_BACKEND = "gloo"
MIXED_BACKEND = "cpu:gloo,cuda:nccl"


@dataclass(frozen=True)
class RankDevice:
    """Where one rank runs.

    Attributes:
        rank: the program rank.
        host: the cluster host its device is on.
        kind: ``"cpu"`` or ``"cuda"``.
        index: the CUDA device index on that host (None on cpu).
    """

    rank: int
    host: str
    kind: str
    index: int | None = None

    @property
    def name(self) -> str:
        """``"cpu"`` or ``"cuda:I"`` (what ``torch.device`` takes)."""
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.name)


def process_group_backend(kinds: Iterable[str]) -> str:
    """The ``init_process_group`` backend for ranks of these device kinds: ``"gloo"`` when all are cpu, else
    ``"cpu:gloo,cuda:nccl"`` (see the module docstring).

    Raises:
        ClusterSpecError: no kinds, or a kind that is not cpu or cuda.
    """
    found = set(kinds)
    bad = sorted(found - set(DEVICE_KINDS))
    if bad or not found:
        raise ClusterSpecError(f"device kinds {sorted(found)}: need at least one, each one of {sorted(DEVICE_KINDS)}")
    return CPU_BACKEND if found == {"cpu"} else MIXED_BACKEND


def rank_devices(cluster, rank_to_device: Sequence[int] | None = None) -> tuple[RankDevice, ...]:
    """Each program rank's device: program rank ``r`` runs on cluster device ``rank_to_device[r]`` (None: ``r``);
    a cuda device's index is its position among the cuda devices of its host, in rank order.

    Raises:
        ClusterSpecError: a mapping that names a rank the cluster lacks.
    """
    n = cluster.world_size
    mapping = tuple(rank_to_device) if rank_to_device is not None else tuple(range(n))
    index_of: dict[int, int] = {}
    for h in cluster.hosts:
        for i, d in enumerate(sorted((d for d in h.devices if d.kind == "cuda"), key=lambda d: d.rank)):
            index_of[d.rank] = i
    out = []
    for r, dev_rank in enumerate(mapping):
        d = cluster.device(dev_rank)
        out.append(RankDevice(r, d.host, d.kind, index_of.get(d.rank)))
    return tuple(out)


def check_device(device: RankDevice, cuda_available: bool, cuda_count: int) -> None:
    """That ``device`` exists on a machine where torch reports ``cuda_available`` and ``cuda_count`` GPUs.

    Raises:
        DeviceUnavailableError: a cuda rank without CUDA, or an index >= ``cuda_count``; names rank, host, device.
    """
    if device.kind != "cuda":
        return
    who = f"rank {device.rank} (host {device.host!r}, device {device.name})"
    if not cuda_available:
        raise DeviceUnavailableError(
            f"{who}: the cluster file puts this rank on a CUDA device, but torch {torch.__version__} sees no CUDA "
            "on this machine (a CPU-only torch build, or no driver/GPU); install a CUDA build of torch, or describe "
            "the rank as kind: cpu")
    if device.index is None or device.index >= cuda_count:
        raise DeviceUnavailableError(
            f"{who}: this machine has {cuda_count} CUDA device(s) (cuda:0..cuda:{cuda_count - 1}); the cluster file "
            f"describes more cuda devices on host {device.host!r} than that: describe at most {cuda_count}")


def bind_device(device: RankDevice) -> torch.device:
    """(In the rank's process) check ``device`` (:func:`check_device`) and make it the current CUDA device; returns
    its ``torch.device``.

    Raises:
        DeviceUnavailableError: see :func:`check_device`.
    """
    if device.kind == "cuda":
        check_device(device, torch.cuda.is_available(), torch.cuda.device_count() if torch.cuda.is_available() else 0)
        torch.cuda.set_device(device.index)
    return device.torch_device


def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``tensors`` on ``device`` (the same objects where they are there already)."""
    return tuple(t if t.device == device else t.to(device, non_blocking=True) for t in tensors)


def to_exchange(t: torch.Tensor) -> torch.Tensor:
    """``t`` as it crosses from a rank to a rank of another kind: a contiguous CPU tensor (sent through gloo)."""
    return (t.detach().cpu() if t.device.type != "cpu" else t).contiguous()


def from_exchange(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor received over gloo (CPU), on this rank's ``device``."""
    return t if t.device == device else t.to(device, non_blocking=True)


_DEVICE_LITERAL = re.compile(r"device\(type='(?:cpu|cuda|meta)'(?:, index=\d+)?\)")
"""A device argument as ``GraphModule.print_readable`` writes it into a rank program (``device(type='cpu')``,
``device(type='cuda', index=0)``)."""


def retarget_code(code: str, device: torch.device) -> str:
    """Rank-program source with every device argument (``device = device(type='cpu')`` of an ``arange``, ``full``,
    ...) naming ``device``: the program was captured on one device (cpu, or cuda:0 of the machine that compiled it)
    and runs on this rank's."""
    literal = f"device(type='{device.type}'" + (f", index={device.index})" if device.index is not None else ")")
    return _DEVICE_LITERAL.sub(literal, code)


def program_on_device(program, device: torch.device):
    """A copy of the :class:`~adaptdist.program.RankProgram` ``program`` that runs on ``device``: its code's device
    arguments retargeted (:func:`retarget_code`, re-executed when they changed) and its constants moved. Its
    ``state`` stays where it is (the step runner moves its own copy)."""
    import dataclasses

    from ..program import module_from_source

    code = retarget_code(program.code, device)
    module = program.module if code == program.code else module_from_source(code, f"<rank {program.rank} on {device}>")
    constants = {k: v.to(device) for k, v in program.constants.items()}
    for k, v in constants.items():
        setattr(module, k, v)
    return dataclasses.replace(program, code=code, module=module, constants=constants, _traced=None)
