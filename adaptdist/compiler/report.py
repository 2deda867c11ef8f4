"""``report.html``: what a compiled artifact directory holds, for people to look at.

One self-contained HTML file (no scripts, no network): the mesh drawn as a grid of ranks, the
parameter placements per layer pattern as a picture and a table (buffers and frozen parameters in a table
of their own), the predicted step time and memory per rank (the cost model's
:class:`~adaptdist.cost_models.estimate.StepEstimate`) as stacked bars, the two predictions of the step
(the planner's ILP objective and the cost model on the lowered programs) side by side with what each
includes, the collectives per step, and, when the plan has them, its pipeline stages
(:class:`PipelineView`, :func:`pipeline_view`) and its rank-to-device mapping (:class:`RankMappingView`,
:func:`rank_mapping_view`); a pipeline plan's collectives and sends per step, predicted time and state per rank
(:mod:`.pipeline_report`, the cost model's estimate not covering pipelines) and, in the placements, the stage
holding each parameter on the ``pp`` axis. Pictures are matplotlib SVG, inlined.
"""

from __future__ import annotations

import html
import io
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

_LAYER = re.compile(r"\.(\d+)\.")


def _svg(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def mesh_figure(mesh: Mapping[str, int], hosts: list[str]) -> str:
    """Ranks as a grid: rows the outer axes, columns the innermost axis; colour = host."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, sizes = list(mesh), list(mesh.values())
    cols = sizes[-1]
    rows = max(1, len(hosts) // cols)
    host_ids = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    fig, ax = plt.subplots(figsize=(min(1.0 + 0.7 * cols, 14), min(0.8 + 0.6 * rows, 10)))
    cmap = plt.get_cmap("Pastel1")
    for r in range(len(hosts)):
        y, x = divmod(r, cols)
        ax.add_patch(plt.Rectangle((x, -y - 1), 0.95, 0.95, color=cmap(host_ids[hosts[r]] % 9)))
        if len(hosts) <= 256:
            ax.text(x + 0.47, -y - 0.53, str(r), ha="center", va="center", fontsize=8)
    ax.set_xlim(0, cols)
    ax.set_ylim(-rows, 0)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    outer = " x ".join(f"{a}={n}" for a, n in zip(names[:-1], sizes[:-1])) or "one row"
    ax.set_title(f"mesh {', '.join(f'{a}={n}' for a, n in mesh.items())}: columns {names[-1]}, rows {outer}; "
                 "colour = host", fontsize=9)
    return _svg(fig)


def placement_rows(param_placements: Mapping[str, list[str]], fqns: list[str], mesh: Mapping[str, int]
                   ) -> list[tuple[str, list[str], int]]:
    """(pattern, placement per axis, count): parameters differing only in a layer index and placed alike."""
    rows: dict[tuple[str, tuple[str, ...]], int] = {}
    for f in fqns:
        pls = tuple(param_placements.get(f, ["R"] * len(mesh)))
        key = (_LAYER.sub(".*.", f), pls)
        rows[key] = rows.get(key, 0) + 1
    return [(pattern, list(pls), n) for (pattern, pls), n in rows.items()]


def placement_figure(rows: list[tuple[str, list[str], int]], mesh: Mapping[str, int]) -> str:
    """Rows = parameter patterns, columns = mesh axes; colour = replicated, the sharded dim, or (the ``pp`` axis of
    a pipeline) the stage holding it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ["R", "S(0)", "S(1)", "S(2)", "S(3)"]
    colours = ["#dddddd", "#4e79a7", "#f28e2b", "#59a14f", "#e15759"]
    shown = rows[:60]
    fig, ax = plt.subplots(figsize=(2.0 + 1.2 * len(mesh), 0.6 + 0.22 * len(shown)))
    for i, (_, pls, _) in enumerate(shown):
        for j, p in enumerate(pls):
            c = colours[kinds.index(p)] if p in kinds else ("#f1ce63" if p.startswith("stage") else "#b07aa1")
            ax.add_patch(plt.Rectangle((j, -i - 1), 0.95, 0.9, color=c))
            ax.text(j + 0.47, -i - 0.55, p, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(mesh))
    ax.set_ylim(-len(shown), 0)
    ax.set_xticks([j + 0.47 for j in range(len(mesh))], list(mesh))
    ax.xaxis.tick_top()
    ax.set_yticks([-i - 0.55 for i in range(len(shown))], [f"{p} (x{n})" if n > 1 else p for p, _, n in shown],
                  fontsize=7)
    ax.set_title("parameter placement per mesh axis", fontsize=9, pad=18)
    return _svg(fig)


def estimate_figure(est: Any) -> str:
    """Stacked bars per rank: predicted time (compute, exposed communication) and memory at the peak; each
    chart's legend below it, the charts far enough apart that no axis label or legend reaches the other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted(est.ranks)
    rs = [est.ranks[r] for r in ranks]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(min(7.5 + 0.5 * len(ranks), 16), 3.8), layout="constrained")
    fig.get_layout_engine().set(wspace=0.12)
    x = list(range(len(ranks)))
    comp = [1e3 * float(r.compute_s) for r in rs]
    idle = [1e3 * float(r.idle_s) for r in rs]
    a1.bar(x, comp, label="compute (incl. optimizer step)")
    a1.bar(x, idle, bottom=comp, label="communication not hidden")
    a1.set_ylabel("ms per step")
    a1.set_title("predicted step time (lowered programs)", fontsize=9)
    parts = [("parameters", "params_bytes"), ("gradients", "grads_bytes"), ("optimizer state", "optimizer_state_bytes"),
             ("activations and other", "activations_bytes")]
    bottom = [0.0] * len(rs)
    for label, attr in parts:
        vals = [float(getattr(r.memory, attr)) / 2**20 for r in rs]
        a2.bar(x, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a2.set_ylabel("MiB at the peak")
    a2.set_title("predicted peak memory", fontsize=9)
    for ax in (a1, a2):
        ax.set_xticks(x, [str(r) for r in ranks], fontsize=8 if len(ranks) <= 16 else 6)
        ax.set_xlabel("rank")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    return _svg(fig)


def param_and_buffer_fqns(fqns: Sequence[str], param_fqns: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """``fqns`` (the program's state inputs) split into the trainable parameters and the rest (buffers and
    frozen parameters); with ``param_fqns`` None every name counts as a parameter."""
    if param_fqns is None:
        return list(fqns), []
    trained = set(param_fqns)
    return [f for f in fqns if f in trained], [f for f in fqns if f not in trained]


def predictions_table(planner_prediction: Any | None, estimate: Any | None) -> str:
    """The two predicted step times a report can hold, side by side, with what each one counts: the
    planner's ILP objective (:class:`~adaptdist.compiler.planner.search.Evaluation`: the captured graph's
    compute, op overhead and every collective's full time, no optimizer step, no overlap; the planner ranks
    plans by it) and the cost model on the lowered programs (:class:`~adaptdist.cost_models.estimate.
    StepEstimate`, the slowest rank: compute of the programs as lowered including the optimizer step, plus only
    the communication the timeline does not hide). Empty when there is neither."""
    if planner_prediction is None and estimate is None:
        return ""
    rows: list[tuple[str, str, str]] = []

    def ms(v: Any) -> str:
        return "-" if v is None else f"{1e3 * float(v):.3f}"

    ev = planner_prediction
    worst = max(estimate.ranks.values(), key=lambda r: float(r.step_s)) if estimate is not None else None
    comm_ilp = sum(ev.communication_s.values()) if ev is not None else None
    rows.append(("compute of the graph's ops", ms(ev.compute_s) if ev else "-",
                 ms(float(worst.compute_s) - float(worst.optimizer_s)) if worst else "-"))
    rows.append(("op dispatch overhead", ms(ev.overhead_s) if ev else "-", "(inside compute)" if worst else "-"))
    rows.append(("optimizer step", "not counted" if ev else "-", ms(worst.optimizer_s) if worst else "-"))
    rows.append(("communication", (ms(comm_ilp) + " (all of it)") if ev else "-",
                 (f"{ms(worst.idle_s)} not hidden, of {ms(worst.communication_s)}") if worst else "-"))
    rows.append(("<b>step</b>", f"<b>{ms(ev.step_s)}</b>" if ev else "-", f"<b>{ms(worst.step_s)}</b>" if worst else "-"))
    if ev is None:  # a manual plan: the planner did not run
        return ("<h2>Predicted step time</h2><p>The cost model's estimate on the lowered programs (the slowest rank"
                + (f", rank {worst.rank}" if worst else "") + "): compute of the programs including the optimizer "
                "step, plus the communication it does not hide. A manual plan has no planner objective to compare "
                "with. Not a measurement: <code>adaptdist train --trace</code> measures the real step.</p>"
                "<table><tr><th>ms per step</th><th>cost model (lowered programs)</th></tr>"
                + "".join(f"<tr><td>{a}</td><td>{c}</td></tr>" for a, _, c in rows if a != "op dispatch overhead")
                + "</table>")
    head = ("<h2>Predicted step time</h2><p>Two predictions, made for different purposes: the planner's ILP "
            "objective, on the captured graph before lowering, ranks candidate plans (its collectives are charged in "
            "full and its op times are the planner's per-node costs); the cost model's estimate on the lowered "
            "programs (the slowest rank"
            + (f", rank {worst.rank}" if worst else "") + ") adds the optimizer step and lets communication hide "
            "behind compute where the device allows it. Neither is a measurement: <code>adaptdist train --trace</code> "
            "measures the real step.</p>")
    return (head + "<table><tr><th>ms per step</th><th>planner (ILP objective)</th><th>cost model (lowered "
            "programs)</th></tr>" + "".join(f"<tr><td>{a}</td><td>{b}</td><td>{c}</td></tr>" for a, b, c in rows)
            + "</table>")


def _rank_ranges(ranks: Sequence[int]) -> str:
    rs = sorted(ranks)
    out, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out)


def collectives_section(estimate: Any | None) -> str:
    """Every rank's collectives per step, grouped by kind and mesh axis (group): count, bytes and predicted
    milliseconds, ranks with identical rows merged; then each collective of the first rank in program order.
    Empty when there is no estimate or no collective."""
    if estimate is None or not any(r.collectives for r in estimate.ranks.values()):
        return ""
    e = html.escape
    by_rank: dict[int, tuple] = {}
    for r, x in sorted(estimate.ranks.items()):
        groups: dict[tuple[str, str], list] = {}
        for c in x.collectives:
            groups.setdefault((c.kind, c.group), []).append(c)
        by_rank[r] = tuple((k, g, len(cs), sum(float(c.n_bytes) for c in cs), sum(float(c.time_s) for c in cs))
                           for (k, g), cs in groups.items())
    merged: dict[tuple, list[int]] = {}
    for r, rows in by_rank.items():
        merged.setdefault(rows, []).append(r)
    parts = ["<h2>Collectives per step</h2><table><tr><th>ranks</th><th>collective</th><th>group (mesh axis)</th>"
             "<th>count</th><th>MiB per step</th><th>predicted ms</th></tr>"]
    for rows, ranks in merged.items():
        for k, g, n, nbytes, t in rows:
            parts.append(f"<tr><td>{_rank_ranges(ranks)}</td><td>{e(k)}</td><td>{e(g)}</td><td>{n}</td>"
                         f"<td>{nbytes / 2**20:.3f}</td><td>{1e3 * t:.3f}</td></tr>")
    first = min(estimate.ranks)
    parts.append(f"</table><details><summary>rank {first}'s collectives in program order</summary><table><tr>"
                 "<th>#</th><th>node</th><th>collective</th><th>group</th><th>ranks in group</th><th>bytes</th>"
                 "<th>predicted ms</th><th>link</th></tr>")
    for i, c in enumerate(estimate.ranks[first].collectives):
        parts.append(f"<tr><td>{i}</td><td>{e(c.name)}</td><td>{e(c.kind)}</td><td>{e(c.group)}</td>"
                     f"<td>{c.group_size}</td><td>{int(float(c.n_bytes)):,}</td><td>{1e3 * float(c.time_s):.3f}</td>"
                     f"<td>{e(str(c.tier))}{'' if c.calibrated else ' (default figures)'}</td></tr>")
    parts.append("</table></details>")
    return "".join(parts)


def pipeline_comm_section(comm: Mapping[int, Sequence[Any]] | None) -> str:
    """A pipeline plan's "Collectives per step": per rank (ranks with identical rows merged) each stage program's
    collectives, the sends and receives between stages and the gradient sync, with counts and MiB per step
    (:func:`adaptdist.compiler.pipeline_report.pipeline_comm_rows`). Empty for None or nothing."""
    if not comm or not any(comm.values()):
        return ""
    e = html.escape
    merged: dict[tuple, list[int]] = {}
    for r, rows in sorted(comm.items()):
        merged.setdefault(tuple(rows), []).append(r)
    parts = ["<h2>Collectives per step</h2><p>From the pipeline programs: each stage program's collectives (run "
             "once per microbatch), the activations and gradients sent between stages, and the gradient all-reduce "
             "over the ranks holding the same parameter (once per step).</p><table><tr><th>ranks</th><th>"
             "communication</th><th>group or peer</th><th>what</th><th>count</th><th>MiB per step</th></tr>"]
    for rows, ranks in merged.items():
        for x in rows:
            parts.append(f"<tr><td>{_rank_ranges(ranks)}</td><td>{e(x.kind)}</td><td>{e(x.peer)}</td>"
                         f"<td>{e(x.what)}</td><td>{x.count}</td><td>{x.n_bytes / 2**20:.3f}</td></tr>")
    parts.append("</table>")
    return "".join(parts)


def pipeline_ranks_section(rows: Sequence[Any] | None) -> str:
    """A pipeline plan's "Predicted time and memory per rank" (:func:`adaptdist.compiler.pipeline_report.
    pipeline_rank_rows`): each rank's stages, the planner's busy time and step (the rest idle: the bubble), and
    the state it holds. Empty for None."""
    if not rows:
        return ""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1e3 * v:.3f}"

    mib = lambda b: f"{b / 2**20:.3f}"  # noqa: E731
    parts = ["<h2>Predicted time and memory per rank</h2><p>The planner's per-stage times (forward, backward and "
             "weight gradient of every microbatch, plus the gradient sync) and its predicted step: the difference "
             "is the rank's idle time in the schedule. Memory: the state each rank holds (its stages' parameters, "
             "their gradients, the optimizer's state); the activations kept for the microbatches in flight come "
             "on top.</p><table><tr><th>rank</th><th>stages</th><th>busy ms</th><th>step ms</th><th>idle ms</th>"
             "<th>parameters MiB</th><th>gradients MiB</th><th>optimizer MiB</th><th>state MiB</th></tr>"]
    for x in rows:
        idle = None if x.busy_s is None or x.step_s is None else max(0.0, x.step_s - x.busy_s)
        parts.append(f"<tr><td>{x.rank}</td><td>{', '.join(map(str, x.stages))}</td><td>{ms(x.busy_s)}</td>"
                     f"<td>{ms(x.step_s)}</td><td>{ms(idle)}</td><td>{mib(x.params_bytes)}</td>"
                     f"<td>{mib(x.grads_bytes)}</td><td>{mib(x.optimizer_bytes)}</td><td>{mib(x.state_bytes)}</td>"
                     "</tr>")
    parts.append("</table>")
    return "".join(parts)


def _with_stages(texts: Mapping[str, list[str]], fqns: Sequence[str], mesh: Mapping[str, int],
                 holders: Mapping[str, Sequence[int]] | None, axis: str = "pp") -> dict[str, list[str]]:
    """Placement texts with the pipeline axis's entry the stage(s) holding the tensor (``stage 0``, ``stages 0,3``
    for a tied weight): a pipeline does not replicate a parameter over ``pp``, one stage holds it."""
    if not holders or axis not in mesh:
        return dict(texts)
    j = list(mesh).index(axis)
    out = dict(texts)
    for f in fqns:
        pls = list(texts.get(f, ["R"] * len(mesh)))
        st = holders.get(f)
        if st:
            pls[j] = f"stage{'s' if len(st) > 1 else ''} {','.join(map(str, st))}"
        out[f] = pls
    return out


@dataclass(frozen=True)
class StageRow:
    """One pipeline stage as the report shows it: its layers (model order), the ranks running it, its
    sub-mesh and the planner's per-microbatch predicted seconds (``forward``, ``backward``, ``weight``...)."""

    stage: int
    layers: tuple[str, ...]
    ranks: tuple[int, ...]
    mesh: Mapping[str, int] = field(default_factory=dict)
    predicted_s: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PipelineView:
    """A plan's pipeline for the report: stages, microbatches, schedule, the planner's predictions (``step``,
    ``bubble``, ``spmd_step``: seconds), and optionally the per-rank action lists of one step
    (``rank -> [(stage, "F"|"B"|"W", microbatch), ...]``), drawn as the predicted timeline
    (:func:`adaptdist.runtime.trace_view.predicted_pipeline_spans`) from the stages' predicted times."""

    stages: tuple[StageRow, ...]
    microbatches: int
    schedule: str
    predicted_s: Mapping[str, float] = field(default_factory=dict)
    actions: Mapping[int, Sequence[tuple[int, str, int]]] | None = None


def pipeline_view(plan: Any, world_size: int) -> PipelineView | None:
    """The :class:`PipelineView` of ``plan.pipeline`` (a ``PipelineSpec``: ``stages`` each with ``layers``,
    ``mesh``, ``ranks``, ``predicted_s``; ``microbatches``, ``schedule``, ``stages_per_rank``, ``predicted_s``);
    None when the plan has no pipeline. Stages without ranks get the default layout: stage group ``g`` = ranks
    ``g * n .. g * n + n - 1`` (``n`` = world size / groups)."""
    spec = getattr(plan, "pipeline", None)
    if spec is None:
        return None
    per = int(getattr(spec, "stages_per_rank", 1) or 1)
    groups = max(1, len(spec.stages) // per)
    n = max(1, world_size // groups)
    rows = []
    for i, st in enumerate(spec.stages):
        g = i % groups
        ranks = tuple(st.ranks) if st.ranks else tuple(range(g * n, g * n + n))
        rows.append(StageRow(i, tuple(st.layers), ranks, dict(st.mesh), dict(st.predicted_s)))
    return PipelineView(tuple(rows), int(spec.microbatches), str(spec.schedule), dict(spec.predicted_s))


def _layer_range(layers: Sequence[str]) -> str:
    return layers[0] if len(layers) == 1 else f"{layers[0]} … {layers[-1]} ({len(layers)} layers)"


def pipeline_section(view: PipelineView | None) -> str:
    """The report's pipeline section: a table of the stages (layers, ranks, sub-mesh, predicted times), the
    schedule and microbatches, and the predicted timeline when ``view.actions`` is given. Empty for None."""
    if view is None:
        return ""
    e = html.escape
    found = {k for s in view.stages for k in s.predicted_s}
    keys = [k for k in ("forward", "backward", "weight") if k in found] + sorted(found - {"forward", "backward",
                                                                                         "weight"})
    # every entry is seconds (the inter-stage planner's step_s, bubble_s, spmd_step_s): shown in ms, named
    names = {"spmd_step": "step of the best plan without stages"}
    pred = ", ".join(f"{e(names.get(k, k))} {1e3 * v:.3f} ms" for k, v in view.predicted_s.items())
    parts = [f"<h2>Pipeline stages</h2><p>{len(view.stages)} stages, schedule {e(view.schedule)}, "
             f"{view.microbatches} microbatches per step{'; predicted ' + pred if pred else ''}</p>",
             "<table><tr><th>stage</th><th>layers</th><th>ranks</th><th>sub-mesh</th>"
             + "".join(f"<th>{e(k)} ms</th>" for k in keys) + "</tr>"]
    for s in view.stages:
        mesh = ", ".join(f"{a}={n}" for a, n in s.mesh.items()) or "one rank"
        parts.append(f"<tr><td>{s.stage}</td><td title='{e(', '.join(s.layers))}'>{e(_layer_range(s.layers))}</td>"
                     f"<td>{_rank_ranges(s.ranks)}</td><td>{e(mesh)}</td>"
                     + "".join(f"<td>{1e3 * s.predicted_s[k]:.3f}</td>" if k in s.predicted_s else "<td>-</td>"
                               for k in keys) + "</tr>")
    parts.append("</table>")
    if view.actions:
        from ..runtime.trace import Trace
        from ..runtime.trace_view import predicted_pipeline_spans, predicted_steps, timeline_figure

        from ..runtime.trace_view import stage_action_times

        times = stage_action_times({s.stage: s.predicted_s for s in view.stages})  # B = backward + weight
        spans = predicted_pipeline_spans(view.actions, times)
        trace = Trace(tuple(spans), tuple(predicted_steps(spans)), tuple(sorted(view.actions)), "predicted")
        fig = timeline_figure(trace, label=f"predicted {view.schedule} schedule, {view.microbatches} microbatches")
        parts.append(_svg(fig))
    return "".join(parts)


@dataclass(frozen=True)
class RankRow:
    """One program rank as the rank-mapping section shows it: its mesh coordinates, the cluster device it runs
    on (index and ``kind@host``), and the rows of the global batch it takes (None: torch.chunk's)."""

    rank: int
    coords: Mapping[str, int]
    device: int
    device_name: str
    batch_rows: int | None = None


@dataclass(frozen=True)
class RankMappingView:
    """A plan's rank-to-device mapping for the report: one :class:`RankRow` per rank and why (``reason``)."""

    rows: tuple[RankRow, ...]
    reason: str = ""


def _coords(rank: int, mesh: Mapping[str, int]) -> dict[str, int]:
    out, rest = {}, rank
    for a, n in reversed(list(mesh.items())):
        rest, out[a] = divmod(rest, n)
    return {a: out[a] for a in mesh}


def rank_mapping_view(plan: Any, device_names: Sequence[str]) -> RankMappingView | None:
    """The :class:`RankMappingView` of ``plan.devices`` (a ``DeviceAssignment``: ``rank_to_device``,
    ``batch_rows`` per batch-axis coordinate, ``reason``); ``device_names[d]`` names cluster device ``d``. None
    when the plan assigns no devices."""
    d = getattr(plan, "devices", None)
    if d is None:
        return None
    mesh = dict(plan.mesh)
    world = math.prod(mesh.values()) if mesh else len(device_names)
    to_dev = getattr(d, "rank_to_device", None)
    rows_per = getattr(d, "batch_rows", None)
    rows = []
    for r in range(world):
        c = _coords(r, mesh)
        dev = r if to_dev is None else int(to_dev[r])
        b = None
        if rows_per is not None and plan.batch_axis in c:
            b = int(rows_per[c[plan.batch_axis]])
        rows.append(RankRow(r, c, dev, device_names[dev] if dev < len(device_names) else f"device {dev}", b))
    return RankMappingView(tuple(rows), str(getattr(d, "reason", "") or ""))


def rank_mapping_section(view: RankMappingView | None) -> str:
    """The report's rank-mapping section: a table (rank, mesh coordinates, device, batch rows) and a picture
    of the mesh with each rank's device in its cell, coloured by host. Empty for None."""
    if view is None or not view.rows:
        return ""
    e = html.escape
    axes = list(view.rows[0].coords)
    parts = ["<h2>Rank mapping</h2>" + (f"<p>{e(view.reason)}</p>" if view.reason else ""),
             "<table><tr><th>rank</th>" + "".join(f"<th>{e(a)}</th>" for a in axes)
             + "<th>device</th><th>batch rows</th></tr>"]
    for row in view.rows:
        parts.append(f"<tr><td>{row.rank}</td>" + "".join(f"<td>{row.coords[a]}</td>" for a in axes)
                     + f"<td>{row.device}: {e(row.device_name)}</td>"
                     f"<td>{'even' if row.batch_rows is None else row.batch_rows}</td></tr>")
    parts.append("</table>")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(r.coords[axes[-1]] for r in view.rows) + 1 if axes else len(view.rows)
    nrows = math.ceil(len(view.rows) / cols)
    hosts = {h: i for i, h in enumerate(dict.fromkeys(r.device_name.split("@")[-1] for r in view.rows))}
    fig, ax = plt.subplots(figsize=(min(1.2 + 1.5 * cols, 14), min(0.9 + 0.8 * nrows, 10)))
    cmap = plt.get_cmap("Pastel1")
    for i, row in enumerate(view.rows):
        y, x = divmod(i, cols)
        ax.add_patch(plt.Rectangle((x, -y - 1), 0.95, 0.95, color=cmap(hosts[row.device_name.split("@")[-1]] % 9)))
        ax.text(x + 0.47, -y - 0.35, f"rank {row.rank}", ha="center", va="center", fontsize=8)
        ax.text(x + 0.47, -y - 0.65, f"device {row.device}", ha="center", va="center", fontsize=7)
    ax.set_xlim(0, cols)
    ax.set_ylim(-nrows, 0)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title("ranks in mesh order, each with the device it runs on; colour = host", fontsize=9)
    parts.append(_svg(fig))
    return "".join(parts)


def render_report(*, title: str, manifest: Mapping[str, Any], plan: Any, fqns: list[str], hosts: list[str],
                  estimate: Any | None, planner_summary: str = "", phases_s: Mapping[str, float] | None = None,
                  param_fqns: Sequence[str] | None = None, planner_prediction: Any | None = None,
                  pipeline: PipelineView | None = None, rank_mapping: RankMappingView | None = None,
                  state_placements: Mapping[str, Sequence[str]] | None = None,
                  pipeline_comm: Mapping[int, Sequence[Any]] | None = None, pipeline_ranks: Sequence[Any] | None = None,
                  stage_holders: Mapping[str, Sequence[int]] | None = None) -> str:
    """The HTML text of ``report.html`` (module docstring).

    Args:
        fqns: the program's state inputs; ``param_fqns`` the trainable parameters among them (the rest are
            listed as buffers and frozen parameters; None: all are parameters).
        planner_prediction: the planner's :class:`~adaptdist.compiler.planner.search.Evaluation` (automatic
            plans), shown beside ``estimate`` in the predicted-step table.
        pipeline, rank_mapping: the sections of a pipeline plan and of a rank-to-device mapping (None: no section).
        state_placements: placement texts per mesh axis of sharded state (``RankProgram.state_placements``), for
            the buffers' table (a buffer absent from it and from the plan is replicated).
        pipeline_comm, pipeline_ranks: a pipeline plan's collectives and sends per step by rank, and its
            per-rank predicted time and state (:mod:`adaptdist.compiler.pipeline_report`; the cost model's
            ``estimate`` does not cover pipelines).
        stage_holders: fqn -> the stages holding it: the placements' ``pp`` column names the stage.
    """
    mesh = dict(plan.mesh)
    placed = plan.lowered.param_placements if plan.lowered is not None else plan.param_placements  # as lowered
    params, others = param_and_buffer_fqns(fqns, param_fqns)
    rows = placement_rows(_with_stages({f: [repr(p) for p in pls] for f, pls in placed.items()}, params, mesh,
                                       stage_holders), params, mesh)
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px}svg{max-width:100%;height:auto}"
             "</style></head><body>",
             f"<h1>{e(title)}</h1>",
             f"<p>adaptdist {e(str(manifest.get('adaptdist_version')))}, torch {e(str(manifest.get('torch_version')))}; "
             f"world size {manifest.get('world_size')}; mesh {e(str(mesh))}; batch "
             f"{'split over ' + e(plan.batch_axis) if plan.batch_axis else 'replicated'}; plan {e(plan.name)!s}; "
             f"cluster fingerprint {e(str(manifest.get('cluster_fingerprint')))}</p>"]
    if planner_summary:
        parts.append(f"<p>{e(planner_summary)}</p>")
    if phases_s:
        parts.append("<p>compile time: " + ", ".join(f"{e(k)} {v:.2f} s" for k, v in phases_s.items()) + "</p>")
    parts.append("<h2>Mesh</h2>" + mesh_figure(mesh, hosts))
    parts.append(rank_mapping_section(rank_mapping))
    parts.append(pipeline_section(pipeline))
    parts.append("<h2>Parameter placements per layer</h2>" + (placement_figure(rows, mesh) if rows else ""))
    parts.append("<table><tr><th>parameters</th>" + "".join(f"<th>{e(a)}</th>" for a in mesh) + "<th>count</th></tr>"
                 + "".join(f"<tr><td>{e(p)}</td>" + "".join(f"<td>{e(x)}</td>" for x in pls) + f"<td>{n}</td></tr>"
                           for p, pls, n in rows) + "</table>")
    if others:
        texts = {f: [repr(p) for p in pls] for f, pls in placed.items()}
        texts.update({f: list(pls) for f, pls in (state_placements or {}).items()})
        brows = placement_rows(_with_stages(texts, others, mesh, stage_holders), others, mesh)
        parts.append("<h3>Buffers and frozen parameters (state, not trained)</h3><table><tr><th>state</th>"
                     + "".join(f"<th>{e(a)}</th>" for a in mesh) + "<th>count</th></tr>"
                     + "".join(f"<tr><td>{e(p)}</td>" + "".join(f"<td>{e(x)}</td>" for x in pls) + f"<td>{n}</td></tr>"
                               for p, pls, n in brows) + "</table>")
    if estimate is not None:
        parts.append("<h2>Predicted time and memory per rank</h2>" + estimate_figure(estimate))
        parts.append("<table><tr><th>rank</th><th>step ms</th><th>compute ms</th><th>of which optimizer ms</th>"
                     "<th>communication ms</th><th>not hidden ms</th><th>peak MiB</th></tr>" + "".join(
                         f"<tr><td>{r}</td><td>{1e3 * float(x.step_s):.3f}</td><td>{1e3 * float(x.compute_s):.3f}</td>"
                         f"<td>{1e3 * float(x.optimizer_s):.3f}</td>"
                         f"<td>{1e3 * float(x.communication_s):.3f}</td><td>{1e3 * float(x.idle_s):.3f}</td>"
                         f"<td>{float(x.memory.peak_bytes) / 2**20:.2f}</td></tr>"
                         for r, x in sorted(estimate.ranks.items())) + "</table>")
    parts.append(pipeline_ranks_section(pipeline_ranks))
    parts.append(predictions_table(planner_prediction, estimate))
    parts.append(collectives_section(estimate))
    parts.append(pipeline_comm_section(pipeline_comm))
    parts.append("<h2>Files</h2><table><tr><th>file</th><th>sha256</th></tr>" + "".join(
        f"<tr><td>{e(f)}</td><td><code>{h[:16]}…</code></td></tr>" for f, h in sorted(manifest.get("files", {}).items()))
        + "</table><p>Artifacts are code: the hashes catch corruption and mix-ups, not a malicious author; run "
          "artifacts only from sources you trust.</p></body></html>")
    return "\n".join(p for p in parts if p)
