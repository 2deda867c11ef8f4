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

    spec = getattr(getattr(programs[0], "plan", None), "pipeline", None)
    if spec is not None:
        return _write_pipeline_trace(out, programs, spec, plan_name, console)
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
    _record_idle(out, res, console)


def _record_idle(out: Path, res: dict, console) -> None:
    summary = json.loads((out / "summary.json").read_text())
    summary["idle_fraction"] = {str(r): f for r, f in res["idle_fraction"].items()}
    tmp = out / f"summary.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(out / "summary.json")
    console.print(f"trace: {', '.join(res['files'])} (idle fraction "
                  + ", ".join(f"rank {r} {f:.2f}" for r, f in res["idle_fraction"].items()) + ")")


def _write_pipeline_trace(out: Path, programs: dict, spec, plan_name: str, console) -> None:
    """``--trace`` of pipeline programs: the measured timeline beside the planner's (the schedule's actions per rank
    on the stages' predicted F/B/W seconds, :func:`~adaptdist.runtime.trace_view.predicted_pipeline_of`)."""
    from ..errors import AdaptdistError
    from ..runtime.trace_view import predicted_pipeline_of, write_trace_outputs

    p0 = programs[0]
    try:
        predicted = predicted_pipeline_of(spec, p0.world_size)
    except AdaptdistError as e:
        predicted = []
        from rich.markup import escape

        console.print(f"[yellow]--trace: no predicted timeline ({escape(str(e))})[/]")
    mesh = ",".join(f"{a}={n}" for a, n in p0.plan.mesh.items())
    step = max((s.end_s for s in predicted), default=0.0)
    notes = [f"plan {plan_name!r} on mesh {mesh}: schedule {spec.schedule}, {spec.microbatches} microbatches, "
             f"{len(spec.stages)} stages. Measured: each forward (F), backward (B, or I and W apart), send/recv, the "
             "gradient and loss all-reduces, the optimizer."
             + ("" if not predicted else f" Predicted (planner): the schedule's actions on each stage's predicted "
                f"per-microbatch F/B/W seconds (sends included), {1e3 * step:.3f} ms for the pipeline (before the "
                "gradient all-reduce and the optimizer).")]
    res = write_trace_outputs(out / "trace", out, predicted, title=f"adaptdist train --trace: plan {plan_name}",
                              notes=notes)
    _record_idle(out, res, console)
