"""LoweringOptions: how a plan is lowered into rank programs (bucket sizes, fallback, dumps, checks).

Defined once, with its defaults, in the data model: every front end (``adaptdist train``, ``plan``,
``estimate``, ``compile`` and the torch.compile backend) builds one, so the same captured graph, plan
and options give the same programs whichever command lowers them.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Iterator

from .comm_transport import COMM_MODES
from .errors import AdaptdistError, UsageError

MIB = 2**20

FRONT_ENDS = ("cli", "backend")
"""Where a lowering is asked for: the ``adaptdist`` command or ``adaptdist.backend(...)``; error advice
names that entry point's flags or arguments."""

BATCH_NORM_MODES = ("local", "sync")
"""``LoweringOptions.batch_norm``: how training-mode BatchNorm computes its statistics over a split batch."""

PRECISIONS = ("fp32", "bf16")
"""``--precision`` values (:mod:`adaptdist.compiler.training_features`): ``fp32`` (no autocast), ``bf16``
(``torch.autocast("cpu", torch.bfloat16)``); here, with no torch import, so that ``adaptdist --help`` needs none."""

RNG_MODES = ("per-rank", "global")
"""How random ops (dropout, ``rand_like`` ...) draw on a split batch: ``per-rank`` (DDP's: each rank draws its own
shard from its own generator) or ``global`` (every rank draws what one process draws on the whole batch and keeps
its shard: results independent of the world size; see ``passes/global_rng.py``)."""


