"""runtime/trace.py and runtime/trace_view.py: the recorder, idle fractions, the Chrome trace's format, the
instrumented program, the predicted pipeline timeline, the pictures, and `train --trace` end to end."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from adaptdist.errors import AdaptdistError
from adaptdist.runtime.trace import (COMPUTE_KINDS, Span, TraceRecorder, chrome_trace, idle_fraction,
                                     instrument_collectives, merge_traces, nesting_lanes, track_tid)
from adaptdist.runtime.trace_view import (predicted_pipeline_spans, predicted_spmd_spans,
                                          write_trace_outputs)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _recorded(rank: int = 0, offset_s: float = 0.0):
    """A rank's 2 steps on a virtual clock: F 3 ms, 1 ms gap, B 4 ms with a send inside, optimizer 1 ms, in
    10 ms steps (so 2 ms of idle per step: the gap and the tail)."""
    clk = Clock()
    clk.t = 100.0 + offset_s
    rec = TraceRecorder(rank, clock=clk)
    rec.set_origin()
    for step in range(2):
        with rec.step(step):
            with rec.span("F", stage=0, microbatch=step):
                clk.t += 0.003
            clk.t += 0.001
            with rec.span("B", stage=0, microbatch=step):
                h = rec.begin("send", stage=0, microbatch=step, peer=1)
                clk.t += 0.004
                rec.end(h)
            with rec.span("optimizer"):
                clk.t += 0.001
            clk.t += 0.001
    return rec


def test_recorder_spans_and_idle_fraction():
    rec = _recorded()
    kinds = [s.kind for s in rec.spans]
    assert kinds.count("F") == kinds.count("B") == kinds.count("send") == kinds.count("optimizer") == 2
    send = next(s for s in rec.spans if s.kind == "send")
    assert send.lane == "comm" and send.args == {"peer": 1} and send.microbatch == 0 and send.step == 0
    assert [round(s.duration_s, 9) for s in rec.steps] == [0.01, 0.01]
    assert rec.idle_fraction() == pytest.approx(0.2)
    idle = rec.idle_spans()
    assert [(round(s.start_s, 6), round(s.end_s, 6)) for s in idle[:2]] == [(0.003, 0.004), (0.009, 0.01)]


def test_disabled_recorder_records_nothing_and_is_cheap():
    rec = TraceRecorder(0, enabled=False)
    assert rec.span("F") is rec.span("B", microbatch=1) is rec.step(0)  # one shared empty context
    with rec.step(0), rec.span("F"):
        rec.end(rec.begin("send"))
        rec.add("F", 0.0, 1.0)
    assert rec.spans == [] and rec.steps == []


def test_unknown_kind_is_refused():
    with pytest.raises(AdaptdistError, match="kind 'fwd'"):
        TraceRecorder(0).begin("fwd")


def test_waits_count_as_idle_inside_compute():
    rec = TraceRecorder(0, clock=Clock())
    steps = [Span(0, "step", 0.0, 1.0, step=0)]
    spans = [Span(0, "FB", 0.0, 0.8, step=0), Span(0, "wait", 0.5, 0.7, step=0)]
    assert idle_fraction(spans, steps) == pytest.approx(0.4)
    assert rec.idle_fraction() != rec.idle_fraction()  # nan: no steps


def test_merge_aligns_one_host_by_the_monotonic_clock():
    a, b = _recorded(0), _recorded(1, offset_s=0.5)
    trace = merge_traces([a.to_dict(), b.to_dict()])
    f0 = next(s for s in trace.spans if s.rank == 0 and s.kind == "F")
    f1 = next(s for s in trace.spans if s.rank == 1 and s.kind == "F")
    assert f1.start_s - f0.start_s == pytest.approx(0.5)
    assert "monotonic" in trace.alignment.lower()
    assert trace.idle_fractions() == pytest.approx({0: 0.2, 1: 0.2})
    other = dict(b.to_dict(), host="elsewhere")
    trace2 = merge_traces([a.to_dict(), other])
    assert "barrier" in trace2.alignment
    with pytest.raises(AdaptdistError, match="version"):
        merge_traces([dict(a.to_dict(), version=99)])


def _check_trace_event_format(doc):
    """The Trace Event Format's required fields (Chromium's "Trace Event Format" document): a JSON object with
    ``traceEvents``; complete events ``ph: X`` carry name, cat, ts and dur (microseconds, numbers), pid, tid;
    metadata events ``ph: M`` name a process or thread in ``args.name``."""
    json.loads(json.dumps(doc))  # plain JSON
    assert isinstance(doc["traceEvents"], list) and doc["displayTimeUnit"] in ("ms", "ns")
    xs = 0
    for ev in doc["traceEvents"]:
        assert ev["ph"] in ("X", "M"), ev
        assert isinstance(ev["name"], str) and isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        assert isinstance(ev["ts"], (int, float)), ev  # every event: DevTools' Performance panel reads ts of each
        if ev["ph"] == "X":
            xs += 1
            assert isinstance(ev["ts"], (int, float)) and isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0
            assert isinstance(ev["cat"], str) and isinstance(ev.get("args", {}), dict)
        else:
            assert ev["name"] in ("process_name", "thread_name", "process_sort_index", "thread_sort_index")
            assert "name" in ev["args"] or "sort_index" in ev["args"]
    return xs


def test_chrome_trace_has_the_required_fields():
    trace = merge_traces([_recorded(0).to_dict(), _recorded(1).to_dict()])
    pred = predicted_spmd_spans({0: (0.008, 0.001, 0.001), 1: (0.008, 0.001, 0.001)})
    doc = chrome_trace(trace, pred)
    xs = _check_trace_event_format(doc)
    assert xs == len(trace.spans) + 2 * 2 * 2 + len(trace.steps) + len(pred)  # spans, idle (2 per step), steps, predicted
    f = next(e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "F" and e["pid"] == 1)
    assert f["name"] == "F0" and f["tid"] == track_tid(1, 0) == 101
    assert f["args"] == {"step": 0, "stage": 0, "microbatch": 0}
    assert f["dur"] == pytest.approx(3000.0)
    send = next(e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "send")
    assert send["tid"] == track_tid(send["pid"], 1)
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1, 1000, 1001}


def _devtools_record_span_ms(doc):
    """What Chrome DevTools' Performance panel (``SDK.TracingModel.addEvents``, chrome-devtools-frontend 1.0.734346)
    takes for the trace's time range: the least non-zero ``ts`` of the B/X/I events and the greatest
    ``(ts + (dur || 0)) / 1000`` over every event, metadata included; JavaScript's ``undefined + 0`` is NaN."""
    starts = [ev["ts"] / 1000 for ev in doc["traceEvents"] if ev.get("ts") and ev["ph"] in ("B", "X", "I")]
    ends = [(ev.get("ts", float("nan")) + (ev.get("dur") or 0)) / 1000 for ev in doc["traceEvents"]]
    hi = float("nan") if any(e != e for e in ends) else max(ends, default=0.0)  # Math.max: one NaN makes NaN
    return min(starts, default=0.0), hi


