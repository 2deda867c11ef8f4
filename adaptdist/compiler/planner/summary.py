"""The planner's search with a status line, and its summary on a console: what ``--plan auto`` (the
default of train, plan, estimate and compile) prints."""

from __future__ import annotations

from typing import Any

from ...errors import UsageError
from .explain import layer_rows
from .search import PlannerResult, plan_auto


PIPELINE_IN_AUTO = False
"""Whether ``--plan auto`` (train, plan, estimate, compile, explain) also weighs pipeline stages (pp-plan's
inter-stage planner, :mod:`.stages`) and takes the pipeline plan where it is predicted faster. Off: on this
machine's 2-rank default (the built-in GPT) the stages add 0.3-0.8 s to 4 s of planning and are not chosen (233 vs
211 ms predicted), but on 4 ranks they double the planning time (24 s more: the ILP of every sub-mesh shape).
``--consider-pp`` (train, plan, estimate, compile, explain) or ``run_planner(pipeline=True)`` asks for it."""


def run_planner(captured: Any, cluster: Any, mesh: str | None, optimizer: str, console: Any | None = None,
                replicate_fallback: bool = False, pipeline: bool | None = None) -> PlannerResult:
    """:func:`plan_auto` on ``captured`` for ``cluster`` (``mesh``: a fixed ``"dp=2,tp=2"``), with a status line
    while it searches; ``replicate_fallback`` as ``--replicate-fallback``; ``pipeline`` (default
    :data:`PIPELINE_IN_AUTO`): also plan pipeline stages (without a fixed mesh)."""
    from ...mesh import Mesh

    pipeline = PIPELINE_IN_AUTO if pipeline is None else pipeline

    fixed = Mesh.parse(mesh) if mesh else None
    if fixed is not None and fixed.world_size != cluster.world_size:
        raise UsageError(f"--mesh {mesh} has {fixed.world_size} ranks but the cluster has {cluster.world_size}")
    def plan(progress=None) -> PlannerResult:
        from ...errors import PlanInfeasibleError

        try:
            result = plan_auto(captured, cluster, mesh=fixed, optimizer=optimizer,
                               replicate_fallback=replicate_fallback, progress=progress)
        except PlanInfeasibleError as e:
            if not (pipeline and fixed is None):
                raise
            from .stages import pipeline_only

            return pipeline_only(captured, cluster, e, optimizer=optimizer, progress=progress)
        if pipeline and fixed is None:
            from .stages import with_pipeline

            result = with_pipeline(result, captured, cluster, optimizer=optimizer, progress=progress)
        return result

    if console is None:
        return plan()
    progress = _LineProgress(console)
    with console.status("planning") as status:
        def update(text: str) -> None:
            status.update(f"planning: {text}")
            progress(text)
        return plan(update)


class _LineProgress:
    """Where the status line does not show (output to a file or a pipe), a line of the planner's progress every
    :data:`PROGRESS_EVERY_S` seconds, so a long search (hundreds of ranks: many mesh shapes) is not silent."""

    def __init__(self, console: Any) -> None:
        import time

        self.console, self.clock = console, time.perf_counter
        self.last = self.clock()

    def __call__(self, text: str) -> None:
        if getattr(self.console, "is_terminal", True):
            return
        now = self.clock()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.console.print(f"planning: {text}")


PROGRESS_EVERY_S = 10.0


