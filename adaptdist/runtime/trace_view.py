"""Pictures of a trace (:mod:`.trace`): the per-rank timeline as PNG and as a self-contained HTML page, the
measured run beside the planner's prediction, and the Chrome-trace JSON file.

The prediction is a list of :class:`~.trace.Span` like the measurement, made by
:func:`predicted_pipeline_spans` (a per-rank action list ``(stage, "F"|"B"|"W", microbatch)`` and predicted
seconds per action, run with the pipeline's dependencies), :func:`predicted_spmd_timeline_spans` (an SPMD step as
the cost model lays it out, each collective it counts on the comm lane: what ``train --trace`` draws) or
:func:`predicted_spmd_spans` (an SPMD step from the cost model's per-rank compute, exposed communication and
optimizer seconds alone). :func:`write_trace_outputs`
writes ``trace.json``, ``timeline.png`` and ``timeline.html`` (what ``adaptdist train --trace`` leaves in
``--out``).
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..errors import AdaptdistError
from .trace import COMPUTE_KINDS, Span, Trace, chrome_trace, idle_spans

COLOURS = {"F": "#4e79a7", "B": "#f28e2b", "I": "#e8a33d", "W": "#b07aa1", "FB": "#76b7b2", "optimizer": "#9c755f",
           "wait": "#d9d9d9", "idle": "#eeeeee", "send": "#e15759", "recv": "#59a14f", "collective": "#edc948"}
LEGEND = {"F": "forward", "B": "backward", "I": "backward: input grad", "W": "backward: weight grad", "FB": "forward+backward",
          "optimizer": "optimizer", "idle": "idle / waiting", "send": "send", "recv": "recv",
          "collective": "collective"}

Action = tuple[int, str, int]
"""``(stage, kind, microbatch)``: one action of a pipeline schedule on one rank; kind ``F``, ``B`` (the whole
backward), ``I`` / ``W`` (its input- and weight-gradient parts); an object with ``stage``, ``kind`` and
``microbatch`` attributes (``adaptdist.pipeline_schedules.Action``) is taken too, and its send/receive actions
(any other kind) are left out (``p2p_s`` stands for them)."""


def _action(a: Any) -> Action:
    if hasattr(a, "stage"):
        return (int(a.stage), str(a.kind), int(a.microbatch))
    s, k, m = a
    return (int(s), str(k), int(m))


def predicted_pipeline_spans(actions: Mapping[int, Sequence[Action]],
                             times_s: Mapping[tuple, float] | Callable[[int, str, int], float],
                             p2p_s: float = 0.0) -> list[Span]:
    """Run a pipeline schedule on the predicted times: each rank does its actions in order, each as soon as
    its rank is free and its inputs are there: ``F(s, m)`` after ``F(s-1, m)``, ``B(s, m)`` (or ``I(s, m)``)
    after ``F(s, m)`` and the backward (``B`` or ``I``) of ``(s+1, m)``, ``W(s, m)`` after ``I(s, m)`` (or
    ``B``); a dependency on another rank adds ``p2p_s`` seconds (the send), shown as a ``send`` span on the
    sender's comm lane.

    Args:
        actions: rank -> its actions ``(stage, kind, microbatch)`` in execution order.
        times_s: seconds per action: a mapping keyed by ``(stage, kind, microbatch)`` or ``(stage, kind)``,
            or a function ``(stage, kind, microbatch) -> seconds``.
        p2p_s: seconds of one stage-to-stage transfer.

    Returns:
        Spans (seconds from 0, ``step`` 0), per rank in time order.

    Raises:
        AdaptdistError: an action whose inputs no rank produces, or actions ordered so that the schedule
            deadlocks (names the ranks' next actions); a time missing from ``times_s``.
    """
    def dur(a: Action) -> float:
        if callable(times_s):
            return float(times_s(*a))
        for key in (a, a[:2]):
            if key in times_s:
                return float(times_s[key])
        raise AdaptdistError(f"no predicted time for action {a[1]}{a[2]} of stage {a[0]}; give times_s a value "
                             f"for {a!r} or {a[:2]!r}")

    actions = {r: [_action(a) for a in acts] for r, acts in actions.items()}
    actions = {r: [a for a in acts if a[1] in ("F", "B", "I", "W")] for r, acts in actions.items()}
    holders: dict[int, list[int]] = {}  # stage -> the ranks running it (several: data-parallel replicas)
    split = set()  # (stage, microbatch) whose backward is split into I and W
    for r in sorted(actions):
        for a in actions[r]:
            if r not in holders.setdefault(a[0], []):
                holders[a[0]].append(r)
            if a[1] == "I":
                split.add((a[0], a[2]))
    last_stage = max(holders) if holders else 0
    done: dict[tuple[Action, int], float] = {}
    free = {r: 0.0 for r in actions}
    pos = {r: 0 for r in actions}
    spans: list[Span] = []

    def deps(a: Action, r: int) -> list[tuple[Action, int]]:
        """(action, rank) pairs ``a`` on rank ``r`` waits for: the same replica's neighbour stage."""
        s, k, m = a
        def bw(st: int) -> Action:
            return (st, "I" if (st, m) in split else "B", m)

        if k == "F":
            need = [(s - 1, "F", m)] if s > 0 else []
        elif k in ("B", "I"):
            need = [(s, "F", m)] + ([bw(s + 1)] if s < last_stage else [])
        elif k == "W":
            need = [bw(s)]
        else:
            raise AdaptdistError(f"action kind {k!r} of stage {s} is not F, B, I or W")
        out = []
        for d in need:
            if d[0] not in holders:
                raise AdaptdistError(f"rank {r}'s action {k}{m} of stage {s} needs {d[1]}{d[2]} of stage {d[0]}, "
                                     "which no rank's action list holds")
            i = holders[s].index(r)
            out.append((d, r if d[0] == s else holders[d[0]][i % len(holders[d[0]])]))
        return out

    total = sum(len(v) for v in actions.values())
    while len(done) < total:
        progressed = False
        for r in sorted(actions):
            while pos[r] < len(actions[r]):
                a = tuple(actions[r][pos[r]])
                need = deps(a, r)
                if not all(d in done for d in need):
                    break
                ready = 0.0
                for d, owner in need:
                    t = done[(d, owner)]
                    if owner != r and p2p_s > 0:
                        spans.append(Span(owner, "send", t, t + p2p_s, "comm", 0, d[0], d[2], {"to": r}))
                        t += p2p_s
                    ready = max(ready, t)
                start = max(free[r], ready)
                end = start + dur(a)
                spans.append(Span(r, a[1], start, end, "compute", 0, a[0], a[2]))
                done[(a, r)] = end
                free[r] = end
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"rank {r}: {actions[r][pos[r]][1]}{actions[r][pos[r]][2]} of stage "
                              f"{actions[r][pos[r]][0]}" for r in sorted(actions) if pos[r] < len(actions[r]))
            raise AdaptdistError(f"the schedule deadlocks: every rank waits ({stuck}); reorder the actions")
    return sorted(spans, key=lambda s: (s.rank, s.start_s))


