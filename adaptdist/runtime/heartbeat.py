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

import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
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
        status_dir: this attempt's rank records (``OUT/status/attempt{A}``, :mod:`adaptdist.runtime.rank_status`),
            read when a collective fails to tell a dead rank from one that exited after its own failure; the
            store's C++ warnings then go to ``rank{R}.debug.log`` there. None: the store alone.

    Raises:
        RuntimeError: no store given and no default process group.
    """

    def __init__(self, rank: int, world_size: int, store: Any = None, *,
                 collective_timeout_s: float | None = None, status_dir: str | Path | None = None):
        self.rank = rank
        self.world_size = world_size
        self.status_dir = Path(status_dir) if status_dir is not None else None
        self.debug_log = self.status_dir / f"rank{rank}.debug.log" if self.status_dir is not None else None
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


@dataclass(frozen=True)
class OwnFailure:
    """What this rank's own error says: the ``peer`` it waited on (None: unknown), in ``group`` (a mesh axis's
    ranks, e.g. ``dp[0,2]``; None: unknown), whether that peer's process ended or closed its connection
    (``lost``) rather than stalled, and the error's first line (``text``)."""

    peer: int | None
    group: str | None
    lost: bool
    text: str


@dataclass(frozen=True)
class PeerState:
    """Another rank as this rank knows it after a failed collective. ``kind``:

    - ``dead``: its process ended without a failure of its own (killed: SIGKILL, out of memory, a lost machine);
    - ``gone``: its process or connection is gone and nothing says whether it died or exited after a failure of
      its own (its record cannot be read here);
    - ``failed``: it exited (or is exiting) after an error of its own, ``detail`` (e.g. its own collective failed);
    - ``waiting``: its collective of this step failed too (alive);
    - ``ahead``: it beat past this step (alive);
    - ``silent``: alive as far as known, but it reported nothing: stalled, or blocked in a collective with a rank
      that waits on a dead one.

    ``step``/``age_s``: its last heartbeat and how long ago (None: unknown); ``how``: how its death is known."""

    rank: int
    kind: str
    step: int | None = None
    age_s: float | None = None
    detail: str | None = None
    how: str | None = None


def own_failure(exc: BaseException) -> OwnFailure:
    """The facts in this rank's own collective error (:class:`OwnFailure`)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    peer = getattr(exc, "peer_global_rank", None)
    group = getattr(exc, "group", None)
    if group is not None and group.startswith("adaptdist:"):
        group = group[len("adaptdist:"):]
    lost = getattr(exc, "peer_lost", None)
    if lost is None:
        lost = PEER_GONE in text or any(frag in text for frag in _LOST)
    return OwnFailure(peer, group, bool(lost), text)


_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused", "Socket closed")
"""Fragments of the errors of a collective whose peer's connection closed (it died or exited), not a stall."""


def _ranks(rs) -> str:
    rs = sorted(rs)
    return f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}"


def _beat(st: PeerState) -> str:
    if st.step is None:
        return "no heartbeat yet" if st.age_s is None else "no heartbeat readable"
    return f"last heartbeat at step {st.step}, {st.age_s:.1f} s ago"


