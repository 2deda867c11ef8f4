"""Shared-memory collectives among the ranks of one host: groups, and the ops' Python API.

The ops (C++, ``csrc/shm_collectives.cpp``, registered in ``torch.ops.adaptdist``) mirror the signatures of
``torch.ops._c10d_functional``'s, so lowering a functional collective to shared memory changes the op and
nothing else; they are functional (out-of-place, return a new contiguous tensor), complete when they
return (no ``wait_tensor``), have Meta kernels (FakeTensor, torch.compile, make_fx) and appear by name in
FX graphs and saved rank programs::

    torch.ops.adaptdist.shm_all_reduce(Tensor input, str reduce_op, str group_name) -> Tensor
        reduce_op: "sum" | "avg" | "max"; float32, bfloat16, float16; output: input's shape
    torch.ops.adaptdist.shm_all_gather_into_tensor(Tensor input, int group_size, str group_name) -> Tensor
        output: group ranks' inputs concatenated along dim 0 (shape[0] * group_size; a 0-d input: (group_size,))
    torch.ops.adaptdist.shm_reduce_scatter_tensor(Tensor input, str reduce_op, int group_size, str group_name) -> Tensor
        input dim 0 divisible by group_size; output: this rank's reduced chunk (shape[0] / group_size)
    torch.ops.adaptdist.shm_all_to_all_single(Tensor input, SymInt[] output_split_sizes,
                                              SymInt[] input_split_sizes, str group_name) -> Tensor
        equal splits only (pass [] or [shape[0] / group_size] * group_size): chunk r of dim 0 goes to rank r,
        and the output's chunk q comes from rank q; uneven splits raise ValueError (use gloo for those)
    torch.ops.adaptdist.shm_broadcast(Tensor input, int src, str group_name) -> Tensor
        src is a *group* rank; every rank returns a copy of src's input

Started forms (all_reduce, all_gather, reduce_scatter; what the lowering uses where work sits between a collective
and its wait, as a functional collective and its ``wait_tensor``)::

    torch.ops.adaptdist.shm_all_reduce_start(...)  /  shm_all_gather_into_tensor_start(...)  /
    shm_reduce_scatter_tensor_start(...)          # the same arguments; returns the output, not yet filled
    torch.ops.adaptdist.shm_wait(Tensor output) -> Tensor   # waits for it, returns it; raises the collective's error

With the group's comm thread on, a started collective is queued on it behind the group's earlier ones (in order)
and the caller computes on; with it off it completes before the start returns (``shm_wait`` then returns at once).
Read a started output only through its ``shm_wait``, and do not write the input before it.

Registered inputs (as NCCL's user-buffer registration): each rank of a group has a 64 MiB input region in the
group's segment (virtual: pages are allocated as they are touched); :func:`input_buffer` returns a tensor on it.
An all_reduce (blocking or started) over 32 KiB whose input is a contiguous tensor in that region, at the same
offset and size on every rank, skips the copy-in: the rank that reduces slice r reads it straight from every
peer's region (same summation order, bitwise the same results), when every rank's output is its shared output
region (outputs of 256 KiB to 64 MiB, :data:`SHARED_OUTPUT_MIN_BYTES`, each at its registered input's offset of
the output region while no live output overlaps that range; otherwise, or when only some ranks registered, or at
different offsets, every rank falls back to the copy-in path, consistently, at the cost of one more barrier). Peers read a rank's region between the collective's first and last
barrier: do not write the input before the call (or its ``shm_wait``) returned. The dp lowering's fused op::

    torch.ops.adaptdist.shm_flatten_all_reduce_start(Tensor[] inputs, int input_offset_bytes, str reduce_op,
                                                     str group_name) -> Tensor
        the inputs (one dtype) flattened and concatenated into the input region at input_offset_bytes (a multiple
        of 64; the same on every rank), then shm_all_reduce_start of that 1-d tensor; where it does not fit the
        region: torch.cat + shm_all_reduce_start. Wait with shm_wait before writing the same bytes again.

All ranks of a group must call the same ops in the same order with the same dtypes and sizes (a mismatch
is detected and raised, naming the peer); inputs may be non-contiguous. all_gather, all_to_all and
broadcast also take float64 and integer/bool tensors (they only move bytes).

Summation order (the results are bitwise equal on every rank, for every size): each element is reduced
by one rank, over group ranks 0, 1, ..., n-1 in that order, accumulating in float32 (bfloat16/float16
too) and rounding once to the dtype; "avg" divides the float32 sum by n, then rounds; "max" propagates
NaN. Results equal gloo's within float rounding (gloo sums in another order, in the tensor's dtype).

Wiring (``--comm auto|shm|gloo``): for each mesh axis's gloo group, ``auto`` uses shm where
``adaptdist.kernels.available()`` on every rank (agree on it, e.g. all_gather the flag: all ranks of a group
must pick the same transport) and :func:`group_on_one_host` (a collective: the same answer everywhere);
``shm`` calls ``adaptdist.kernels.require("--comm shm")`` first (ShmUnavailableError, typed),
then :func:`init_group` on every rank of the group, after ``init_process_group`` and before the first step,
with ``timeout_s`` = the run's collective timeout and ``job_key`` = the rendezvous port (the default reads
``$MASTER_PORT``). Then rewrite ``torch.ops._c10d_functional.{all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single, broadcast}`` to the ``adaptdist.shm_*`` op of the same arguments and
drop its ``wait_tensor`` (or keep it: ``wait_tensor`` returns a tensor no collective is pending on unchanged). Wrap the step so that a
``RuntimeError`` goes through :func:`translate_error` (-> ShmPeerError, a CollectiveTimeoutError).

A group (what ``group_name`` names) is set up once per process and group, on every rank of it, by
:func:`init_group` (a collective over a gloo process group of the same ranks)::

    pg = dist.new_group([0, 1])                  # gloo, ranks on one host
    g = init_group(pg, timeout_s=120.0)          # g.name == pg.group_name by default
    y = torch.ops.adaptdist.shm_all_reduce(x, "sum", g.name)   # or g.all_reduce(x, "sum")

Group names are local to a process (the segment's real name comes from the rendezvous), so two groups of
the same size in one job never collide; within a process each name is used once. Naming the shm group
after the gloo group it shadows (the default) lets a pass swap ``_c10d_functional.X(..., group_name)`` for
``adaptdist.shm_X(..., group_name)`` unchanged. Whether a process group's ranks share a host:
:func:`group_on_one_host` (collective). Whether the kernels are there: ``adaptdist.kernels.available()``,
``adaptdist.kernels.load_error()``; ``adaptdist.kernels.require()`` raises ShmUnavailableError for an
explicit request (``--comm shm``) without them.

Failures: a peer that dies, stalls past ``timeout_s`` or issues another collective makes every rank of the
group raise within the timeout (a dead peer within about 0.1 s: liveness is checked every 50 ms of sleeping): from the op, ``torch.distributed.DistBackendError``
whose message starts with "adaptdist shm:" and names the peer (group rank, global rank, pid); the
:class:`ShmGroup` methods raise :class:`adaptdist.errors.ShmPeerError` (a CollectiveTimeoutError) instead, and
:func:`translate_error` converts one raised from a graph. The group is then unusable (every later op
raises at once); re-create the process group and this group after a restart.

Segments: ``/dev/shm/adaptdist-<job_key>-<pid>-<nonce>-<name>``, created by group rank 0 and unlinked as soon
as every rank attached, so the memory is freed by the kernel when the last rank exits, crash or not. A
segment left by a crash during :func:`init_group` is removed by the next :func:`init_group` with the same
job key (default: ``$MASTER_PORT``, the rendezvous port) once its creator is dead (:func:`remove_stale_segments`).

Waiting: a bounded spin (``spin_us``, default 20 us; none when the group has more ranks than this host
has cores), then futex sleeps on the group's arrival counter, which only the last rank to arrive wakes (one
wake-up per waiting rank and barrier), so oversubscribed ranks (4 ranks on 2 cores) do not burn the core a
peer needs. On a host busier than its cores (``init_group(comm_thread=)``; by default when the 1-minute load
average is at least the number of cores, or the group has more ranks than cores), each call runs on a thread of
the group's own while the calling thread sleeps, as gloo runs its collectives on a worker thread. There the
waiting thread is not the one that just computed, and a tensor-parallel step with 22 all_reduces went from 0.55x
to 1.6x gloo's speed (benchmarks/RESULTS.md). Blocking calls whose input is at most 32 KiB (one barrier) run on
the calling thread while that thread has nothing queued: a hand-over costs two thread wake-ups, far more than
such a call. Errors raised on that thread are re-raised to the caller unchanged.

Memory: each group maps ``5 * group_size * slot_bytes`` bytes of /dev/shm (default slot 4 MiB: 80 MiB for 4
ranks), a header, one 64 MiB output region and one 64 MiB registered-input region per rank. /dev/shm is a tmpfs,
where touching a page past its space kills the process (SIGBUS; Docker's default is 64 MiB for everything), so
nothing is touched before it is reserved (fallocate): the header and slots when the group is made
(:func:`segment_fixed_bytes`; without ``slot_bytes`` the slot halves, down to 1 MiB, until the slots take at most
a quarter of /dev/shm's free bytes: :func:`fitting_slot_bytes`; no room even so:
:class:`~adaptdist.errors.ShmCapacityError` on every rank, naming /dev/shm's size and free bytes and what to try),
and a region's range (1 MiB granules) before its first use: without room an all_reduce's output is private memory,
the fused flatten is ``torch.cat`` + all_reduce (the same results), and :func:`input_buffer` raises
ShmCapacityError. Payloads larger than a slot move in slot-sized chunks; payloads up to
32 KiB take one barrier (every rank reduces all of it). A larger all_reduce pipelines 1 MiB chunks (at most a
slot; they stay in the caches between a rank's copy-in and its peers' reads), one barrier per chunk: each rank
reduces its slice of chunk k (one SSE2 pass for float32 and bfloat16) while chunk k+1 comes in, writing the
result straight into its own output and into every peer's. An all_reduce output of 256 KiB to 64 MiB is a tensor
on the rank's output region of the segment (so the peers can write into it; no copy-out pass) once the caller has
dropped the tensor that used it before; otherwise (held, or larger) it lives in a private block the group keeps
and reuses the same way, or a fresh tensor, and the rank copies the peers' results out of the slots where they
also write them. Outputs of 4 MiB and more are written with non-temporal stores. So repeated large calls do not
page-fault a fresh buffer each time; an output tensor keeps the segment mapped after its group is destroyed.
Where the time goes: ``benchmarks/profile_shm.py`` (the kernel's phase timers, ``_shm_group_profile``);
figures in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import AdaptdistError, ShmCapacityError, ShmPeerError, UsageError
from . import require

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "adaptdist-"
DEFAULT_SLOT_BYTES = 4 << 20
MIN_SLOT_BYTES = 1 << 20  # the default slot halves down to this where /dev/shm is small (the all_reduce's chunk)
DEFAULT_TIMEOUT_S = 120.0
INPUT_REGION_BYTES = 64 << 20  # each rank's registered-input region (csrc: kSharedInBytes)
SHARED_OUTPUT_MIN_BYTES = 256 << 10  # all_reduce outputs from this size on go to the shared region (csrc: kReuseBytes)
_ERROR_TAG = "adaptdist shm:"
_CAPACITY_TAG = "[shm_capacity]"  # csrc: kCapacityTag, in errors caused by too little /dev/shm
_NEEDED_RE = re.compile(r" ?\[needed_bytes=(\d+)\]")
HEADER_BYTES = 64 << 10  # at least the segment's header (csrc: sizeof(Header), rounded up to 4096: about 12 KiB)
SLOT_BUFFERS = 5  # csrc: kBuffers
_PEER_RE = re.compile(r"\[peer_group_rank=(-?\d+) peer_global_rank=(-?\d+) peer_pid=(-?\d+)\]")
_GROUP_RE = re.compile(r"group '([^']*)'")


def _sanitize(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", str(text))[:limit] or "_"


def default_job_key() -> str:
    """The job key that segment names carry: ``$MASTER_PORT`` (the rendezvous port), else ``local``."""
    return _sanitize(os.environ.get("MASTER_PORT", "local"), 32)


def _host_id() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] not in "ZX"
    except (OSError, ValueError, IndexError):
        return True


def remove_stale_segments(job_key: str | None = None, shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove this job key's segments whose creating process is gone (left by a crash during
    :func:`init_group`); returns the names removed. Segments of live processes are kept."""
    job = _sanitize(job_key, 32) if job_key is not None else default_job_key()
    removed = []
    prefix = f"{SEGMENT_PREFIX}{job}-"
    try:
        entries = list(shm_dir.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        pid_text = entry.name[len(prefix):].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            try:
                entry.unlink()
                removed.append(entry.name)
            except FileNotFoundError:
                pass
    return removed


def segment_fixed_bytes(group_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> int:
    """(At most) the bytes of /dev/shm a group of ``group_size`` ranks reserves when it is made: its header and
    ``5 * group_size * slot_bytes`` of slots (made without ``slot_bytes``, at least ``slot_bytes=MIN_SLOT_BYTES``:
    :func:`fitting_slot_bytes`). Its output and input regions (64 MiB a rank each) are reserved as
    used, and used only where /dev/shm has room (else private memory: the results are the same)."""
    return HEADER_BYTES + SLOT_BUFFERS * int(group_size) * int(slot_bytes)


def fitting_slot_bytes(group_size: int, space: tuple[int, int] | None = None) -> int:
    """The slot size of a group of ``group_size`` ranks made without ``slot_bytes``: DEFAULT_SLOT_BYTES, halved
    (down to MIN_SLOT_BYTES, the pipelined all_reduce's chunk: only all_gather, reduce_scatter, all_to_all and
    broadcast then take more, smaller steps) while its slots take more than a quarter of /dev/shm's free bytes
    (``space``: ``(size_bytes, free_bytes)``; None: :func:`shm_space`), so that the groups made after it (the
    other axes', the other jobs') still find room for theirs: ``--comm auto`` counts MIN_SLOT_BYTES per group."""
    space = space if space is not None else shm_space()
    slot = DEFAULT_SLOT_BYTES
    if space is None:
        return slot
    while slot > MIN_SLOT_BYTES and 4 * segment_fixed_bytes(group_size, slot) > space[1]:
        slot //= 2
    return slot


def groups_fixed_bytes(group_sizes: Sequence[int], free_bytes: int) -> int:
    """The bytes of /dev/shm groups of ``group_sizes`` ranks reserve when made one after another (in that order) from
    ``free_bytes`` free: each takes :func:`fitting_slot_bytes` of what the ones before it left (the first ones may
    take larger slots than MIN_SLOT_BYTES while /dev/shm has room), so ``--comm auto`` counts what creation will
    take, not MIN_SLOT_BYTES for every group."""
    used = 0
    for n in group_sizes:
        slot = fitting_slot_bytes(int(n), (0, max(0, free_bytes - used)))
        used += segment_fixed_bytes(int(n), slot)
    return used


def shm_space(shm_dir: Path = SHM_DIR) -> tuple[int, int] | None:
    """``(size_bytes, free_bytes)`` of ``shm_dir`` (/dev/shm), or None where it cannot be read."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _capacity_error(text: str) -> ShmCapacityError:
    group = _GROUP_RE.search(text)
    needed = _NEEDED_RE.search(text)
    body = text[text.index(_ERROR_TAG):] if _ERROR_TAG in text else text
    body = _NEEDED_RE.sub("", body.replace(_CAPACITY_TAG, "")).strip()
    return ShmCapacityError(body, group.group(1) if group else None, int(needed.group(1)) if needed else None)


def translate_error(exc: BaseException) -> AdaptdistError | None:
    """The typed error for an exception raised by a ``torch.ops.adaptdist.shm_*`` op (None if not one):
    ``ShmCapacityError`` where /dev/shm had too little space; else ``ShmPeerError`` with the peer's group rank,
    global rank and pid when the message names them."""
    text = str(exc)
    if _ERROR_TAG not in text or isinstance(exc, (TypeError, ValueError)):
        return None
    if _CAPACITY_TAG in text:
        return _capacity_error(text)
    peer = _PEER_RE.search(text)
    group = _GROUP_RE.search(text)
    ranks = [int(v) for v in peer.groups()] if peer else [None, None, None]
    return ShmPeerError(text[text.index(_ERROR_TAG):].strip(), group.group(1) if group else None, *ranks)


def _ops():
    import torch

    return torch.ops.adaptdist


def _call(fn, *args):
    try:
        return fn(*args)
    except RuntimeError as exc:
        typed = translate_error(exc)
        if typed is None:
            raise
        raise typed from exc


@dataclass(frozen=True)
class ShmGroup:
    """A shared-memory group on this process: ``name`` (what the ops' ``group_name`` takes), this rank's
    ``group_rank`` of ``group_size``, the ``global_ranks`` in group-rank order, the ``segment`` name (already
    unlinked), ``timeout_s`` (collective timeout) and ``slot_bytes``. Methods run the ops and raise
    :class:`ShmPeerError` on a peer's failure."""

    name: str
    group_rank: int
    group_size: int
    global_ranks: tuple[int, ...]
    segment: str
    timeout_s: float
    slot_bytes: int

    def all_reduce(self, tensor, op: str = "sum"):
        return _call(_ops().shm_all_reduce, tensor, op, self.name)

    def all_gather(self, tensor):
        return _call(_ops().shm_all_gather_into_tensor, tensor, self.group_size, self.name)

    def reduce_scatter(self, tensor, op: str = "sum"):
        return _call(_ops().shm_reduce_scatter_tensor, tensor, op, self.group_size, self.name)

    def all_to_all(self, tensor):
        return _call(_ops().shm_all_to_all_single, tensor, [], [], self.name)

    def broadcast(self, tensor, src: int = 0):
        """``src`` is a group rank."""
        return _call(_ops().shm_broadcast, tensor, src, self.name)

    def input_buffer(self, numel: int, dtype: Any = None, offset_bytes: int = 0):
        """:func:`input_buffer` of this group."""
        return input_buffer(self.name, numel, dtype, offset_bytes)

    def pids(self) -> list[int]:
        return list(_ops()._shm_group_pids(self.name))

    def destroy(self) -> None:
        """Unmap the segment on this rank (idempotent); the name can then be used again."""
        destroy_group(self.name)


def input_buffer(group_name: str, numel: int, dtype: Any = None, offset_bytes: int = 0):
    """A 1-d tensor of ``numel`` elements of ``dtype`` (default float32) on this rank's registered input region of
    group ``group_name``, ``offset_bytes`` into it (a multiple of 64). Filling it and calling ``shm_all_reduce`` /
    ``shm_all_reduce_start`` on it (or on a contiguous part of it), at the same offset and size on every rank,
    skips the all_reduce's copy-in. Its contents persist between calls; it stays valid (the segment mapped) after
    the group is destroyed. Raises UsageError when ``offset_bytes`` is not a non-negative multiple of 64, or the
    buffer would not fit the region's INPUT_REGION_BYTES (64 MiB), naming the group, size and limit;
    ShmCapacityError when /dev/shm has no space left for the buffer's bytes (reserved here, once: a later touch
    cannot fail), naming the group, /dev/shm's size and free bytes, and what to try. That error is this rank's
    alone (no collective is entered): peers that got their buffers and call the all_reduce wait for this rank until
    the group's timeout (ShmPeerError); a caller of several ranks should agree on the outcome first, or use
    ``shm_flatten_all_reduce_start``, which falls back on every rank together."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel < 0 or offset_bytes < 0 or offset_bytes % 64:
        raise UsageError(f"input_buffer of shared-memory group '{group_name}': offset_bytes={offset_bytes} must be a "
                         f"non-negative multiple of 64 and numel={numel} non-negative")
    size_bytes = numel * itemsize
    if offset_bytes + size_bytes > INPUT_REGION_BYTES:
        raise UsageError(f"input_buffer of shared-memory group '{group_name}': {numel} elements of {dtype} "
                         f"({size_bytes} bytes) at offset {offset_bytes} exceed the rank's input region of "
                         f"{INPUT_REGION_BYTES} bytes; use a smaller buffer (or a plain tensor: the all_reduce "
                         "then copies it in)")
    return _call(_ops()._shm_group_input_buffer, group_name, int(offset_bytes), int(numel), dtype)


def destroy_group(name: str) -> None:
    """Unmap group ``name`` on this process (no-op if absent)."""
    _ops()._shm_group_destroy(name)


def group_names() -> list[str]:
    """Names of this process's shared-memory groups."""
    return list(_ops()._shm_group_names())


def all_reduce_counts() -> dict[str, int] | None:
    """Over this process's shared-memory groups, since the last reading: the all_reduces the pipelined kernel
    carried (inputs over 32 KiB) and how many of them read registered inputs in place (``in_place``: no copy-in;
    :func:`input_buffer`, a gradient bucket flattened by ``shm_flatten_all_reduce_start``). Reads and resets the
    groups' profile counters (``_shm_group_profile``). None without kernels or groups."""
    try:
        names = group_names()
    except Exception:  # noqa: BLE001 -- kernels not loaded
        return None
    if not names:
        return None
    calls = in_place = 0
    for name in names:
        prof = _ops()._shm_group_profile(name)
        calls += int(prof[5])
        in_place += int(prof[6])
    return {"calls": calls, "in_place": in_place}


def _destroy_all() -> None:
    try:
        for name in group_names():
            destroy_group(name)
    except Exception:  # noqa: BLE001 -- interpreter shutdown: best effort
        pass


def group_on_one_host(process_group: Any = None) -> bool:
    """Whether every rank of ``process_group`` (default: the world) runs on this host. A collective over it."""
    import torch.distributed as dist

    hosts: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(hosts, _host_id(), group=process_group)
    return len(set(hosts)) == 1


def init_group(process_group: Any = None, *, name: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
               job_key: str | None = None, slot_bytes: int | None = None,
               spin_us: float | None = None, comm_thread: bool | None = None) -> ShmGroup:
    """Create the shared-memory group of ``process_group``'s ranks (default: the world); call on each of them.

    ``process_group``: an initialised torch.distributed group (gloo) used for the rendezvous only.
    ``name``: the group's name for the ops (default ``process_group.group_name``); unique in this process.
    ``timeout_s``: the collective timeout (a stalled peer is named after it). ``job_key``: part of the
    segment's name (default ``$MASTER_PORT``). ``slot_bytes``: per-rank chunk (multiple of 4096; default:
    DEFAULT_SLOT_BYTES, smaller where /dev/shm has too little room for it, :func:`fitting_slot_bytes`, as group
    rank 0 finds it).
    ``spin_us``: how long a waiting rank spins before it sleeps. ``comm_thread``: run this rank's collectives of
    the group on a thread of its own while the caller sleeps, as gloo does (default: when the host is busier than
    its cores as the group is made: 1-minute load average >= cores, or more ranks than cores; on such a host it
    made bench_tp's step 2x faster, and on a quiet one the hand-over would add two thread wake-ups per call;
    ``$ADAPTDIST_SHM_COMM_THREAD`` = 1 or 0 overrides that default).

    Raises ShmUnavailableError (kernels not loaded), ShmCapacityError (/dev/shm has too little space left for
    the group's header and slots, :func:`segment_fixed_bytes`; on every rank), UsageError (ranks on different
    hosts, bad arguments), ShmPeerError (a rank did not attach within ``timeout_s``).
    """
    require("a shared-memory group (init_group)")
    import torch.distributed as dist

    pg = process_group if process_group is not None else dist.group.WORLD
    group_rank = dist.get_rank(pg)
    group_size = dist.get_world_size(pg)
    global_ranks = tuple(dist.get_process_group_ranks(pg))
    name = name if name is not None else pg.group_name
    if timeout_s <= 0:
        raise UsageError(f"init_group: timeout_s must be positive, got {timeout_s}")
    if slot_bytes is not None and (slot_bytes < 4096 or slot_bytes % 4096):
        raise UsageError(f"init_group: slot_bytes must be a positive multiple of 4096, got {slot_bytes}")
    if spin_us is None:
        # More ranks than cores: a waiting rank holds the core a missing peer needs, so it sleeps at once
        # (4 ranks on 2 cores, 16 MiB all_reduce: 4.5 ms per call with 0 us, 4.8 ms with 2 us, 5.4 ms with 50 us;
        # benchmarks/RESULTS.md, 2026-12-04).
        spin_us = 20.0 if group_size <= (os.cpu_count() or 1) else 0.0
    job = _sanitize(job_key, 32) if job_key is not None else default_job_key()

    hosts: list = [None] * group_size
    dist.all_gather_object(hosts, _host_id(), group=pg)
    if len(set(hosts)) != 1:
        by_host: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            by_host.setdefault(h.split("/")[0], []).append(global_ranks[r])
        raise UsageError(f"shared-memory group '{name}' spans several hosts (global ranks by host: {by_host}); "
                         "shared memory joins ranks of one host only: use gloo for this group (--comm auto or gloo)")

    ops = _ops()
    spin_ns = int(spin_us * 1000)
    message: list = [None]
    if group_rank == 0:
        remove_stale_segments(job)
        segment = f"/{SEGMENT_PREFIX}{job}-{os.getpid()}-{secrets.token_hex(4)}-{_sanitize(name, 64)}"
        if slot_bytes is None:
            slot_bytes = fitting_slot_bytes(group_size)
        try:
            ops._shm_group_attach(name, segment, 0, group_size, dist.get_rank(), slot_bytes, float(timeout_s),
                                  spin_ns, True)
            message[0] = ("ok", (segment, slot_bytes))
        except Exception as exc:  # noqa: BLE001 -- tell the peers, then raise the same everywhere
            text = str(exc)
            message[0] = ("capacity", text) if _CAPACITY_TAG in text else ("error", f"{type(exc).__name__}: {text}")
    dist.broadcast_object_list(message, src=global_ranks[0], group=pg)
    status, payload = message[0]
    if status == "capacity":
        raise _capacity_error(payload)
    if status != "ok":
        raise UsageError(f"shared-memory group '{name}': group rank 0 (global rank {global_ranks[0]}) could not "
                         f"create its segment: {payload}")
    segment, slot_bytes = payload
    if group_rank != 0:
        ops._shm_group_attach(name, segment, group_rank, group_size, dist.get_rank(), slot_bytes, float(timeout_s),
                              spin_ns, False)
    _call(ops._shm_group_wait_attached, name)
    if comm_thread is None and os.environ.get("ADAPTDIST_SHM_COMM_THREAD") in ("0", "1"):
        comm_thread = os.environ["ADAPTDIST_SHM_COMM_THREAD"] == "1"  # for side-by-side measurements
    if comm_thread is None:
        cores = os.cpu_count() or 1
        comm_thread = group_size > cores or os.getloadavg()[0] >= cores
    _call(ops._shm_group_set_comm_thread, name, bool(comm_thread))
    atexit.register(_destroy_all)
    return ShmGroup(name, group_rank, group_size, global_ranks, segment, float(timeout_s), slot_bytes)
