"""The pipeline flags of ``train``, ``plan`` and ``compile``: ``--plan pp``, ``--mesh pp=N,...``, ``--microbatches``,
``--schedule``; and what the commands do differently with pipeline programs (printing, writing, checks).

``--plan pp`` without ``--mesh``: one pipeline over every rank (one rank per stage). ``--mesh pp=2,dp=2``: 2 stage
groups, each stage on a sub-mesh ``dp=2`` (``--plan`` then names the plan inside the stages: ``pp`` or ``auto`` take
the mesh's other axes as a preset, ``dp``/``tp``/``dp,tp`` or a plan file give it). ``--schedule interleaved-1f1b``
puts 2 stages on each stage group. ``--stage-ranks 2,1``: stages on sub-meshes of different sizes (stage 0 on 2
ranks, data parallel, stage 1 on 1; the sizes add up to the ranks): a faster device can take a bigger share. A saved
pipeline plan (``programs/plan.json``) is a pipeline without these flags.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import UsageError
from ..pipeline_schedules import SCHEDULES, stages_per_rank

DEFAULT_SCHEDULE = "1f1b"
"""The schedule where the planner finds no pipeline and ``--schedule`` is not given (the layers then split evenly);
otherwise the planner chooses it (:mod:`adaptdist.compiler.pipeline_auto`)."""


def add_pipeline_flags(p: argparse.ArgumentParser) -> None:
    """``--microbatches`` and ``--schedule`` (``--plan pp`` and ``--mesh pp=...`` are the existing flags' values)."""
    p.add_argument("--microbatches", type=_positive_int, default=None, metavar="N",
                   help="pipeline plans (--plan pp, --mesh pp=N,...): microbatches per step (each pipeline replica's "
                        "rows split evenly into N); default: the planner chooses (the least predicted step)")
    p.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="pipeline plans: the schedule (default: the planner chooses from each schedule's predicted "
                        "bubble); interleaved-1f1b holds 2 stages per stage group, zb is ZB-H1 (the backward split into "
                        "input- and weight-gradient parts)")
    p.add_argument("--stage-ranks", type=_stage_ranks, default=None, metavar="N0,N1,...",
                   help="pipeline plans: the number of ranks of each stage, data parallel inside it (e.g. 2,1: stage 0 "
                        "on ranks 0-1, stage 1 on rank 2; the sizes add up to the ranks); the planner chooses the "
                        "layer ranges. Implies a pipeline; not with --mesh axes other than pp")


def _stage_ranks(text: str) -> tuple[int, ...]:
    parts = [x.strip() for x in text.split(",")]
    try:
        sizes = tuple(int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ranks per stage like 2,1, got {text!r}") from None
    if len(sizes) < 2 or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"expected at least 2 stages of >= 1 rank each, like 2,1, got {text!r}")
    return sizes


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def mesh_has_pp(mesh: str | None) -> bool:
    return bool(mesh) and any(part.split("=")[0].strip() == "pp" for part in mesh.split(","))


def wants_pipeline(args) -> bool:
    """Whether the flags ask for a pipeline plan (``--plan pp`` or a ``pp`` axis in ``--mesh``).

    Raises:
        UsageError: ``--microbatches`` or ``--schedule`` without a pipeline plan.
    """
    plan = getattr(args, "plan", None)
    mesh = getattr(args, "mesh", None)
    yes = plan == "pp" or mesh_has_pp(mesh) or getattr(args, "stage_ranks", None) is not None
    given = [f for f, v in (("--microbatches", getattr(args, "microbatches", None)),
                            ("--schedule", getattr(args, "schedule", None))) if v is not None]
    if given and not yes and not _is_pipeline_plan_file(plan):
        raise UsageError(f"{' and '.join(given)} {'set' if len(given) > 1 else 'sets'} a pipeline plan's "
                         f"{'microbatches and schedule' if len(given) > 1 else given[0][2:]}; add --plan pp (one "
                         f"pipeline over every rank) or --mesh pp=N,... (e.g. --mesh pp=2,dp=2)")
    if given and not yes:
        _check_plan_file_pipeline(plan, args)
    return yes


def _check_plan_file_pipeline(plan: str, args) -> None:
    """A saved pipeline plan fixes its microbatches and schedule: a different ``--microbatches``/``--schedule``
    is refused (it was ignored before), naming the file's values."""
    import json
    from pathlib import Path

    spec = json.loads(Path(plan).read_text()).get("pipeline") or {}
    for flag, key in (("--microbatches", "microbatches"), ("--schedule", "schedule")):
        given = getattr(args, key, None)
        if given is not None and given != spec.get(key):
            raise UsageError(f"{flag} {given} differs from the saved pipeline plan {plan!r} ({key} "
                             f"{spec.get(key)!r}): a plan file fixes its stages, microbatches and schedule; drop "
                             f"{flag}, or re-plan with --plan pp {flag} {given}")