@dataclass(frozen=True)
class LoweringOptions:
    """Settings of one lowering (:func:`adaptdist.compiler.lowering.lower`).

    Attributes:
        grad_bucket_bytes: target size of one gradient all_reduce / reduce_scatter bucket, bytes
            (``--bucket-mb``; 2 MiB: small buckets overlap with backward, measured faster in RESULTS.md).
        gather_bucket_bytes: target size of one bucket of parameter all_gathers, bytes.
        replicate_fallback: ops with no sharding rule gather their inputs and run whole on every rank
            (one warning lists them) instead of raising UnsupportedOpError.
        dump_dir: write the graph before and after each pass here, with an op-count diff (None: no dumps).
        debug: run the graph invariant checks of ``passes/README.md`` after every pass.
        disabled_passes: names of passes to skip (see ``lowering.PASSES``); for debugging a pass.
        front_end: ``"cli"`` or ``"backend"``: which entry point's flags error messages advise.
        rng: ``"per-rank"`` or ``"global"`` (:data:`RNG_MODES`; ``--rng``, ``backend(rng=...)``).
        batch_norm: training-mode BatchNorm over a split batch (``--batch-norm``, ``backend(batch_norm=...)``):
            ``"local"`` (DDP's semantics: each rank's statistics from its own rows; the running buffers of rank
            0 kept, as DDP broadcasts rank 0's) or ``"sync"`` (SyncBatchNorm's: statistics over the global
            batch, by all_reduce of per-channel sums and sums of squared deviations, and likewise in backward).
        comm: how collectives are carried (``--comm``, ``backend(comm=...)``; :mod:`adaptdist.comm_transport`):
            ``"auto"`` (shared-memory kernels on mesh axes whose ranks share a host, where the kernels are loaded
            and ``hosts`` is known), ``"shm"`` (required: ShmUnavailableError without the kernels) or ``"gloo"``.
        hosts: the host name of each rank of the plan's mesh (index = mesh rank), from the cluster the programs
            will run on; None: unknown (``auto`` then keeps gloo; ``shm`` assumes one host).
        shm_space: ``(size_bytes, free_bytes)`` of /dev/shm that ``auto`` fits the shared-memory groups into, the
            same on every rank (the backend lowers on each rank: rank 0's reading, agreed, so that no two ranks of a
            group choose different transports); None: read it where the lowering runs.

    Raises:
        UsageError: a bucket size below 1 byte, an unknown front end, rng mode, batch_norm mode or comm mode,
            disabled_passes not a tuple of names, or hosts not a tuple of host names.
    """

    grad_bucket_bytes: int = 2 * MIB
    gather_bucket_bytes: int = 4 * MIB
    replicate_fallback: bool = False
    dump_dir: str | None = None
    debug: bool = False
    disabled_passes: tuple[str, ...] = ()
    front_end: str = "cli"
    rng: str = "per-rank"
    batch_norm: str = "local"
    comm: str = "auto"
    hosts: tuple[str, ...] | None = None
    shm_space: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for name in ("grad_bucket_bytes", "gather_bucket_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"LoweringOptions.{name} must be an int >= 1 (bytes), got {v!r}")
        if not isinstance(self.replicate_fallback, bool):
            raise UsageError(f"LoweringOptions.replicate_fallback must be True or False, got {self.replicate_fallback!r}")
        if not isinstance(self.debug, bool):
            raise UsageError(f"LoweringOptions.debug must be True or False, got {self.debug!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, str):
            raise UsageError(f"LoweringOptions.dump_dir must be a directory path (str) or None, got {self.dump_dir!r}")
        if not isinstance(self.disabled_passes, tuple) or not all(isinstance(p, str) for p in self.disabled_passes):
            raise UsageError(f"LoweringOptions.disabled_passes must be a tuple of pass names, got {self.disabled_passes!r}")
        if self.front_end not in FRONT_ENDS:
            raise UsageError(f"LoweringOptions.front_end must be one of {FRONT_ENDS}, got {self.front_end!r}")
        if self.rng not in RNG_MODES:
            raise UsageError(f"LoweringOptions.rng must be one of {RNG_MODES} (--rng, adaptdist.backend(rng=...)), "
                             f"got {self.rng!r}")
        if self.batch_norm not in BATCH_NORM_MODES:
            raise UsageError(f"LoweringOptions.batch_norm must be one of {BATCH_NORM_MODES} ('local': each rank's "
                             f"statistics, as DDP; 'sync': over the global batch, as SyncBatchNorm), got "
                             f"{self.batch_norm!r}")
        if self.comm not in COMM_MODES:
            raise UsageError(f"LoweringOptions.comm must be one of {COMM_MODES} (--comm, adaptdist.backend(comm=...)), "
                             f"got {self.comm!r}")
        if self.shm_space is not None and (not isinstance(self.shm_space, tuple) or len(self.shm_space) != 2
                                           or not all(isinstance(v, int) and v >= 0 for v in self.shm_space)):
            raise UsageError(f"LoweringOptions.shm_space must be (size_bytes, free_bytes) or None, got "
                             f"{self.shm_space!r}")
        if self.hosts is not None and (not isinstance(self.hosts, tuple)
                                       or not all(isinstance(h, str) and h for h in self.hosts)):
            raise UsageError(f"LoweringOptions.hosts must be a tuple of host names (one per rank) or None, "
                             f"got {self.hosts!r}")

    @staticmethod
    def from_mb(bucket_mb: float | None = None, **kw) -> "LoweringOptions":
        """Options with the gradient bucket given in MiB (``--bucket-mb``, ``backend(bucket_mb=...)``); None: the
        default. Other keywords as the attributes.

        Raises:
            UsageError: ``bucket_mb`` not a number > 0.
        """
        if bucket_mb is None:
            return LoweringOptions(**kw)
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise UsageError(f"the gradient bucket size must be a number of MiB > 0, got {bucket_mb!r}")
        return LoweringOptions(grad_bucket_bytes=max(1, int(bucket_mb * MIB)), **kw)

    @property
    def bucket_mb(self) -> float:
        """:attr:`grad_bucket_bytes` in MiB."""
        return self.grad_bucket_bytes / MIB


_BACKEND_ADVICE: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"; without --nproc and --cluster a saved plan brings its mesh"), ""),
    (re.compile(r"(?:pass )?--replicate-fallback"), "pass adaptdist.backend(..., replicate_fallback=True)"),
    (re.compile(r"--batch-norm (\w+)"), r"adaptdist.backend(batch_norm='\1')"),
    (re.compile(r"\(--comm auto\|gloo\)"), "(adaptdist.backend(comm='auto') or comm='gloo')"),
    (re.compile(r"--mesh '?(\w+=\w+(?:,\w+=\w+)*)'?"), r"adaptdist.backend(mesh='\1')"),
    (re.compile(r"--mesh\b"), "adaptdist.backend(mesh=...)"),
    (re.compile(r"--plan ([\w./-]*\w(?:,\w+)*)"), r"adaptdist.backend(plan='\1')"),  # a preset or a plan file
    (re.compile(r"run with -v for the traceback"),
     "set logging.getLogger('adaptdist').setLevel(logging.DEBUG) for the traceback"),
    (re.compile(r"\(--nproc/--cluster\)"), "(the torchrun job)"),
    (re.compile(r"--nproc (\d+)(?:, or a cluster of that size)?"), r"torchrun --nproc-per-node \1"),
)
"""Command-line advice -> what ``adaptdist.backend(...)`` takes instead."""


def advice_for(message: str, front_end: str) -> str:
    """``message`` with its advice written for ``front_end``: the flags of the command line (``cli``, as
    written) or the arguments of ``adaptdist.backend(...)`` (``backend``)."""
    if front_end != "backend":
        return message
    for pattern, repl in _BACKEND_ADVICE:
        message = pattern.sub(repl, message)
    return message


@contextlib.contextmanager
def advice_fitting(front_end: str) -> Iterator[None]:
    """Re-raise any :class:`~adaptdist.errors.AdaptdistError` from the block with its advice written for
    ``front_end`` (:func:`advice_for`): the same error, its message rewritten."""
    try:
        yield
    except AdaptdistError as e:
        if front_end == "backend" and e.args and isinstance(e.args[0], str):
            fitted = advice_for(e.args[0], front_end)
            if fitted != e.args[0]:
                e.args = (fitted,) + e.args[1:]
        raise