def test_chrome_trace_metadata_carry_ts_so_devtools_finds_the_trace_end():
    """Metadata events carry ``"ts": 0`` and ``"cat": "__metadata"`` as Chrome's own traces do: without ``ts`` DevTools'
    Performance panel computed the trace's end as NaN, showed no time window and threw "RangeError: Maximum call
    stack size exceeded" (benchmarks/check_trace_viewer.py --devtools); each named thread has a sort index, so
    every viewer lists compute, communication, steps in that order (DevTools sorted them by name)."""
    trace = merge_traces([_recorded(0).to_dict(), _recorded(1).to_dict()])
    pred = predicted_spmd_spans({0: (0.008, 0.001, 0.001), 1: (0.008, 0.001, 0.001)})
    doc = json.loads(json.dumps(chrome_trace(trace, pred)))
    metas = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    assert metas and all(e["ts"] == 0 and e["cat"] == "__metadata" for e in metas)
    lo, hi = _devtools_record_span_ms(doc)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert hi == pytest.approx(max(e["ts"] + e["dur"] for e in xs) / 1000) and lo >= 0
    names = {(e["pid"], e["tid"]) for e in metas if e["name"] == "thread_name"}
    order = {(e["pid"], e["tid"]): e["args"]["sort_index"] for e in metas if e["name"] == "thread_sort_index"}
    assert set(order) == names and all(order[(p, t)] == t - track_tid(p, 0) for p, t in names)
    assert {(e["pid"], e["tid"]) for e in xs} <= names