def stage_action_times(stage_times_s: Mapping[int, Mapping[str, float]]) -> dict[tuple[int, str], float]:
    """Seconds per ``(stage, kind)`` from each stage's predicted per-microbatch ``forward``, ``backward`` (the
    input-gradient part) and ``weight`` seconds (a ``StageSpec.predicted_s``): ``F`` forward, ``I`` backward,
    ``W`` weight, ``B`` (the whole backward, what every schedule but zb runs) backward + weight."""
    out: dict[tuple[int, str], float] = {}
    for s, t in stage_times_s.items():
        f, b, w = (float(t.get(k, 0.0)) for k in ("forward", "backward", "weight"))
        out.update({(s, "F"): f, (s, "I"): b, (s, "W"): w, (s, "B"): b + w})
    return out


def pipeline_actions(spec: Any, world_size: int) -> dict[int, list[Action]]:
    """Every global rank's compute actions of one step of the pipeline ``spec`` (a ``PipelineSpec``: its
    schedule, microbatches, stages per rank; a stage's ``ranks``, or stage group ``g`` on ranks ``g*n .. g*n+n-1``
    with ``n = world_size / groups``): the schedule's per pipeline rank list
    (:func:`adaptdist.pipeline_schedules.compute_order`), run alike by each data-parallel replica of a stage group.

    Raises:
        PipelineScheduleError: the schedule cannot run the counts (names them).
    """
    from ..pipeline_schedules import compute_order

    per = max(1, int(getattr(spec, "stages_per_rank", 1) or 1))
    groups = max(1, len(spec.stages) // per)
    n = max(1, world_size // groups)
    order = compute_order(spec.schedule, groups, int(spec.microbatches), per)
    out: dict[int, list[Action]] = {}
    for g, acts in order.items():
        st = spec.stages[g]
        for r in (tuple(st.ranks) if st.ranks else range(g * n, g * n + n)):
            out[int(r)] = [(a.stage, a.kind, a.microbatch) for a in acts]
    return out


def predicted_pipeline_of(spec: Any, world_size: int) -> list[Span]:
    """The planner's predicted timeline of one step of the pipeline ``spec`` (:func:`pipeline_actions` run on its
    stages' predicted seconds, :func:`stage_action_times`; the stage-to-stage sends are in the stages' times).

    Raises:
        AdaptdistError: a stage without predicted seconds (an even split the planner did not cost), or a
            schedule that cannot run the counts.
    """
    missing = [i for i, st in enumerate(spec.stages) if "forward" not in (st.predicted_s or {})]
    if missing:
        raise AdaptdistError(f"stage(s) {missing} of the pipeline have no predicted times (the layers were split "
                             "evenly, not by the planner)")
    times = stage_action_times({i: st.predicted_s for i, st in enumerate(spec.stages)})
    return predicted_pipeline_spans(pipeline_actions(spec, world_size), times)


def predicted_steps(spans: Sequence[Span]) -> list[Span]:
    """One ``step`` window per rank from 0 to the end of the last predicted span (every rank's step ends
    together, as a synchronous step does)."""
    end = max((s.end_s for s in spans), default=0.0)
    return [Span(r, "step", 0.0, end, "compute", 0) for r in sorted({s.rank for s in spans})]


def predicted_spmd_spans(per_rank: Mapping[int, tuple[float, float, float]]) -> list[Span]:
    """An SPMD step as the cost model predicts it, per rank ``(compute_s, exposed_communication_s,
    optimizer_s)`` (:class:`~adaptdist.cost_models.estimate.RankEstimate`'s ``compute_s``, ``idle_s``,
    ``optimizer_s``; ``compute_s`` includes the optimizer): forward+backward, then the communication not hidden
    as one ``wait`` (the model knows its total, not where each wait falls), then the optimizer."""
    out = []
    for r, (compute_s, idle_s, opt_s) in sorted(per_rank.items()):
        fb = max(compute_s - opt_s, 0.0)
        out.append(Span(r, "FB", 0.0, fb, "compute", 0))
        out.append(Span(r, "wait", fb, fb + idle_s, "compute", 0))
        out.append(Span(r, "optimizer", fb + idle_s, fb + idle_s + opt_s, "compute", 0))
    return out


def predicted_spmd_timeline_spans(per_rank: Mapping[int, Sequence[tuple]]) -> list[Span]:
    """An SPMD step as the cost model lays it out, per rank its parts ``(kind, start_s, end_s, args)`` in time
    order (:func:`~adaptdist.cost_models.timeline.predicted_segments` through ``segments_as_tuples``): ``compute``
    (forward+backward, an ``FB`` bar), ``optimizer``, ``wait`` (the compute lane idle until a collective ends) and
    ``collective`` (a bar on the comm lane, ``args`` its op, group, bytes and node name), so every collective the
    estimate counts (fsdp's all_gathers and reduce_scatters) is drawn where the model puts it."""
    out: list[Span] = []
    for r, parts in sorted(per_rank.items()):
        for kind, start, end, args in parts:
            if kind == "compute":
                prev = out[-1] if out and out[-1].rank == r and out[-1].kind == "FB" else None
                if prev is not None and abs(prev.end_s - start) <= 1e-12:
                    out[-1] = Span(r, "FB", prev.start_s, end, "compute", 0)  # one bar for touching parts
                    continue
                out.append(Span(r, "FB", start, end, "compute", 0))
            elif kind == "collective":
                out.append(Span(r, "collective", start, end, "comm", 0, args=dict(args)))
            elif kind in ("wait", "optimizer"):
                out.append(Span(r, kind, start, end, "compute", 0, args=dict(args)))
    return sorted(out, key=lambda s: (s.rank, s.start_s))


def shown_steps(trace: Trace, count: int = 1) -> list[int]:
    """The steps a picture shows: the last ``count`` (the first step, which warms up, only if nothing else)."""
    steps = sorted({s.step for s in trace.steps})
    later = steps[1:] or steps
    return later[-count:]


def _rows(spans: Sequence[Span], steps: Sequence[Span]) -> tuple[list[int], list[Span], float, float]:
    ranks = sorted({s.rank for s in steps} | {s.rank for s in spans})
    t0 = min((s.start_s for s in steps), default=min((s.start_s for s in spans), default=0.0))
    t1 = max((s.end_s for s in steps), default=max((s.end_s for s in spans), default=1.0))
    idle = []
    for r in ranks:
        idle += idle_spans([s for s in spans if s.rank == r], [s for s in steps if s.rank == r])
    return ranks, idle, t0, max(t1, t0 + 1e-9)


def _draw(ax: Any, spans: Sequence[Span], steps: Sequence[Span], title: str, span_s: float | None = None) -> None:
    ranks, idle, t0, t1 = _rows(spans, steps)
    if span_s is not None:
        t1 = t0 + span_s
    ms = 1e3
    height = 0.55
    for i, r in enumerate(ranks):
        y = len(ranks) - 1 - i
        for s in idle:
            if s.rank == r:
                ax.broken_barh([((s.start_s - t0) * ms, s.duration_s * ms)], (y - height / 2, height),
                               facecolors=COLOURS["idle"], edgecolor="none")
        for s in spans:
            if s.rank != r or s.kind in ("wait", "idle"):
                continue
            comm = s.lane == "comm"
            yy, hh = (y + height / 2, 0.28) if comm else (y - height / 2, height)
            ax.broken_barh([((s.start_s - t0) * ms, max(s.duration_s, 0.0) * ms)], (yy, hh),
                           facecolors=COLOURS.get(s.kind, "#888888"), edgecolor="white", linewidth=0.4)
            if s.microbatch is not None and not comm and s.duration_s > 0.025 * (t1 - t0):
                ax.text((s.start_s - t0 + s.duration_s / 2) * ms, y, str(s.microbatch), ha="center", va="center",
                        fontsize=7, color="white")
        for s in spans:  # waits on top of the span that waited
            if s.rank == r and s.kind == "wait":
                ax.broken_barh([((s.start_s - t0) * ms, s.duration_s * ms)], (y - height / 2, height),
                               facecolors=COLOURS["wait"], edgecolor="none")
        for st in steps:
            if st.rank == r:
                ax.axvline((st.start_s - t0) * ms, color="#999999", linewidth=0.5, linestyle=":")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in reversed(ranks)])
    ax.set_ylim(-0.6, len(ranks) - 0.4 + 0.3)
    ax.set_xlim(0, (t1 - t0) * ms)
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=9)


