"""``report.html``: what a compiled artifact directory holds, for people to look at.

One self-contained HTML file (no scripts, no network): the mesh drawn as a grid of ranks, the
parameter placements per layer pattern as a picture and a table, and the predicted step time and
memory per rank (the cost model's :class:`~adaptdist.cost_models.estimate.StepEstimate`) as stacked
bars, with the planner's summary when the plan is automatic. Pictures are matplotlib SVG, inlined.
"""

from __future__ import annotations

import html
import io
import re
from typing import Any, Mapping

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
    """Rows = parameter patterns, columns = mesh axes; colour = replicated or the sharded dim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ["R", "S(0)", "S(1)", "S(2)", "S(3)"]
    colours = ["#dddddd", "#4e79a7", "#f28e2b", "#59a14f", "#e15759"]
    shown = rows[:60]
    fig, ax = plt.subplots(figsize=(2.0 + 1.2 * len(mesh), 0.6 + 0.22 * len(shown)))
    for i, (_, pls, _) in enumerate(shown):
        for j, p in enumerate(pls):
            c = colours[kinds.index(p)] if p in kinds else "#b07aa1"
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
    """Stacked bars per rank: predicted time (compute, exposed communication) and memory at the peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted(est.ranks)
    rs = [est.ranks[r] for r in ranks]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(min(3 + 0.35 * len(ranks), 16), 3.2))
    comp = [1e3 * float(r.compute_s) for r in rs]
    idle = [1e3 * float(r.idle_s) for r in rs]
    a1.bar(ranks, comp, label="compute")
    a1.bar(ranks, idle, bottom=comp, label="communication not hidden")
    a1.set_xlabel("rank")
    a1.set_ylabel("ms per step")
    a1.set_title("predicted step time", fontsize=9)
    a1.legend(fontsize=7)
    parts = [("parameters", "params_bytes"), ("gradients", "grads_bytes"), ("optimizer state", "optimizer_state_bytes"),
             ("activations and other", "activations_bytes")]
    bottom = [0.0] * len(rs)
    for label, attr in parts:
        vals = [float(getattr(r.memory, attr)) / 2**20 for r in rs]
        a2.bar(ranks, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a2.set_xlabel("rank")
    a2.set_ylabel("MiB at the peak")
    a2.set_title("predicted peak memory", fontsize=9)
    a2.legend(fontsize=7)
    return _svg(fig)


def render_report(*, title: str, manifest: Mapping[str, Any], plan: Any, fqns: list[str], hosts: list[str],
                  estimate: Any | None, planner_summary: str = "", phases_s: Mapping[str, float] | None = None) -> str:
    """The HTML text of ``report.html`` (module docstring)."""
    mesh = dict(plan.mesh)
    placed = plan.lowered.param_placements if plan.lowered is not None else plan.param_placements  # as lowered
    rows = placement_rows({f: [repr(p) for p in pls] for f, pls in placed.items()}, fqns, mesh)
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px}</style></head><body>",
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
    parts.append("<h2>Placements per layer</h2>" + placement_figure(rows, mesh))
    parts.append("<table><tr><th>parameters</th>" + "".join(f"<th>{e(a)}</th>" for a in mesh) + "<th>count</th></tr>"
                 + "".join(f"<tr><td>{e(p)}</td>" + "".join(f"<td>{e(x)}</td>" for x in pls) + f"<td>{n}</td></tr>"
                           for p, pls, n in rows) + "</table>")
    if estimate is not None:
        parts.append("<h2>Predicted time and memory per rank</h2>" + estimate_figure(estimate))
        parts.append("<table><tr><th>rank</th><th>step ms</th><th>compute ms</th><th>communication ms</th>"
                     "<th>not hidden ms</th><th>peak MiB</th></tr>" + "".join(
                         f"<tr><td>{r}</td><td>{1e3 * float(x.step_s):.3f}</td><td>{1e3 * float(x.compute_s):.3f}</td>"
                         f"<td>{1e3 * float(x.communication_s):.3f}</td><td>{1e3 * float(x.idle_s):.3f}</td>"
                         f"<td>{float(x.memory.peak_bytes) / 2**20:.2f}</td></tr>"
                         for r, x in sorted(estimate.ranks.items())) + "</table>")
    parts.append("<h2>Files</h2><table><tr><th>file</th><th>sha256</th></tr>" + "".join(
        f"<tr><td>{e(f)}</td><td><code>{h[:16]}…</code></td></tr>" for f, h in sorted(manifest.get("files", {}).items()))
        + "</table><p>Artifacts are code: the hashes catch corruption and mix-ups, not a malicious author; run "
          "artifacts only from sources you trust.</p></body></html>")
    return "\n".join(parts)