def _unnested_slices(doc):
    """Complete events that a viewer nesting slices per (pid, tid) by their float ``ts`` and ``ts + dur`` (as
    speedscope's importer does) cannot nest: one that starts inside another and ends after it."""
    by_track = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    bad = []
    for track, evs in by_track.items():
        stack = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack and e["ts"] + e["dur"] > stack[-1]["ts"] + stack[-1]["dur"]:
                bad.append((track, stack[-1]["name"], e["name"]))
            stack.append(e)
    return bad


def _two_rank_records(start_s, rank_offset_s, steps, microbatches, idle_s, forward_s, backward_s, optimizer=None):
    """Two ranks' recorded pipeline steps (per microbatch: idle, F, then B around a send to the other rank; an
    optimizer span per step when ``optimizer`` is given), each rank's clock starting at ``start_s + rank *
    rank_offset_s``; the durations (s) come from the callables. Returns the ranks' ``to_dict()`` records."""
    recs = []
    for rank in (0, 1):
        clk = Clock()
        clk.t = start_s + rank * rank_offset_s
        rec = TraceRecorder(rank, clock=clk)
        rec.set_origin()
        for step in range(steps):
            with rec.step(step):
                for mb in range(microbatches):
                    clk.t += idle_s()
                    with rec.span("F", stage=rank, microbatch=mb):
                        clk.t += forward_s()
                    with rec.span("B", stage=rank, microbatch=mb):
                        h = rec.begin("send", stage=rank, microbatch=mb, peer=1 - rank)
                        clk.t += backward_s()
                        rec.end(h)
                if optimizer is not None:
                    with rec.span("optimizer"):
                        clk.t += optimizer()
        recs.append(rec.to_dict())
    return recs


