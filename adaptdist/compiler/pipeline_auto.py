"""The pipeline plan of ``--plan pp`` / ``--mesh pp=N,...``: what the user sets stays fixed, the rest the planner
chooses (issue 15, point 1).

The inter-stage planner (:func:`~.planner.stages.plan_pipeline`: equal sub-meshes, and without ``--mesh``
data-parallel ones of different sizes too; ``--stage-ranks 2,1`` fixes each stage's size) picks
the layer ranges (uneven where the devices' speeds differ: each stage is costed on its own ranks' devices), the
number of stages and their sub-mesh (unless ``--mesh pp=N,...`` gives them), the schedule (unless ``--schedule``)
and the microbatches (unless ``--microbatches``) from the cost model's forward, input-gradient and
weight-gradient times and each schedule's analytic bubble. Where the planner finds no pipeline (too few layers
or rows, a count it cannot use, ...), the plan is today's even split of the layers with the user's numbers (or
:data:`DEFAULT_SCHEDULE` and one microbatch per stage), which raises the lowering's own clear error where those
numbers cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_SCHEDULE = "1f1b"
"""The schedule of the even-split fallback when the planner finds no pipeline and ``--schedule`` is not given."""


@dataclass(frozen=True)
class PipelineRequest:
    """What ``--microbatches`` / ``--schedule`` fix of a pipeline plan (None: the planner chooses)."""

    microbatches: int | None = None
    schedule: str | None = None
    stage_ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PipelineDecision:
    """What :func:`choose_pipeline_plan` decided.

    Attributes:
        plan: the pipeline :class:`~adaptdist.plan.Plan` to lower.
        choice: the planner's :class:`~.planner.stages.PipelineChoice`, or None (the even-split fallback).
        fixed: what the user set (``{"schedule": "zb", "microbatches": 4, "stages": 2}``).
        note: why the planner's choice is not used (empty when it is).
    """

    plan: Any
    choice: Any
    fixed: dict
    note: str = ""

    def lines(self) -> list[str]:
        """What to print: the stage plan (:func:`~.planner.stages.stage_plan_lines`) and what was the user's."""
        fixed = ", ".join(f"{k} {v}" for k, v in self.fixed.items())
        if self.choice is None:
            return [f"pipeline stages: layers split evenly ({self.note})"]
        from .planner.stages import stage_plan_lines

        chose = [k for k in ("stages", "schedule", "microbatches") if k not in self.fixed]
        head = (f"pipeline stages chosen by the planner (layer ranges{', ' if chose else ''}{', '.join(chose)}; "
                f"set by you: {fixed or 'nothing'}; --mesh pp=N,..., --schedule, --microbatches fix them)")
        return [head] + stage_plan_lines(self.choice)


def choose_pipeline_plan(captured: Any, cluster: Any, world_size: int, *, mesh: str | None = None,
                         microbatches: int | None = None, schedule: str | None = None, inner: Any = None,
                         optimizer: str = "adamw", stage_ranks: tuple[int, ...] | None = None) -> PipelineDecision:
    """The pipeline plan for ``captured`` on ``cluster`` (``world_size`` ranks; module docstring).

    Args:
        mesh: ``--mesh pp=N,...`` (fixes the stage groups and their sub-mesh) or None (the planner chooses them).
        microbatches, schedule: ``--microbatches`` / ``--schedule``, None to let the planner choose.
        inner: the plan inside the stages (a :class:`~adaptdist.annotations.ManualPlan` from ``--plan dp`` etc.),
            None: the sub-mesh axes' presets.
        optimizer: sizes the optimizer state in the stages' memory.
        stage_ranks: ``--stage-ranks 2,1``: each stage's number of ranks (data parallel inside), fixed; the planner
            chooses the layer ranges (else they split evenly). Without it and without ``mesh`` the planner weighs
            stages of different sizes too.

    Raises:
        PipelineError, UsageError: from the even-split fallback, where the user's numbers cannot run (names them).
    """
    from ..errors import AdaptdistError
    from ..mesh import Mesh
    from ..pipeline_schedules import SCHEDULES, stages_per_rank
    from .lowering import resolve_plan
    from .pipeline_lowering import PIPELINE_AXIS, PipelineOptions
    from .planner.stages import pipeline_plan, plan_pipeline

    fixed: dict = {}
    num_stages = submesh = None
    if mesh:
        m = Mesh.parse(mesh)
        if PIPELINE_AXIS in m.names:
            num_stages = m.size(PIPELINE_AXIS)
            fixed["stages"] = num_stages
            rest = tuple((a, n) for a, n in m.axes if a != PIPELINE_AXIS and n > 1)
            submesh = Mesh(rest) if rest else None
    if stage_ranks is not None:
        fixed["stage ranks"] = ",".join(map(str, stage_ranks))
        fixed["stages"] = len(stage_ranks)
    if schedule is not None:
        fixed["schedule"] = schedule
    if microbatches is not None:
        fixed["microbatches"] = microbatches
    note = ""
    try:
        if mesh and num_stages is None:
            raise AdaptdistError(f"--mesh {mesh} has no {PIPELINE_AXIS!r} axis")  # the even split's error says more
        if mesh and submesh is None and num_stages is not None and num_stages != world_size and stage_ranks is None:
            raise AdaptdistError(f"--mesh {mesh} gives {num_stages} stage groups of one rank on {world_size} ranks")
        kw: dict = {"num_stages": num_stages} if num_stages is not None else {}
        if mesh and stage_ranks is None:  # pp=N alone: one rank per stage
            kw["submesh"] = submesh if submesh is not None else Mesh.one_axis("dp", 1)
        if stage_ranks is not None:
            kw = {"stage_sizes": tuple(stage_ranks)}
        elif not mesh:
            kw["uneven_dp"] = True
        choice = plan_pipeline(captured, cluster, optimizer=optimizer, uniform=True,
                               microbatches=[microbatches] if microbatches is not None else None,
                               schedules=(schedule,) if schedule is not None else SCHEDULES, **kw)
        if mesh and submesh is None and stage_ranks is None and any(len(s.ranks) != 1 for s in choice.stages):
            raise AdaptdistError(f"the planner put several ranks on a stage, --mesh {mesh} asks for one")
        plan = pipeline_plan(captured, choice, world_size, inner=inner)
        return PipelineDecision(plan, choice, fixed)
    except AdaptdistError as e:
        note = f"the planner found no pipeline: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    sched = schedule or DEFAULT_SCHEDULE
    v = stages_per_rank(sched)
    opts = PipelineOptions(stages=None if mesh else world_size * v, microbatches=microbatches, schedule=sched,
                           stages_per_rank=v)
    if stage_ranks is not None:
        opts = PipelineOptions(microbatches=microbatches, schedule=sched, stage_ranks=tuple(stage_ranks))
    plan = resolve_plan(inner, captured, world_size, mesh, pipeline=opts)
    return PipelineDecision(plan, None, fixed, note)

