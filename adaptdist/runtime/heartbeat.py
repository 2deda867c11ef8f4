"""Per-step heartbeats in the job's store, and collective timeouts that name the rank that did not arrive.

A collective that times out fails on the ranks that arrived, and torch's error names the rank that raised
it: a healthy one. Each rank therefore writes ``step, time`` to the default group's store at every step
(:meth:`Heartbeat.beat`, one small ``set``: well under a millisecond locally), and a rank whose collective
failed calls :func:`named_timeout`: it marks itself as waiting at that step, gives the other ranks
``settle_s`` seconds to do the same (they time out at about the same moment), and names the ranks that
neither marked nor beat past the step -- stalled or dead -- with their last step and how long ago it was.

Ages are this rank's clock minus the beating rank's (the same clock on one machine; across hosts they hold
the hosts' clock skew). Under :mod:`adaptdist.runtime.launch` the store is made afresh by worker rank 0 at
every attempt, so no beat of an earlier attempt remains; under torch's agent-hosted store (plain torchrun)
keys outlive a restart, so beat once at the start of an attempt before relying on :meth:`Heartbeat.laggards`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .. import _torch_compat as compat
from ..errors import CollectiveTimeoutError, ShmPeerError

_PREFIX = "adaptdist/heartbeat"

_COLLECTIVE_FAILURES = ("timed out", "Timed out", "Timeout", "timeout", "Connection closed by peer",
                        "Connection reset by peer", "Broken pipe", "Connection refused", "Socket closed")
"""Fragments of the errors of a collective whose peer stalled or died (gloo, the store)."""


@dataclass(frozen=True)
class Laggard:
    """A rank behind the others: its last beat's ``step`` (None: it never beat) and ``age_s``, seconds since."""

    rank: int
    step: int | None
    age_s: float | None

    def describe(self) -> str:
        if self.step is None:
            return f"rank {self.rank} (no heartbeat yet)"
        return f"rank {self.rank} (last heartbeat at step {self.step}, {self.age_s:.1f} s ago)"


class Heartbeat:
    """This rank's heartbeats in the store of the job (default: the default process group's store).

    Args:
        rank: this rank.
        world_size: ranks in the job.
        store: a ``torch.distributed.Store``; default the default group's (``init_process_group`` first).
        collective_timeout_s: the ``--collective-timeout-s`` in force, named in errors; default the default
            group's timeout.

    Raises:
        RuntimeError: no store given and no default process group.
    """

    def __init__(self, rank: int, world_size: int, store: Any = None, *,
                 collective_timeout_s: float | None = None):
        self.rank = rank
        self.world_size = world_size
        self.store = compat.default_group_store() if store is None else store
        self.collective_timeout_s = (compat.default_group_timeout_s() if collective_timeout_s is None
                                     else collective_timeout_s)

    def _key(self, kind: str, rank: int) -> str:
        return f"{_PREFIX}/{kind}/{rank}"

    def beat(self, step: int) -> None:
        """Record that this rank reached ``step`` now (call it at the start of every step)."""
        self.store.set(self._key("beat", self.rank), f"{step} {time.time()!r}")

    def _read(self, kind: str) -> dict[int, tuple[int, float]]:
        """rank -> (step, time) of the ranks that wrote a ``kind`` key (never blocks on a missing one)."""
        out = {}
        for r in range(self.world_size):
            key = self._key(kind, r)
            if self.store.check([key]):
                step_s, time_s = self.store.get(key).decode().split()
                out[r] = (int(step_s), float(time_s))
        return out

    def last_beats(self) -> dict[int, tuple[int, float]]:
        """rank -> (last step, wall-clock time of that beat) for every rank that has beaten."""
        return self._read("beat")

    def laggards(self, step: int) -> list[Laggard]:
        """The ranks whose last beat is behind ``step`` (or who never beat), oldest beat first.

        Raises:
            the store's error (e.g. ``DistNetworkError``) when the store cannot be reached.
        """
        now = time.time()
        beats = self.last_beats()
        behind = [Laggard(r, *((beats[r][0], now - beats[r][1]) if r in beats else (None, None)))
                  for r in range(self.world_size) if r not in beats or beats[r][0] < step]
        return sorted(behind, key=lambda lag: -(lag.age_s if lag.age_s is not None else float("inf")))

    def mark_waiting(self, step: int) -> None:
        """Record that this rank's collective at ``step`` failed while it waited (see :func:`named_timeout`)."""
        self.store.set(self._key("waiting", self.rank), f"{step} {time.time()!r}")

    def waiting(self) -> dict[int, tuple[int, float]]:
        """rank -> (step, time) of the ranks that marked themselves waiting."""
        return self._read("waiting")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is how a collective fails when a peer stalls (a timeout) or dies (a lost connection)."""
    import torch.distributed as dist

    if isinstance(exc, (TimeoutError, ConnectionError, dist.DistError)):
        return True
    return isinstance(exc, RuntimeError) and any(frag in str(exc) for frag in _COLLECTIVE_FAILURES)


PEER_GONE = "its process is gone"
"""The shared-memory kernels' words for a peer whose process ended (csrc/shm_collectives.cpp)."""