def _is_pipeline_plan_file(plan: str | None) -> bool:
    if not plan or not plan.endswith(".json"):
        return False
    import json
    from pathlib import Path

    try:
        return bool(json.loads(Path(plan).read_text()).get("pipeline"))
    except (OSError, ValueError, AttributeError):
        return False


def pipeline_options(args, world_size: int) -> Any:
    """The :class:`~adaptdist.compiler.pipeline_lowering.PipelineOptions` the flags ask for on ``world_size`` ranks,
    or None (no pipeline). Without ``--mesh`` every rank is a stage group (interleaved: 2 stages each).

    Raises:
        UsageError: as :func:`wants_pipeline`.
    """
    if not wants_pipeline(args):
        return None
    from ..compiler.pipeline_lowering import PipelineOptions

    schedule = getattr(args, "schedule", None) or DEFAULT_SCHEDULE
    v = stages_per_rank(schedule)
    if getattr(args, "stage_ranks", None) is not None:
        return PipelineOptions(microbatches=getattr(args, "microbatches", None), schedule=schedule,
                               stage_ranks=tuple(args.stage_ranks))
    return PipelineOptions(stages=None if mesh_has_pp(getattr(args, "mesh", None)) else world_size * v,
                           microbatches=getattr(args, "microbatches", None), schedule=schedule, stages_per_rank=v)


def inner_plan(args, spec, model: Any = None) -> Any:
    """The plan inside the stages for ``--plan``: None for ``pp`` and ``auto`` (the mesh's other axes as a preset),
    else the manual plan or plan file (``tp`` without the file's TP_PLAN: ``model``'s own Hugging Face plan)."""
    from ..annotations import ManualPlan

    if args.plan in ("pp", "auto"):
        from ..compiler.pipeline_lowering import mesh_preset

        return mesh_preset(getattr(args, "mesh", None), spec.module(), model)  # a tp axis: TP_PLAN, else the model's
    return ManualPlan.parse(args.plan, spec.module(), model)


def is_pipeline(programs: dict) -> bool:
    """Whether ``programs`` (a lowering's result) are pipeline programs."""
    from ..stage_program import PipelineRankProgram

    return isinstance(next(iter(programs.values())), PipelineRankProgram)


def pipeline_mesh_text(programs: dict) -> str:
    """``pp=2,dp=2`` of pipeline programs."""
    plan = programs[0].plan
    if plan is None:
        return "?"
    if plan.pipeline is not None and plan.world_size != plan.mesh_spec.world_size:  # stages of different sizes
        return f"pp={plan.pipeline.num_stages}, stage sub-meshes " + " | ".join(
            ",".join(f"{a}={n}" for a, n in st.mesh.items()) or "1 rank" for st in plan.pipeline.stages)
    return ",".join(f"{a}={n}" for a, n in plan.mesh.items())


def describe_stages(programs: dict) -> list[str]:
    """One line per stage: its layers and ranks (``stage 0 [ranks 0, 1]: embed, blocks.0``)."""
    p0 = programs[0]
    lines = []
    num = p0.stages[0].num_stages
    by_stage = {st.stage: st for p in programs.values() for st in p.stages}
    for s in range(num):
        st = by_stage[s]
        ranks = ", ".join(map(str, p0.stage_ranks[s]))
        lines.append(f"stage {s} on rank{'s' if len(p0.stage_ranks[s]) > 1 else ''} {ranks}: "
                     f"{', '.join(st.layers) or '-'}")
    return lines


def state_shapes_of(programs: dict) -> dict[str, list[int]]:
    """Every state tensor's global shape over all ranks' pipeline programs (what a checkpoint records)."""
    out: dict[str, list[int]] = {}
    for p in programs.values():
        for f, t in p.state.items():
            out.setdefault(f, list(p.global_shapes.get(f, tuple(t.shape))))
    return out


def pipeline_request(args) -> Any:
    """What the flags fix of a pipeline plan (``microbatches``, ``schedule``: None where the planner chooses), or
    None without a pipeline plan (:func:`compile_artifacts`'s ``pipeline``).

    Raises:
        UsageError: as :func:`wants_pipeline`.
    """
    if not wants_pipeline(args):
        return None
    from ..compiler.pipeline_auto import PipelineRequest

    sr = getattr(args, "stage_ranks", None)
    return PipelineRequest(getattr(args, "microbatches", None), getattr(args, "schedule", None),
                           tuple(sr) if sr is not None else None)