def compose_failure(me: int, step: int, own: OwnFailure, states: dict[int, PeerState], *, waited_s: float | None,
                    timeout_s: float | None, settle_s: float, store_lost: bool = False
                    ) -> tuple[str, tuple[int, ...]]:
    """The message of rank ``me`` whose collective of ``step`` failed, and the ranks it found dead.

    ``states``: every other rank's :class:`PeerState`. The message names the dead rank(s) first when any is known
    (a rank this rank waited on that exited after its own failure is not one: it is named as the peer this rank
    waited on); otherwise the peer whose connection closed, as such; otherwise (a timeout) the ranks that did not
    arrive. ``waited_s``: how long this rank was in the step when it failed (the real wait, not the timeout).
    """
    flag = f"--collective-timeout-s {timeout_s:g}" if timeout_s is not None else "the collective timeout"
    where = f" in group {own.group}" if own.group else ""
    after = f"{waited_s:.1f} s into step {step}" if waited_s is not None else f"in step {step}"
    dead = sorted(r for r, st in states.items() if st.kind == "dead")
    silent = sorted(r for r, st in states.items() if st.kind == "silent")
    # the ranks that exited after a failure of their own, other than the peer: named only when no death is known
    failed = sorted(r for r, st in states.items() if st.kind == "failed" and r != own.peer and not dead)
    parts = []

    def peer_part() -> str:
        """What became of the peer this rank waited on (not a dead one): '' when unknown."""
        st = states.get(own.peer)
        if st is None:
            return ""
        if st.kind == "failed":
            return f"rank {own.peer}, which it waited on, exited after a failure of its own ({st.detail})"
        if st.kind == "gone":
            return (f"rank {own.peer}, which it waited on, is gone ({st.how}): it died, or exited after a failure of "
                    f"its own (check its log)")
        return f"rank {own.peer}, which it waited on, is {st.kind}"

    def others_part() -> str:
        out = ""
        if failed:
            out += (f"; {_ranks(failed)} exited after a failure of {'its' if len(failed) == 1 else 'their'} own (" +
                    "; ".join(f"rank {r}: {states[r].detail}" for r in failed) + ")")
        if silent:
            blame = f"waits on {_ranks(dead)}" if dead else "failed"
            out += (f"; {_ranks(silent)} reported no failure within {settle_s:g} s ("
                    + ("the store is unreachable, no heartbeat readable" if store_lost else
                       "; ".join(f"rank {r}: {_beat(states[r])}" for r in silent))
                    + "): alive as far as known, likely blocked in a collective of another group (a mesh axis, a "
                    f"pipeline transfer) with a rank that {blame}, not a cause")
        return out

    if dead:
        how = states[dead[0]].how if len(dead) == 1 else "; ".join(f"rank {r}: {states[r].how}" for r in dead)
        parts.append(f"{_ranks(dead)} died at the collective of step {step} ({how})")
        if own.peer in dead and own.lost:
            parts.append(f"; rank {me} noticed at once, {after}{where} ({own.text})")
        else:
            peer = peer_part()
            parts.append(f"; rank {me}'s collective failed {after}{where} ({own.text})" + (f": {peer}" if peer else ""))
        parts.append(others_part())
        parts.append(f". Check the log of {_ranks(dead)} (an out-of-memory kill shows in dmesg); --max-restarts "
                     "restarts the job from its last checkpoint.")
        return "".join(parts), tuple(dead)
    if own.lost and own.peer is not None:
        st = states.get(own.peer)
        if store_lost and own.peer == 0 and (st is None or st.kind == "gone"):
            parts.append(f"rank 0 did not arrive at the collective of step {step}: the job's store, which rank 0 "
                         f"hosts, cannot be reached ({st.how if st else 'no record'}), so rank 0 died or exited "
                         f"after a failure of its own; rank {me} noticed {after} ({own.text})")
        else:
            peer = peer_part()
            parts.append(f"rank {me}: the collective of step {step} failed {after}{where} ({own.text})"
                         + (f": {peer}" if peer else ""))
        parts.append(others_part())
        parts.append(". The rank that failed first is the cause: check its log; --max-restarts restarts the job "
                     "from its last checkpoint.")
        return "".join(parts), ()
    missing = sorted(r for r, st in states.items() if st.kind in ("silent", "gone"))
    if not missing:
        return (f"rank {me}: every rank reached step {step} and its collective still failed ({own.text}; {flag}): "
                f"the ranks likely issued different collectives, or the network between them failed."), ()
    waited = (f"waited {waited_s:.1f} s ({flag})" if waited_s is not None else f"waited {flag}")
    names = ", ".join(f"rank {r} ({_beat(states[r])})" for r in missing)
    return (f"{_ranks(missing)} did not arrive at the collective of step {step}: {names}; rank {me} {waited}"
            f"{where} ({own.text}). A rank that stalls (a slow data loader, a checkpoint write, a debugger) or died: "
            f"check its log; raise --collective-timeout-s if it is only slow."), ()


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (EPERM: it exists)
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2:].split()[0] not in ("Z", "X")
    except (OSError, ValueError, IndexError):
        return True