def timeline_figure(measured: Trace, predicted: Sequence[Span] = (), title: str = "",
                    steps: Sequence[int] | None = None, label: str = "measured") -> Any:
    """A matplotlib figure: one row per rank (compute lane as a bar, communication as a thin bar above it,
    idle light grey, microbatch numbers in the bars), measured on the left and, when ``predicted`` is given,
    the prediction on the right on the same kind of axes; ``steps`` (default :func:`shown_steps`) are shown;
    ``label`` names the left panel (``"predicted"`` when ``measured`` is itself a prediction)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    steps = list(steps) if steps is not None else shown_steps(measured)
    win = measured.window(steps)
    n = len(measured.ranks)
    cols = 2 if predicted else 1
    fig, axes = plt.subplots(1, cols, figsize=(6.5 * cols, 1.2 + 0.55 * n), squeeze=False)
    fracs = win.idle_fractions()
    idle_text = ", ".join(f"rank {r} {100 * f:.0f}%" for r, f in fracs.items())
    _, _, m0, m1 = _rows(win.spans, win.steps)
    span_s = m1 - m0
    if predicted:
        _, _, p0, p1 = _rows(predicted, predicted_steps(predicted))
        span_s = max(span_s, p1 - p0)  # one time scale for both panels
    _draw(axes[0][0], win.spans, win.steps, span_s=span_s, title=f"{label}, step{'s' if len(steps) > 1 else ''} "
                                            f"{', '.join(str(s + 1) for s in steps)} (idle: {idle_text})")
    kinds = {s.kind for s in win.spans}
    if predicted:
        psteps = predicted_steps(predicted)
        pf = {r: sum(s.duration_s for s in idle_spans([x for x in predicted if x.rank == r],
                                                      [x for x in psteps if x.rank == r])) / max(psteps[0].end_s,
                                                                                                   1e-12)
              for r in sorted({s.rank for s in predicted})}
        _draw(axes[0][1], predicted, psteps, "predicted (idle: " + ", ".join(f"rank {r} {100 * f:.0f}%"
                                                                             for r, f in pf.items()) + ")", span_s)
        kinds |= {s.kind for s in predicted}
    kinds.add("idle")
    handles = [Patch(color=COLOURS[k], label=LEGEND[k]) for k in LEGEND if k in kinds or (k == "idle")]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=7, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1 + 0.1 / max(n, 1), 1, 1))
    return fig


def timeline_png(path: str | os.PathLike, measured: Trace, predicted: Sequence[Span] = (), title: str = "",
                 steps: Sequence[int] | None = None) -> None:
    """Write :func:`timeline_figure` as a PNG (150 dpi)."""
    import matplotlib.pyplot as plt

    fig = timeline_figure(measured, predicted, title, steps)
    fig.savefig(path, dpi=150, format="png")
    plt.close(fig)


def _svg_rows(spans: Sequence[Span], steps: Sequence[Span], width: int = 640, span_s: float | None = None) -> str:
    """A hand-written SVG of one timeline (one row per rank), each bar with a ``<title>`` tooltip; ``span_s``
    seconds across (default: the timeline's own length)."""
    ranks, idle, t0, t1 = _rows(spans, steps)
    if span_s is not None:
        t1 = t0 + span_s
    row, left, top, right = 34, 62, 8, 34
    scale = (width - left - right) / (t1 - t0)
    h = top + row * len(ranks) + 28
    e = html.escape
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{h}' font-family='sans-serif' "
           "font-size='10'>"]

    def rect(s: Span, y: float, hh: float, colour: str, text: str | None) -> None:
        x = left + (s.start_s - t0) * scale
        w = max(s.duration_s * scale, 0.5)
        tip = (f"rank {s.rank} {s.kind}" + (f" stage {s.stage}" if s.stage is not None else "")
               + (f" microbatch {s.microbatch}" if s.microbatch is not None else "")
               + (f" step {s.step + 1}" if s.step is not None else "")
               + f": {1e3 * (s.start_s - t0):.3f} to {1e3 * (s.end_s - t0):.3f} ms ({1e3 * s.duration_s:.3f} ms)"
               + "".join(f"; {k} {v}" for k, v in s.args.items()))
        out.append(f"<rect x='{x:.2f}' y='{y:.2f}' width='{w:.2f}' height='{hh}' fill='{colour}' "
                   f"stroke='white' stroke-width='0.4'><title>{e(tip)}</title></rect>")
        if text and w > 14:
            out.append(f"<text x='{x + w / 2:.2f}' y='{y + hh / 2 + 3.5:.2f}' text-anchor='middle' fill='white'>"
                       f"{e(text)}</text>")

    for i, r in enumerate(ranks):
        y = top + row * i
        out.append(f"<text x='4' y='{y + 18}'>rank {r}</text>")
        for s in idle:
            if s.rank == r:
                rect(s, y + 8, 18, COLOURS["idle"], None)
        for s in spans:
            if s.rank == r and s.kind not in ("wait", "idle"):
                if s.lane == "comm":
                    rect(s, y + 1, 6, COLOURS.get(s.kind, "#888"), None)
                else:
                    rect(s, y + 8, 18, COLOURS.get(s.kind, "#888"),
                         str(s.microbatch) if s.microbatch is not None else None)
        for s in spans:
            if s.rank == r and s.kind == "wait":
                rect(s, y + 8, 18, COLOURS["wait"], None)
    y = top + row * len(ranks) + 14
    span_ms = 1e3 * (t1 - t0)
    for k in range(6):
        x = left + (width - left - right) * k / 5
        out.append(f"<line x1='{x:.1f}' y1='{y - 10}' x2='{x:.1f}' y2='{y - 6}' stroke='#555'/>"
                   f"<text x='{x:.1f}' y='{y + 4}' text-anchor='middle'>{span_ms * k / 5:.1f}</text>")
    out.append(f"<text x='4' y='{y + 4}'>ms</text></svg>")
    return "".join(out)