def print_summary(console: Any, result: PlannerResult, layers: bool = True) -> None:
    """The chosen mesh, predicted time and memory per rank, shapes tried, and (``layers``) the per-layer table."""
    from rich.table import Table

    ev, plan = result.predicted, result.plan
    mesh = ",".join(f"{a}={n}" for a, n in plan.mesh.items())
    comm = ", ".join(f"{a} {1e3 * t:.3f} ms" for a, t in ev.communication_s.items())
    stats = "; ".join(f"{a}: {s.result.status}, gap {100 * s.result.gap:.2g}%, {s.result.num_variables} variables"
                      for a, s in result.axes.items())
    won = pipeline_won(result)
    if won and result.pipeline.spmd_step_s is None:  # pipeline_only: no plan without stages fits
        why = next((e for _, e in result.tried if isinstance(e, str)), "")
        console.print(f"automatic plan: pipeline on mesh {mesh} (the stages below), predicted step "
                      f"{1e3 * result.pipeline.step_s:.3f} ms; without stages: {why}")
    elif won:  # ``predicted`` and ``candidate`` are the best plan without stages, which the pipeline beat
        cand = result.candidate
        console.print(f"automatic plan: pipeline on mesh {mesh} (the stages below), predicted step "
                      f"{1e3 * result.pipeline.step_s:.3f} ms; the best plan without stages: mesh {cand}, batch "
                      f"{'split over ' + cand.batch_axis if cand.batch_axis else 'replicated'}, predicted step "
                      f"{1e3 * ev.step_s:.3f} ms per rank (compute {1e3 * ev.compute_s:.3f} ms, op overhead "
                      f"{1e3 * ev.overhead_s:.3f} ms, communication {comm or 'none'}), memory "
                      f"{ev.memory_bytes / 2**20:,.1f} MiB of {ev.capacity_bytes / 2**30:.1f} GiB per rank; "
                      f"{len(result.tried)} mesh shapes in {sum(result.phases_s.values()):.1f} s ({stats})")
    else:
        console.print(f"automatic plan: mesh {mesh}, batch "
                      f"{'split over ' + plan.batch_axis if plan.batch_axis else 'replicated'}"
                      f"; predicted step {1e3 * ev.step_s:.3f} ms per rank (compute {1e3 * ev.compute_s:.3f} ms, "
                      f"op overhead {1e3 * ev.overhead_s:.3f} ms, communication {comm or 'none'}), memory "
                      f"{ev.memory_bytes / 2**20:,.1f} MiB of {ev.capacity_bytes / 2**30:.1f} GiB per rank; "
                      f"{len(result.tried)} mesh shapes in {sum(result.phases_s.values()):.1f} s ({stats})")
    if result.pipeline is not None:
        print_stage_plan(console, result.pipeline)
    if not result.calibrated:
        console.print("[yellow](predicted with uncalibrated default figures; `adaptdist cluster profile` measures this "
                      "machine's)[/]")
    if len(result.tried) > 1:
        t = Table(title="mesh shapes tried (predicted per rank)")
        for col in ("mesh", "batch axis", "what its plan splits", "step ms", "communication ms", "memory MiB", ""):
            t.add_column(col)
        for c, ev_or_why in result.tried:
            if isinstance(ev_or_why, str):
                t.add_row(str(c), str(c.batch_axis or "-"), "-", "-", "-", "-", ev_or_why)
            else:
                t.add_row(str(c), str(c.batch_axis or "-"), result.splits.get(c, "-"), f"{1e3 * ev_or_why.step_s:.3f}",
                          f"{1e3 * sum(ev_or_why.communication_s.values()):.3f}",
                          f"{ev_or_why.memory_bytes / 2**20:,.1f}",
                          ("best without stages" if won else "chosen") if c == result.candidate else "")
        console.print(t)
        fastest = min((e.step_s for _, e in result.tried if not isinstance(e, str)), default=ev.step_s)
        if fastest < ev.step_s:
            from .search import TIE_TOLERANCE

            console.print(f"(shapes predicted within {100 * TIE_TOLERANCE:.0f}% of the fastest count as ties, the "
                          "model is not that exact: the first in order wins, a batch axis before none and fewer axes "
                          "before more)")
    if not layers and won:
        from .explain import stage_of_param

        held: dict = {}
        for pn in result.graph.params():
            k = stage_of_param(plan.pipeline, pn.fqn or pn.name)
            held[k] = held.get(k, 0) + 1
        sub = [i for i, a in enumerate(plan.mesh) if a != "pp"]
        sharded = [f for f, p in plan.param_placements.items() if any(repr(p[i]) != "R" for i in sub if i < len(p))]
        console.print("parameters: each on the stage that holds its layer ("
                      + ", ".join(f"stage {k}: {n}" for k, n in held.items()) + ")"
                      + (f"; sharded inside their stage: {', '.join(sharded[:6])}"
                         + (f" and {len(sharded) - 6} more" if len(sharded) > 6 else "") if sharded else "")
                      + " (adaptdist plan shows the per-layer table)")
    elif not layers:
        sharded = {f: "[" + ", ".join(map(repr, p)) + "]" for f, p in plan.param_placements.items()
                   if any(repr(x) != "R" for x in p)}
        total = len(result.graph.params())
        console.print(f"parameters: {total - len(sharded)} of {total} replicated on every axis"
                      + (f"; sharded: {', '.join(f'{f} {p}' for f, p in list(sharded.items())[:6])}"
                         + (f" and {len(sharded) - 6} more" if len(sharded) > 6 else "") if sharded else "")
                      + " (adaptdist plan shows the per-layer table)")
    if not won and not any(any(repr(x) != "R" for x in p) for p in plan.param_placements.values()) \
            and getattr(result.candidate, "batch_axis", None) is None and plan.world_size > 1:
        # a mesh named tp=2 that shards no parameter reads as tensor parallelism; say what it is
        split = split_nodes(plan)
        if not split:
            console.print("(no split: every rank runs the whole step on the whole batch, with no communication; "
                          "predicted faster here than any split, whose communication would cost more than the compute "
                          "it saves)")
        else:
            console.print(f"(no parameter is sharded and the input batch is replicated, but {len(split)} of "
                          f"{len(plan.node_strategies)} nodes split their work over {', '.join(plan.mesh)} (their "
                          f"activations sharded, e.g. {split[0]!r}): each rank computes its share of those and the "
                          "whole of the rest, and the collectives combine the shares; predicted so)")
    if layers:
        t = Table(title="parameter placements (per layer pattern)")
        for col in ("parameters", "stage, placement in its sub-mesh" if won else "placement per mesh axis", "count"):
            t.add_column(col)
        for pattern, text, n in layer_rows(result):
            t.add_row(pattern, text, str(n))
        console.print(t)


def pipeline_won(result: PlannerResult) -> bool:
    """Whether ``result``'s plan is the inter-stage planner's pipeline (``--consider-pp`` chose it, or no plan
    without stages fits): then ``result.predicted`` and ``result.candidate`` are the best plan without stages, if
    any, not the plan's."""
    from .stages import PipelineChoice

    return isinstance(result.pipeline, PipelineChoice) and getattr(result.plan, "pipeline", None) is not None


def split_nodes(plan: Any) -> list[str]:
    """The nodes whose planned strategy divides their work over some mesh axis
    (:func:`~.problem.splits`: a Shard input or output, or a Partial output), in graph order."""
    from .problem import splits

    sizes = list(plan.mesh.values())  # an axis of one rank splits nothing, whatever its strategies say
    return [n for n, sts in plan.node_strategies.items()
            if any(s is not None and splits(s) and sizes[i] > 1 for i, s in enumerate(sts) if i < len(sizes))]


def print_stage_plan(console: Any, stages: Any) -> None:
    """The inter-stage planner's result (:class:`.stages.PipelineChoice`: :func:`.stages.stage_plan_lines`), or why
    there is none (a str), on ``console``."""
    from rich.markup import escape

    from .stages import stage_plan_lines

    if isinstance(stages, str):
        console.print(escape(f"pipeline stages: {stages}"))
        return
    for line in stage_plan_lines(stages):
        console.print(escape(line))
