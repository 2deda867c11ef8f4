"""Typed, user-facing errors.

Every error adaptdist raises for bad input derives from :class:`AdaptdistError`.
Its message is one paragraph that names what is wrong (node, op, shapes, mesh,
rank or file) and says what to try; the CLI prints it without a traceback.
"""

from __future__ import annotations


class AdaptdistError(Exception):
    """Base class of all user-facing adaptdist errors."""


class UsageError(AdaptdistError):
    """A command-line option or API argument has an invalid value."""


class CaptureError(AdaptdistError):
    """The model, example batch or loss function could not be captured as one joint graph."""


class ClusterSpecError(AdaptdistError):
    """A cluster description (YAML file or arguments) is invalid."""


class DataError(AdaptdistError):
    """Training data is missing, empty, not text, too short, or malformed (the message names the file and line)."""


class UnsupportedOpError(AdaptdistError):
    """An op in the joint graph has no sharding rule for the placements it receives."""


class ProgramLoadError(AdaptdistError):
    """Saved rank programs are missing, corrupted, or made for another setup."""


class RuntimeLaunchError(AdaptdistError):
    """Worker processes failed to start or one of them failed."""


class NotARunDirError(UsageError):
    """An output directory holds files with the names adaptdist writes (``checkpoints/``, ``programs/``, ``rank0/``,
    ...) but not the marker a previous adaptdist run or compile leaves (``run.json``, ``manifest.json``): it may be
    the user's, so nothing in it is replaced; the message names the directory, what it holds and what to do."""


class CheckpointError(AdaptdistError):
    """A checkpoint is missing, partial, corrupt (a checksum differs), or was written for another model; the
    message names the checkpoint directory, the file and what differs."""


class CollectiveMismatchError(AdaptdistError):
    """Ranks would issue different collectives (a hang at run time); raised at compile time."""


class SimulationError(AdaptdistError):
    """Ranks' programs run together in one process (:mod:`adaptdist.runtime.simulate`) would hang or mismatch
    at a collective; the message names the ranks, the group and the nodes."""


class PlanMismatchError(AdaptdistError):
    """A plan was made for another graph (model, batch shape or torch version)."""


class RankDivergenceError(PlanMismatchError):
    """Under the torch.compile backend, the ranks reached different compiled graphs at the same point of a step
    (a branch on data taken differently, a recompile on some ranks only); raised on every rank before any of
    that graph's collectives. The message names the ranks, each one's graph and frame, and what to do."""


class RankInputMismatchError(RankDivergenceError):
    """Under the torch.compile backend, a rank called the compiled model with inputs of other shapes or dtypes than
    the other ranks' and could not compile them (Dynamo's trace failed there: a feature dim the model does not take)
    or compiled a graph of its own; raised on every rank at once, naming the input, each rank's shape and what to
    do."""


class InternalError(AdaptdistError):
    """A compiler pass failed on a valid input: a bug in adaptdist; the message names the pass."""


class DeviceUnavailableError(ClusterSpecError):
    """A rank's device is not on the machine it runs on: a cuda rank where torch sees no CUDA, or a device index
    beyond ``torch.cuda.device_count()``; the message names the rank, its host and the device, and what to try."""


class PlanInfeasibleError(AdaptdistError):
    """No plan satisfies the constraints: a device's memory cannot hold the step, or user pins contradict
    each other or an op's strategies. The message names the constraints in words."""


class CollectiveTimeoutError(RuntimeLaunchError):
    """A collective timed out or lost its connection; the message names the rank(s) that did not arrive, their
    last step and how long ago it was, and the collective timeout.

    Optional facts for the other ranks' diagnosis (:func:`adaptdist.runtime.heartbeat.named_timeout`):
    ``peer_global_rank``, the peer this rank waited on (None: unknown); ``peer_lost``, whether that peer's
    process ended or closed its connection (True) rather than stalled (False; None: unknown); ``dead_ranks``,
    the ranks this rank found dead (killed without a word, not exited after a failure of their own)."""

    def __init__(self, message: str, *, peer_global_rank: int | None = None, peer_lost: bool | None = None,
                 dead_ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.peer_global_rank = peer_global_rank
        self.peer_lost = peer_lost
        self.dead_ranks = tuple(dead_ranks)


class ShmUnavailableError(UsageError):
    """Shared-memory collectives were asked for explicitly (``comm="shm"``) but adaptdist's C++ kernels are not
    built or could not be loaded on this machine; the message gives the load error and what to try."""


class ShmCapacityError(ShmUnavailableError):
    """/dev/shm (a tmpfs) has too little space left for a shared-memory group: its header and slots when the group
    is made, or a registered input buffer (:func:`adaptdist.kernels.shm.input_buffer`). The message names the group,
    /dev/shm's size and free bytes, the bytes needed, and what to try (``--comm gloo``; ``--comm auto`` falls back to
    gloo by itself; a bigger /dev/shm, e.g. ``docker run --shm-size=1g``). ``group``: the group's name (None where
    the message did not say); ``needed_bytes``: the bytes asked for (None where unknown)."""

    def __init__(self, message: str, group: str | None = None, needed_bytes: int | None = None):
        super().__init__(message)
        self.group = group
        self.needed_bytes = needed_bytes


class ShmPeerError(CollectiveTimeoutError):
    """A shared-memory collective failed because a peer died, stalled past the collective timeout or issued
    another collective. ``group`` is the group's name; ``peer_group_rank``, ``peer_global_rank`` and
    ``peer_pid`` name the peer (None where the message did not say)."""

    def __init__(self, message: str, group: str | None = None, peer_group_rank: int | None = None,
                 peer_global_rank: int | None = None, peer_pid: int | None = None):
        super().__init__(message, peer_global_rank=peer_global_rank,
                         peer_lost=None if peer_global_rank is None else "its process is gone" in message)
        self.group = group
        self.peer_group_rank = peer_group_rank
        self.peer_pid = peer_pid


class RunInterruptedError(RuntimeLaunchError):
    """The workers stopped on a signal (SIGTERM: a preemption notice; SIGINT: Ctrl-C) after agreeing on a step.

    ``signum`` is the signal's number and ``exit_code`` the code to exit with (128 + signum: 143, 130)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class PipelineError(UsageError):
    """A pipeline plan that cannot be lowered as asked: more stages than layers, microbatches that do not split
    the batch, a schedule that cannot use the count, a reduction over microbatches that depends on activations;
    the message names the numbers, layers or node and what to try."""


class PipelineScheduleError(PipelineError):
    """A pipeline schedule cannot run with these numbers (unknown schedule, too few microbatches for the stages, a
    count the schedule cannot split into rounds), or its action lists would deadlock; the message names the schedule,
    the stages and the microbatches, and says what would work."""