def compile_pipeline_or_none(args, spec, model, example, loss_fn, world_size: int, options, cluster=None,
                             console=None) -> dict | None:
    """The pipeline programs the flags ask for (``--plan pp``, ``--mesh pp=...``), or None when they ask for none
    (the caller compiles as before; a saved pipeline plan file is lowered as a pipeline there too). What the flags
    leave open (stages, layer ranges, schedule, microbatches) the planner chooses for ``cluster`` (None: this
    machine's ``world_size`` ranks) and prints on ``console``
    (:func:`~adaptdist.compiler.pipeline_auto.choose_pipeline_plan`)."""
    if not wants_pipeline(args):
        return None
    from ..compiler.capture import capture
    from ..compiler.lowering import compile_model
    from ..compiler.pipeline_auto import choose_pipeline_plan

    if cluster is None:
        from ..calibrate.local import local_cluster

        cluster = local_cluster(world_size)
    from ..errors import PipelineError

    captured = capture(model, example, loss_fn)
    try:
        decision = choose_pipeline_plan(captured, cluster, world_size, mesh=args.mesh,
                                        microbatches=getattr(args, "microbatches", None),
                                        schedule=getattr(args, "schedule", None), inner=inner_plan(args, spec, model),
                                        optimizer=str(getattr(args, "optimizer", "adamw")).replace("-", "_"),
                                        stage_ranks=getattr(args, "stage_ranks", None))
        if console is not None:
            print_decision(console, decision)
        return compile_model(model, example, loss_fn, world_size, decision.plan, options, captured=captured)
    except PipelineError as e:
        if not getattr(args, "resume", None):
            raise
        s = getattr(args, "schedule", None) or "not set (the planner's choice)"
        m = getattr(args, "microbatches", None) or "not set (the planner's choice)"
        raise PipelineError(
            f"{e.args[0].split('; use ')[0]}. A resumed run keeps the run's --schedule ({s}) and "
            f"--microbatches ({m}), which do not fit {world_size} ranks: resume on fewer ranks (with 1f1b or zb at "
            "most as many as microbatches, and a count whose microbatches split the batch rows evenly), or start a "
            "new run with another --out") from e


def print_decision(console, decision) -> None:
    """:meth:`~adaptdist.compiler.pipeline_auto.PipelineDecision.lines` on ``console`` (no rich markup)."""
    from rich.markup import escape

    for line in decision.lines():
        console.print(escape(line))


def save_and_describe_pipeline(programs: dict, directory, console, seconds: float, extra: dict | None = None,
                               extra_files: dict | None = None):
    """Write pipeline ``programs`` to ``directory`` (:func:`~adaptdist.stage_program_io.save_pipeline_programs`)
    and print what was compiled: mesh, schedule, microbatches, each stage's layers and ranks."""
    from ..stage_program_io import save_pipeline_programs

    d = save_pipeline_programs(programs, directory, extra=extra, extra_files=extra_files)
    p0 = programs[0]
    console.print(f"compiled pipeline plan {p0.plan.name!r} (mesh {pipeline_mesh_text(programs)}; schedule "
                  f"{p0.schedule}, {p0.num_microbatches} microbatches of {p0.microbatch_rows} rows) for "
                  f"{p0.world_size} ranks in {seconds:.1f} s -> {d} (read rank0/program.py)")
    for line in describe_stages(programs):
        console.print(f"  {line}")
    return d


def print_pipeline_plan(programs: dict, spec, cluster, console, out: str | None) -> int:
    """``adaptdist plan`` of a pipeline: mesh, schedule, microbatches, the stages (layers, ranks), where every
    parameter lives, the point-to-point traffic per step; ``out``: the plan as JSON."""
    from pathlib import Path

    from rich.table import Table

    p0 = programs[0]
    console.print(f"plan {p0.plan.name!r} for {spec.text} on {cluster!r}: pipeline mesh {pipeline_mesh_text(programs)}, "
                  f"schedule {p0.schedule}, {p0.num_microbatches} microbatches of {p0.microbatch_rows} rows per "
                  f"replica")
    for line in describe_stages(programs):
        console.print(f"  {line}")
    table = Table(title="parameters")
    for col in ("parameter", "global shape", "ranks holding it", "gradient all-reduced over"):
        table.add_column(col)
    holders: dict[str, list[int]] = {}
    for r, p in sorted(programs.items()):
        for f in p.param_fqns:
            holders.setdefault(f, []).append(r)
    for f, ranks in holders.items():
        p = programs[ranks[0]]
        shape = list(p.global_shapes.get(f, tuple(p.state[f].shape)))
        group = p.grad_groups.get(f, (ranks[0],))
        table.add_row(f, str(shape), ", ".join(map(str, ranks)), ", ".join(map(str, group)) if len(group) > 1 else "-")
    console.print(table)
    sent = sum(_numel(s.shape) * s.dtype.itemsize for st in p0.stages for s in (*st.send_specs, *st.grad_out_specs))
    console.print(f"point-to-point per microbatch from rank 0: {sent / 2**20:.3f} MiB (activations forward, gradients "
                  f"backward); per step x {p0.num_microbatches}")
    if out:
        Path(out).write_text(p0.plan.to_json())
        console.print(f"wrote {out}")
    return 0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