def test_chrome_trace_adjacent_spans_nest_exactly_and_every_track_is_named():
    """A pipeline rank's forward, backward and the idle between them touch end to start at arbitrary clock values:
    the Chrome trace keeps them touching exactly (``ts + dur`` of one equals the next's ``ts`` as doubles), where
    rounding ``ts`` and ``dur`` to 3 decimals apart made them overlap by a nanosecond or an ulp and speedscope
    warned "Tried to end idle when F0 was on the top of the stack" (benchmarks/check_trace_viewer.py); every
    (pid, tid) with events, the predicted ranks' included, has a process and a thread name."""
    import random

    rng = random.Random(0)
    trace = merge_traces(_two_rank_records(1234.567891, 0.0001234567, 3, 4, lambda: rng.uniform(1e-4, 3e-3),
                                           lambda: rng.uniform(1e-3, 3e-2), lambda: rng.uniform(1e-3, 3e-2),
                                           optimizer=lambda: rng.uniform(1e-4, 1e-3)))
    pred = predicted_pipeline_spans({0: [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1)],
                                     1: [(1, "F", 0), (1, "B", 0), (1, "F", 1), (1, "B", 1)]},
                                    {(0, "F"): 0.0123456789, (0, "B"): 0.0234567891, (1, "F"): 0.0111111113,
                                     (1, "B"): 0.0222222227}, p2p_s=1.23456789e-4)
    doc = json.loads(json.dumps(chrome_trace(trace, pred)))  # as a viewer reads it
    _check_trace_event_format(doc)
    assert _unnested_slices(doc) == []
    tracks = {(e["pid"], e["tid"]) for e in doc["traceEvents"] if e["ph"] == "X"}
    assert {1000, 1001} <= {p for p, _ in tracks}
    assert {p for p, _ in tracks} <= {e["pid"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert tracks <= {(e["pid"], e["tid"]) for e in doc["traceEvents"] if e["name"] == "thread_name"}
    # adjacent spans touch exactly: each idle span ends where a compute span of its rank starts
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == track_tid(e["pid"], 0) and e["pid"] < 1000]
    starts = {(e["pid"], e["ts"]) for e in xs if e["cat"] in ("F", "B", "optimizer")}
    idles = [e for e in xs if e["cat"] == "idle" and (e["pid"], e["ts"] + e["dur"]) in starts]
    assert len(idles) >= 2 * 3 * 4 - 2
    # the grid keeps 125 ns of resolution
    f = next(s for s in trace.spans if s.kind == "F")
    ev = next(e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "F" and e["pid"] == f.rank)
    assert ev["ts"] == pytest.approx(f.start_s * 1e6, abs=0.0625) and ev["dur"] == pytest.approx(f.duration_s * 1e6,
                                                                                                  abs=0.125)
    assert _perfetto_import(doc) == ([], [])


def _perfetto_import(doc):
    """What Perfetto's JSON importer (trace processor v52, as the UI runs it) makes of ``doc``'s complete events, as
    ``(dropped, shared_tids)``: it converts ``ts`` and ``dur`` apart to integer nanoseconds (``llround(us * 1000.0)``;
    older versions truncate: both are checked), keys threads by ``tid`` alone (a system-wide id, as Linux's) and
    drops a complete event that starts inside another on its thread and ends after it
    (``slice_drop_overlapping_complete_event``)."""
    import math

    dropped, owner = [], {}
    for e in doc["traceEvents"]:
        owner.setdefault(e["tid"], set()).add(e["pid"])
    shared = sorted(t for t, pids in owner.items() if len(pids) > 1 or t == 0)
    for to_ns in (lambda us: math.floor(us * 1000.0 + 0.5), lambda us: math.trunc(us * 1000.0)):
        by_tid = {}
        for e in doc["traceEvents"]:
            if e["ph"] == "X":
                by_tid.setdefault(e["tid"], []).append((to_ns(e["ts"]), to_ns(e["ts"]) + to_ns(e["dur"]), e["name"]))
        for tid, evs in by_tid.items():
            stack = []
            for ts, end, name in sorted(evs, key=lambda x: (x[0], -x[1])):
                while stack and stack[-1][1] <= ts:
                    stack.pop()
                if stack and end > stack[-1][1]:
                    dropped.append((tid, stack[-1][2], name))
                    continue
                stack.append((ts, end, name))
    return dropped, shared


def test_chrome_trace_opens_in_perfetto_without_dropped_slices():
    """Perfetto's importer (see :func:`_perfetto_import`) keeps every slice: the 1/8 µs grid is whole nanoseconds,
    so its separate roundings of ``ts`` and ``dur`` keep touching spans touching (on the former 1/1024 µs grid 19
    of 220 slices of a 2-rank pipeline trace were dropped), and every (pid, lane) has its own ``tid`` (with tids 0,
    1, 2 in every process Perfetto merged rank 1's compute into another thread). Spans at clock values whose
    nanoseconds end in .5 are the hard case for rounding apart."""
    trace = merge_traces(_two_rank_records(100.0000000005, 1.0000000015, 2, 3, lambda: 0.0010000000005,
                                           lambda: 0.0020000000015, lambda: 0.0030000000025))
    pred = predicted_pipeline_spans({0: [(0, "F", 0), (0, "B", 0)], 1: [(1, "F", 0), (1, "B", 0)]},
                                    {(0, "F"): 0.0123456785, (0, "B"): 0.0234567895, (1, "F"): 0.0111111115,
                                     (1, "B"): 0.0222222225}, p2p_s=1.234565e-4)
    doc = json.loads(json.dumps(chrome_trace(trace, pred)))
    assert _perfetto_import(doc) == ([], [])
    assert _unnested_slices(doc) == []
    tracks = {(e["pid"], e["tid"]) for e in doc["traceEvents"] if e["ph"] == "X"}
    assert len(tracks) == len({t for _, t in tracks}) == 2 * 3 + 2 * 2  # 3 lanes per rank, 2 predicted
    assert {t for _, t in tracks} == {1, 2, 99, 101, 102, 199, 100001, 100002, 100101, 100102}


def test_nesting_lanes_by_hand():
    # (1, 3) starts inside (0, 2) and ends after it: a second lane; (1.5, 1.8) nests in (0, 2); (2, 4) touches it
    assert nesting_lanes([(0, 2), (1, 3), (1.5, 1.8), (2, 4), (2.5, 3.5), (3, 5)]) == [0, 1, 0, 0, 0, 1]
    assert nesting_lanes([]) == []


def test_chrome_trace_puts_collectives_in_flight_together_on_further_lanes():
    """Two receives posted together and completed in the order posted (as data parallelism's gradient buckets
    are: issued one after another, waited in the same order) overlap without nesting; on one thread Perfetto
    dropped the second and speedscope warned "Tried to end ..." (a DP run, benchmarks/check_trace_viewer.py). The
    second goes on a "communication #2" thread right after the first."""
    clk = Clock()
    rec = TraceRecorder(0, clock=clk)
    rec.set_origin()
    with rec.step(0):
        with rec.span("B"):
            h1 = rec.begin("recv", peer=1)
            clk.t += 0.001
            h2 = rec.begin("recv", peer=1)
            clk.t += 0.002
            rec.end(h1)
            clk.t += 0.001
            rec.end(h2)
    doc = json.loads(json.dumps(chrome_trace(merge_traces([rec.to_dict()]))))
    assert _perfetto_import(doc) == ([], []) and _unnested_slices(doc) == []
    recvs = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "recv"]
    assert sorted(e["tid"] for e in recvs) == [track_tid(0, 1), track_tid(0, 2)] == [2, 3]
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    order = {e["tid"]: e["args"]["sort_index"] for e in doc["traceEvents"] if e["name"] == "thread_sort_index"}
    assert names == {1: "compute", 2: "communication", 3: "communication #2", 99: "steps"}
    assert sorted(names, key=order.get) == sorted(names) == [1, 2, 3, 99]  # tid order is display order too