def timeline_html(measured: Trace, predicted: Sequence[Span] = (), title: str = "adaptdist trace",
                  steps: Sequence[int] | None = None, notes: Sequence[str] = ()) -> str:
    """A self-contained HTML page (no scripts, no network): the measured timeline beside the predicted one
    (SVG, a tooltip on every bar), a legend, and per rank its measured step time, busy and idle seconds by kind
    over every recorded step."""
    steps = list(steps) if steps is not None else shown_steps(measured)
    win = measured.window(steps)
    e = html.escape
    present = {s.kind for s in win.spans} | {s.kind for s in predicted} | {"idle"}
    legend = "".join(f"<span class='key'><span style='background:{COLOURS[k]}'></span>{e(v)}</span>"
                     for k, v in LEGEND.items() if k in present)
    _, _, m0, m1 = _rows(win.spans, win.steps)
    span_s = m1 - m0
    if predicted:
        _, _, p0, p1 = _rows(predicted, predicted_steps(predicted))
        span_s = max(span_s, p1 - p0)  # one time scale for both
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>"
             "body{font-family:sans-serif;margin:1.5em;max-width:1400px}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px;text-align:right}"
             ".pair{display:flex;flex-wrap:wrap;gap:24px}.key{margin-right:14px;font-size:12px}"
             ".key span{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:middle}"
             "</style></head><body>", f"<h1>{e(title)}</h1>"]
    parts += [f"<p>{e(n)}</p>" for n in notes]
    parts.append(f"<p>{legend}</p><div class='pair'><div><h3>measured, step{'s' if len(steps) > 1 else ''} "
                 f"{', '.join(str(s + 1) for s in steps)}</h3>{_svg_rows(win.spans, win.steps, span_s=span_s)}</div>")
    if predicted:
        parts.append(f"<div><h3>predicted</h3>{_svg_rows(predicted, predicted_steps(predicted), span_s=span_s)}</div>")
    parts.append("</div><p>Thin bars above a row: communication (a collective from its issue to the end of its "
                 "wait; sends and receives). Light grey: idle or waiting. Hover a bar for its times.</p>")
    kinds = [k for k in (*COMPUTE_KINDS, "send", "recv", "collective")
             if any(s.kind == k for s in measured.spans)]
    parts.append("<h2>Per rank, every recorded step</h2><p>Milliseconds summed over the steps (a collective's "
                 "from its issue to the end of its wait, so it overlaps compute).</p><table><tr><th>rank</th>"
                 "<th>steps</th><th>median step ms</th>"
                 + "".join(f"<th>{e(k)} ms</th>" for k in kinds) + "<th>idle ms</th><th>idle fraction</th></tr>")
    for r in measured.ranks:
        st = sorted(s.duration_s for s in measured.steps if s.rank == r)
        med = st[len(st) // 2] if st else float("nan")
        mine = [s for s in measured.spans if s.rank == r]
        idle = sum(s.duration_s for s in idle_spans(mine, [s for s in measured.steps if s.rank == r]))
        parts.append(f"<tr><td>{r}</td><td>{len(st)}</td><td>{1e3 * med:.3f}</td>"
                     + "".join(f"<td>{1e3 * sum(s.duration_s for s in mine if s.kind == k):.3f}</td>" for k in kinds)
                     + f"<td>{1e3 * idle:.3f}</td><td>{measured.idle_fraction(r):.3f}</td></tr>")
    parts.append(f"</table><p>Clocks: {e(measured.alignment)}. The same spans are in trace.json "
                 "(open it in chrome://tracing or https://ui.perfetto.dev).</p></body></html>")
    return "\n".join(parts)


def write_trace_outputs(trace_dir: str | os.PathLike, out_dir: str | os.PathLike, predicted: Sequence[Span] = (),
                        title: str = "adaptdist trace", notes: Sequence[str] = ()) -> dict[str, Any]:
    """Merge the rank traces in ``trace_dir`` (:func:`~.trace.load_traces`) and write ``trace.json``,
    ``timeline.png`` and ``timeline.html`` into ``out_dir``. Returns ``{"files": [...], "idle_fraction":
    {rank: fraction}}``.

    Raises:
        AdaptdistError: no rank traces in ``trace_dir``.
    """
    from .trace import load_traces

    trace = load_traces(trace_dir)
    if not trace.steps:
        raise AdaptdistError(f"the traces in {str(trace_dir)!r} hold no step; was any step trained?")
    out = Path(out_dir)
    files = []
    for name, write in (("trace.json", lambda p: p.write_text(json.dumps(chrome_trace(trace, predicted)))),
                        ("timeline.png", lambda p: timeline_png(p, trace, predicted, title)),
                        ("timeline.html", lambda p: p.write_text(timeline_html(trace, predicted, title,
                                                                               notes=notes)))):
        tmp = out / f".{name}.tmp"
        write(tmp)
        tmp.replace(out / name)
        files.append(str(out / name))
    return {"files": files, "idle_fraction": trace.idle_fractions()}
