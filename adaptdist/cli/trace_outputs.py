"""``adaptdist train --trace``'s outputs: the ranks' recorded spans (:mod:`adaptdist.runtime.trace`) written as
``trace.json``, ``timeline.png`` and ``timeline.html`` beside the cost model's predicted step, and the measured
idle fraction per rank in ``summary.json``."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_run_trace(out: Path, programs: dict, cluster, optimizer: str, plan_name: str, console) -> None:
    """``--trace``: the ranks' spans (``OUT/trace/``) as ``trace.json``, ``timeline.png`` and ``timeline.html``,
    beside the cost model's predicted step (:func:`~adaptdist.runtime.trace_view.predicted_spmd_timeline_spans`); the
    measured idle fraction per rank goes into ``summary.json`` (``idle_fraction``)."""
    from ..cost_models.estimate import estimate_programs
    from ..cost_models.timeline import predicted_segments, segments_as_tuples
    from ..runtime.trace_view import predicted_spmd_timeline_spans, write_trace_outputs

    try:
        est = estimate_programs(programs, cluster, optimizer)
        # where the model puts each part, every collective it counts included (fix-lower)
        predicted = predicted_spmd_timeline_spans(segments_as_tuples(predicted_segments(programs, cluster, optimizer)))
    except Exception as e:  # noqa: BLE001 - e.g. programs the SPMD cost model does not read; the trace stands alone
        est, predicted = None, []
        console.print(f"[yellow]--trace: no predicted timeline ({type(e).__name__}: {e})[/]")
    mesh = ",".join(f"{a}={n}" for a, n in getattr(programs[0], "mesh", {}).items())
    notes = [f"plan {plan_name!r} on mesh {mesh}. Measured: each step's forward (F) up to the last node the loss "
             "needs, backward (B) after it, each collective from its issue to the end of its wait, the optimizer."
             + ("" if est is None else " Predicted (cost model): forward+backward, each collective it counts (thin "
                "bars, on its group's stream), the waits it does not hide, the optimizer, "
                f"{1e3 * max(x.step_s for x in est.ranks.values()):.3f} ms per step.")]
    res = write_trace_outputs(out / "trace", out, predicted, title=f"adaptdist train --trace: plan {plan_name}",
                              notes=notes)
    summary = json.loads((out / "summary.json").read_text())
    summary["idle_fraction"] = {str(r): f for r, f in res["idle_fraction"].items()}
    tmp = out / f"summary.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(out / "summary.json")
    console.print(f"trace: {', '.join(res['files'])} (idle fraction "
                  + ", ".join(f"rank {r} {f:.2f}" for r, f in res["idle_fraction"].items()) + ")")
