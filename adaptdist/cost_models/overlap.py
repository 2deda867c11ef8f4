"""Overlap of communication with computation: each rank's step as a two-stream timeline.

Each rank runs its program's nodes in order on one *compute stream*. A collective node
only *issues* the collective, which runs on that rank's *communication stream* for its
process group (one stream per group, collectives on a group run in issue order, as
NCCL and gloo process groups run them); the compute stream stops only at the
collective's ``wait_tensor``. So the computation a collective can overlap with is the
nodes between the collective and its wait in the rank program:

    ready_k  = max(issue time of k, finish of the previous collective on k's group)
    start_k  = max over k's group members of ready_k          (a collective starts when all joined)
    finish_k = start_k + max over members of duration_k
    at wait(k): clock = max(clock, finish_k); idle += what that adds

With one collective in flight this is "communication is hidden up to the length of the
computation between it and its wait; the rest is idle": idle_k = max(0, duration_k - window_k).
Idle also includes waiting for a slower peer (a heterogeneous cluster). Per rank,
``step = compute + idle``.

CPU ranks (gloo) get no second stream: :func:`~.estimate.rank_events` puts each collective's wait
right after its issue. gloo runs a collective on CPU threads of the rank's own process and, on one
host, moves the data by TCP loopback, so copying, reducing and the kernel's socket work take the
same cores the rank computes on; with one torch thread per core (``cluster profile`` and the
benchmarks' threads = usable cores // ranks) no core is left to overlap on. Measured on the 2-core
development machine (``benchmarks/RESULTS.md``, cost-model accuracy): dp with 1 MiB gradient
buckets, whose 10 ms of all_reduces the two-stream timeline hid behind backward but 1.3 ms, spent
15.9 ms per step in collective ops, as much as dp with one bucket after backward (15.6 ms).

Works on numbers and on sympy expressions (``max`` becomes an unevaluated ``Max``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..errors import CollectiveMismatchError
from .numbers import smax


@dataclass(frozen=True)
class Compute:
    """Computation on the compute stream, seconds."""

    duration_s: Any


@dataclass(frozen=True)
class Issue:
    """A collective issued on ``group``: node index ``collective`` of the program, running ``duration_s``."""

    collective: int
    group: str
    duration_s: Any


@dataclass(frozen=True)
class Wait:
    """The compute stream waits for collective ``collective`` (its node index)."""

    collective: int


Event = Compute | Issue | Wait


@dataclass(frozen=True)
class Timeline:
    """One rank's step: ``step_s = compute_s + idle_s``; ``communication_s`` is the sum of its collectives'
    durations (hidden or not)."""

    step_s: Any
    compute_s: Any
    communication_s: Any
    idle_s: Any


def merge_computes(events: Sequence[Event]) -> list[Event]:
    """Consecutive :class:`Compute` events merged into one (same timeline, fewer steps)."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, Compute) and out and isinstance(out[-1], Compute):
            out[-1] = Compute(out[-1].duration_s + e.duration_s)
        else:
            out.append(e)
    return out


def simulate(events_by_rank: Mapping[int, Sequence[Event]],
             members: Callable[[int, Issue], Sequence[int]] | None = None,
             define: Callable[[Any], Any] | None = None,
             record: dict[int, list[tuple]] | None = None) -> dict[int, Timeline]:
    """Run every rank's events on the two-stream timeline (module docstring).

    Args:
        events_by_rank: rank -> its events in program order. Every rank issues the same number of
            collectives, in the same order (the k-th collective of each rank is the same node).
        members: (rank, its k-th Issue) -> the ranks that take part; ranks not simulated are ignored
            (a symbolic estimate simulates one rank). Default: the rank alone.
        define: applied to every time the timeline takes a max of; a symbolic estimate names each one
            (a fresh symbol defined by the max), so times stay short expressions instead of nesting
            every earlier max. Default: identity.
        record: if given, filled with rank -> where each thing falls on its timeline, in time order per
            stream: ``("compute", start_s, end_s)``, ``("wait", start_s, end_s, collective)`` (the compute
            stream idle at a wait) and ``("collective", start_s, finish_s, collective)`` (on its group's
            communication stream, from the start all members joined to its finish).

    Returns:
        rank -> :class:`Timeline`, seconds.

    Raises:
        CollectiveMismatchError: ranks issue different numbers of collectives.
    """
    name = define or (lambda x: x)
    ranks = sorted(events_by_rank)
    evs = {r: list(events_by_rank[r]) for r in ranks}
    issues = {r: [i for i, e in enumerate(evs[r]) if isinstance(e, Issue)] for r in ranks}
    counts = {r: len(v) for r, v in issues.items()}
    if len(set(counts.values())) > 1:
        raise CollectiveMismatchError(f"ranks issue different numbers of collectives {counts}; they would hang")
    clock: dict[int, Any] = {r: 0 for r in ranks}
    idle: dict[int, Any] = {r: 0 for r in ranks}
    compute: dict[int, Any] = {r: 0 for r in ranks}
    comm: dict[int, Any] = {r: 0 for r in ranks}
    pos = {r: 0 for r in ranks}
    stream_free: dict[tuple[int, str], Any] = {}
    done: dict[tuple[int, int], Any] = {}

    def advance(r: int, stop: int) -> None:
        while pos[r] < stop:
            e = evs[r][pos[r]]
            if isinstance(e, Compute):
                if record is not None:
                    record.setdefault(r, []).append(("compute", clock[r], clock[r] + e.duration_s))
                clock[r] = clock[r] + e.duration_s
                compute[r] = compute[r] + e.duration_s
            elif isinstance(e, Wait):
                f = done.get((r, e.collective))
                if f is not None:
                    new = name(smax(clock[r], f))
                    idle[r] = idle[r] + (new - clock[r])
                    if record is not None and new != clock[r]:
                        record.setdefault(r, []).append(("wait", clock[r], new, e.collective))
                    clock[r] = new
            pos[r] += 1

    for k in range(counts[ranks[0]] if ranks else 0):
        ready = {}
        for r in ranks:
            advance(r, issues[r][k])
            e = evs[r][issues[r][k]]
            free = stream_free.get((r, e.group), 0)
            ready[r] = name(smax(clock[r], free)) if free != 0 else clock[r]
        for r in ranks:
            e = evs[r][issues[r][k]]
            group = [m for m in (members(r, e) if members else (r,)) if m in ready] or [r]
            start = smax(*(ready[m] for m in group)) if len(group) > 1 else ready[r]
            start = name(start) if len(group) > 1 else start
            durations = [evs[m][issues[m][k]].duration_s for m in group]
            duration = smax(*durations) if len(durations) > 1 else durations[0]
            finish = start + duration
            done[(r, e.collective)] = finish
            stream_free[(r, e.group)] = finish
            if record is not None:
                record.setdefault(r, []).append(("collective", start, finish, e.collective))
            comm[r] = comm[r] + e.duration_s
        for r in ranks:
            pos[r] = issues[r][k] + 1
    for r in ranks:
        advance(r, len(evs[r]))
    return {r: Timeline(clock[r], compute[r], comm[r], idle[r]) for r in ranks}