def named_timeout(exc: BaseException, heartbeat: Heartbeat, step: int, *, settle_s: float = 2.0
                  ) -> BaseException:
    """``exc`` as a CollectiveTimeoutError naming the rank(s) that did not arrive at the collective of ``step``
    when it is a collective timeout or lost connection; ``exc`` itself otherwise. Use as
    ``except Exception as e: raise named_timeout(e, hb, step) from e``.

    Waits up to ``settle_s`` seconds for the other ranks to report that they were waiting too (ranks that
    time out together). A rank that neither reported nor beat past ``step`` is named with its last step and
    the age of its last beat; when the store is unreachable its host, rank 0, is named (it is likely dead).
    Never raises itself.
    """
    # a shared-memory collective's own error names its peer, but not whether it stalled or died: the heartbeats say
    if not isinstance(exc, ShmPeerError) and (isinstance(exc, CollectiveTimeoutError) or not is_collective_failure(exc)):
        return exc
    me = heartbeat.rank
    timeout = heartbeat.collective_timeout_s
    flag = f"--collective-timeout-s {timeout:g}" if timeout is not None else "the collective timeout"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    try:
        heartbeat.store.set_timeout(timedelta(seconds=max(1.0, settle_s)))
        heartbeat.mark_waiting(step)
        deadline = time.monotonic() + settle_s
        others = set(range(heartbeat.world_size)) - {me}
        while True:
            waiting = heartbeat.waiting()
            beats = heartbeat.last_beats()
            arrived = {r for r in others if (r in waiting and waiting[r][0] >= step)
                       or (r in beats and beats[r][0] > step)}
            if arrived == others or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    except Exception as store_exc:  # the store is gone: it lived on rank 0
        if me == 0:
            return CollectiveTimeoutError(
                f"rank 0: the collective of step {step} failed ({first}) and the job's store cannot be read "
                f"({type(store_exc).__name__}); a peer stalled or died, {flag}. Check the other ranks' logs.")
        return CollectiveTimeoutError(
            f"rank 0 did not arrive at the collective of step {step}: the job's store, which rank 0 hosts, "
            f"cannot be reached ({type(store_exc).__name__}), so rank 0 most likely died (rank {me} noticed: "
            f"{first}; {flag}). Check rank 0's log (an out-of-memory kill shows in dmesg); --max-restarts "
            f"restarts the job from its last checkpoint.")
    missing = sorted(others - arrived)
    now = time.time()
    if not missing:
        return CollectiveTimeoutError(
            f"rank {me}: every rank reached step {step} and its collective still failed ({first}; {flag}): the "
            f"ranks likely issued different collectives, or the network between them failed.")
    lags = [Laggard(r, *((beats[r][0], now - beats[r][1]) if r in beats else (None, None))) for r in missing]
    names = ", ".join(lag.describe() for lag in lags)
    if isinstance(exc, ShmPeerError) and PEER_GONE in str(exc) and missing == [exc.peer_global_rank]:
        # the shm kernel saw the peer's process end: it died, and this rank did not wait out the timeout
        return CollectiveTimeoutError(
            f"rank {missing[0]} died at the collective of step {step} ({PEER_GONE}): {names}; rank {me} noticed "
            f"at once ({first}). Check rank {missing[0]}'s log (an out-of-memory kill shows in dmesg); "
            f"--max-restarts restarts the job from its last checkpoint.")
    return CollectiveTimeoutError(
        f"{'rank' if len(missing) == 1 else 'ranks'} {', '.join(map(str, missing))} did not arrive at the "
        f"collective of step {step}: {names}; rank {me} waited {flag} ({first}). A rank that stalls (a slow "
        f"data loader, a checkpoint write, a debugger) or died: check its log; raise --collective-timeout-s if "
        f"it is only slow.")