def read_records(status_dir: Path | None) -> dict[int, dict]:
    """rank -> this attempt's record (:mod:`adaptdist.runtime.rank_status`) of every rank whose record is readable."""
    out: dict[int, dict] = {}
    if status_dir is None:
        return out
    for p in Path(status_dir).glob("rank*.json"):
        try:
            rec = json.loads(p.read_text())
            out[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def peer_states(me: int, world_size: int, step: int, own: OwnFailure, *, waiting: dict, beats: dict,
                records: dict[int, dict], store_read: bool, now: float, host: str | None = None,
                alive=_pid_alive) -> dict[int, PeerState]:
    """Every other rank's :class:`PeerState` from what this rank can know: its own error (``own``), the store's
    ``waiting`` marks and ``beats`` (``store_read``: whether the store could be read at all) and the ranks'
    ``records`` of this attempt (``alive(pid)`` is asked of a record still ``running`` on this ``host``)."""
    host = socket.gethostname() if host is None else host
    reported_dead: dict[int, int] = {}
    for r, rec in records.items():
        for d in rec.get("dead_ranks") or ():
            reported_dead.setdefault(int(d), r)
    states = {}
    for r in range(world_size):
        if r == me:
            continue
        b = beats.get(r)
        step_r, age = (b[0], now - b[1]) if b else (None, None)
        rec = records.get(r)
        kw = dict(step=step_r, age_s=age)
        if rec is not None and rec.get("state") in ("failed", "stopped"):
            if rec.get("dead_ranks"):
                detail = f"its collective failed: it found {_ranks(rec['dead_ranks'])} dead"
            else:
                detail = (rec.get("error") or rec["state"]).split("; ")[0].split(". ")[0][:200]
            states[r] = PeerState(r, "failed", detail=detail, **kw)
        elif r in waiting and waiting[r][0] >= step:
            states[r] = PeerState(r, "waiting", **kw)
        elif b is not None and b[0] > step:
            states[r] = PeerState(r, "ahead", **kw)
        elif (rec is not None and rec.get("state") == "running" and rec.get("host") == host
              and rec.get("pid") is not None and not alive(int(rec["pid"]))):
            states[r] = PeerState(r, "dead", how=f"its process, pid {rec['pid']} on {host}, is gone and it recorded "
                                                 f"no error; its record is at step {rec.get('step') or 0}", **kw)
        elif r in reported_dead:
            states[r] = PeerState(r, "dead", how=f"rank {reported_dead[r]} saw its process end", **kw)
        elif own.lost and r == own.peer:
            if store_read or rec is not None:  # it would have marked itself waiting, or recorded its error
                states[r] = PeerState(r, "dead", how=PEER_GONE if PEER_GONE in own.text else
                                      "its connection closed and it reported no failure", **kw)
            else:
                states[r] = PeerState(r, "gone", how=PEER_GONE if PEER_GONE in own.text else "its connection closed",
                                      **kw)
        else:
            states[r] = PeerState(r, "silent", **kw)
    return states


@contextlib.contextmanager
def _stderr_to(path: Path | None):
    """Send this process's file descriptor 2 (the C++ store's warnings and stack frames) to ``path`` meanwhile."""
    if path is None:
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        yield
        return
    try:
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        empty = os.fstat(fd).st_size == 0
        os.close(fd)
        if empty:  # nothing was said: no file
            with contextlib.suppress(OSError):
                os.unlink(path)


def named_timeout(exc: BaseException, heartbeat: Heartbeat, step: int, *, settle_s: float = 2.0,
                  waited_s: float | None = None) -> BaseException:
    """``exc`` as a CollectiveTimeoutError naming the rank that died, or the rank(s) that did not arrive at the
    collective of ``step``, when it is a collective timeout or lost connection; ``exc`` itself otherwise. Use as
    ``except Exception as e: raise named_timeout(e, hb, step, waited_s=...) from e``.

    Marks this rank waiting and waits up to ``settle_s`` seconds for the other ranks to report that they were
    waiting too (ranks that time out together), unless the store's host is the peer this rank saw die. Then it
    sorts the other ranks (:func:`peer_states`) with the store's marks and heartbeats and, when the heartbeat has a
    ``status_dir``, the ranks' records of this attempt: a rank whose process ended without an error of its own
    died; one that recorded an error exited after its own failure (a rank waiting on it is not waiting on the
    cause); one that reported nothing is alive as far as known. ``waited_s``: how long this rank was in the step
    (the real wait, reported instead of the configured timeout). The store's C++ warnings go to the heartbeat's
    ``debug_log``. Never raises itself. The result's ``dead_ranks`` lists the ranks it found dead.
    """
    if isinstance(exc, CollectiveTimeoutError) and not isinstance(exc, ShmPeerError) and not exc.peer_lost:
        return exc
    if not isinstance(exc, CollectiveTimeoutError) and not is_collective_failure(exc):
        return exc
    me = heartbeat.rank
    own = own_failure(exc)
    others = set(range(heartbeat.world_size)) - {me}
    waiting: dict = {}
    beats: dict = {}
    store_read = False
    store_exc: BaseException | None = None
    if not (own.lost and own.peer == 0):  # rank 0 hosts the store: it is gone with it
        try:
            with _stderr_to(heartbeat.debug_log):
                heartbeat.store.set_timeout(timedelta(seconds=max(1.0, settle_s)))
                heartbeat.mark_waiting(step)
                deadline = time.monotonic() + settle_s
                while True:
                    waiting = heartbeat.waiting()
                    beats = heartbeat.last_beats()
                    store_read = True
                    arrived = {r for r in others if (r in waiting and waiting[r][0] >= step)
                               or (r in beats and beats[r][0] > step)}
                    if own.lost and own.peer is not None:
                        arrived.add(own.peer)  # its process is gone: no need to wait for its report
                    if arrived >= others or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
        except Exception as e:  # the store is gone: it lived on rank 0
            store_exc = e
    store_lost = not store_read
    if store_lost and own.peer is None:
        own = OwnFailure(0, "the job's store", True, own.text)  # rank 0 hosts the store: its connection is gone
    try:
        records = read_records(heartbeat.status_dir)
    except Exception:  # (never raise from here)
        records = {}
    states = peer_states(me, heartbeat.world_size, step, own, waiting=waiting, beats=beats, records=records,
                         store_read=store_read, now=time.time())
    if store_exc is not None and own.peer == 0 and states[0].kind == "gone":
        states[0] = PeerState(0, "gone", how=f"{type(store_exc).__name__}; no record of it readable here")
    if me == 0 and store_lost and not any(st.kind == "dead" for st in states.values()):
        return CollectiveTimeoutError(
            f"rank 0: the collective of step {step} failed ({own.text}) and the job's store cannot be read "
            f"({type(store_exc).__name__ if store_exc else 'unknown'}); a peer stalled or died. Check the other "
            f"ranks' logs.", peer_global_rank=own.peer, peer_lost=own.lost)
    msg, dead = compose_failure(me, step, own, states, waited_s=waited_s, timeout_s=heartbeat.collective_timeout_s,
                                settle_s=settle_s, store_lost=store_lost)
    return CollectiveTimeoutError(msg, peer_global_rank=own.peer, peer_lost=own.lost, dead_ranks=dead)