def test_predicted_gpipe_timeline_by_hand():
    # 2 stages on 2 ranks, 2 microbatches, GPipe: F 1 s, B 2 s, send 0.5 s
    acts = {0: [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1)],
            1: [(1, "F", 0), (1, "F", 1), (1, "B", 0), (1, "B", 1)]}
    spans = predicted_pipeline_spans(acts, {(0, "F"): 1.0, (1, "F"): 1.0, (0, "B"): 2.0, (1, "B"): 2.0}, p2p_s=0.5)
    got = {(s.rank, s.label()): (s.start_s, s.end_s) for s in spans if s.lane == "compute"}
    assert got == {(0, "F0"): (0, 1), (0, "F1"): (1, 2), (1, "F0"): (1.5, 2.5), (1, "F1"): (2.5, 3.5),
                   (1, "B0"): (3.5, 5.5), (1, "B1"): (5.5, 7.5), (0, "B0"): (6.0, 8.0), (0, "B1"): (8.0, 10.0)}
    assert sum(s.kind == "send" for s in spans) == 4


def test_predicted_timeline_refuses_a_deadlock_and_a_missing_action():
    times = {(0, "F"): 1.0, (1, "F"): 1.0, (0, "B"): 1.0, (1, "B"): 1.0}
    with pytest.raises(AdaptdistError, match="deadlocks: .*rank 0: B0 of stage 0"):
        predicted_pipeline_spans({0: [(0, "B", 0), (0, "F", 0)], 1: [(1, "F", 0), (1, "B", 0)]}, times)
    with pytest.raises(AdaptdistError, match="F0 of stage 0, which no rank"):
        predicted_pipeline_spans({1: [(1, "F", 0)]}, times)
    with pytest.raises(AdaptdistError, match="no predicted time for action W0"):
        predicted_pipeline_spans({0: [(0, "F", 0), (0, "B", 0), (0, "W", 0)]}, times)


def test_writers_png_html_json(tmp_path):
    for r in (0, 1):
        _recorded(r).save(tmp_path / "trace" / f"rank{r}.json")
    acts = {0: [(0, "F", 0), (0, "B", 0)], 1: [(1, "F", 0), (1, "B", 0)]}
    pred = predicted_pipeline_spans(acts, lambda s, k, m: 0.003 if k == "F" else 0.004, p2p_s=0.0005)
    res = write_trace_outputs(tmp_path / "trace", tmp_path, pred, notes=["a note"])
    assert res["idle_fraction"] == pytest.approx({0: 0.2, 1: 0.2})
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _check_trace_event_format(json.loads((tmp_path / "trace.json").read_text()))
    page = (tmp_path / "timeline.html").read_text()
    assert "<script" not in page and "src=" not in page and "<link" not in page  # self-contained
    assert page.count("<svg") == 2 and "predicted" in page and "a note" in page and "<title>rank 1 F stage 0" in page
    with pytest.raises(AdaptdistError, match="no rank"):
        write_trace_outputs(tmp_path / "nothing", tmp_path)


@pytest.fixture
def one_rank_group():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def test_instrumented_program_records_collectives_and_fb_and_keeps_values(one_rank_group):
    from torch.fx.experimental.proxy_tensor import make_fx

    name = one_rank_group

    def joint(w, x):  # a "forward" (the loss, with an all_reduce) then a "backward" (grad, all_reduced)
        h = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x @ w, "sum", name))
        loss = h.sum()
        g = torch.ops._c10d_functional.all_reduce(x.t() @ torch.ones_like(h), "sum", name)
        return loss, torch.ops._c10d_functional.wait_tensor(g)

    w, x = torch.randn(3, 2), torch.randn(4, 3)
    gm = make_fx(joint)(w, x)
    rec = TraceRecorder(0)
    rec.set_origin()
    inst = instrument_collectives(gm, rec, forward_outputs=[0])
    with rec.step(0), rec.span("FB", stage=1, microbatch=2):
        got = inst(w, x)
    want = gm(w, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    by = {k: [s for s in rec.spans if s.kind == k] for k in ("collective", "wait", "F", "B")}
    assert [len(v) for v in by.values()] == [2, 2, 1, 1]
    assert {s.args["op"] for s in by["collective"]} == {"all_reduce"}
    assert sorted(s.args["bytes"] for s in by["collective"]) == [4 * 3 * 2, 4 * 4 * 2]
    assert all(s.stage == 1 and s.microbatch == 2 and s.step == 0 for v in by.values() for s in v)
    f, b = by["F"][0], by["B"][0]
    assert f.end_s == b.start_s and f.start_s <= min(s.start_s for s in by["collective"])
    first = min(by["collective"], key=lambda s: s.start_s)
    assert f.start_s <= first.start_s <= first.end_s <= f.end_s  # the forward's all_reduce is inside F
    assert all(s.kind in COMPUTE_KINDS + ("wait",) for s in rec.spans if s.lane == "compute")


@pytest.mark.slow
def test_train_trace_writes_the_pictures(tmp_path):
    from adaptdist.cli import main

    out = tmp_path / "run"
    assert main(["train", "--steps", "2", "--out", str(out), "--sample-bytes", "0", "--trace", "--plan", "dp",
                 "--batch-size", "4", "--seq-len", "16", "--threads-per-rank", "1", "--timeout-s", "60"]) == 0
    for f in ("trace.json", "timeline.png", "timeline.html", "trace/rank0.json", "trace/rank1.json"):
        assert (out / f).is_file(), f
    doc = json.loads((out / "trace.json").read_text())
    _check_trace_event_format(doc)
    cats = {(e["pid"], e["cat"]) for e in doc["traceEvents"] if e["ph"] == "X"}
    for r in (0, 1):
        assert {(r, "F"), (r, "B"), (r, "collective"), (r, "optimizer"), (r, "step")} <= cats
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["idle_fraction"]) == {"0", "1"} and all(0 <= f < 1 for f in summary["idle_fraction"].values())


def test_predicted_timeline_takes_split_backwards_and_action_objects():
    from types import SimpleNamespace as A

    # zero-bubble style on 2 ranks, 1 microbatch: I and W apart; send/recv actions are left out
    acts = {0: [A(stage=0, kind="F", microbatch=0), A(stage=0, kind="SEND_F", microbatch=0),
                A(stage=0, kind="I", microbatch=0), A(stage=0, kind="W", microbatch=0)],
            1: [(1, "F", 0), (1, "I", 0), (1, "W", 0)]}
    spans = predicted_pipeline_spans(acts, {(0, "F"): 1, (1, "F"): 1, (0, "I"): 1, (1, "I"): 1, (0, "W"): 2,
                                            (1, "W"): 2})
    got = {(s.rank, s.label()): (s.start_s, s.end_s) for s in spans}
    assert got == {(0, "F0"): (0, 1), (1, "F0"): (1, 2), (1, "I0"): (2, 3), (1, "W0"): (3, 5),
                   (0, "I0"): (3, 4), (0, "W0"): (4, 6)}
