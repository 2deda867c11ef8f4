"""``--mode sync|async-hetero|auto``, ``--max-staleness K``, ``--dense-ranks LIST`` (issue 17): the execution mode
of ``adaptdist train`` and ``adaptdist plan``, and the training loop of ``--mode async-hetero``
(:mod:`adaptdist.runtime.async_hetero` on local gloo ranks)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ..errors import UsageError

DEFAULT_MAX_STALENESS = 1


def add_mode_flags(p: argparse.ArgumentParser) -> None:
    """Add ``--mode``, ``--max-staleness`` and ``--dense-ranks`` to ``p`` (``train`` and ``plan``)."""
    p.add_argument("--mode", choices=("auto", "sync", "async-hetero"), default="auto",
                   help="sync: the compiled synchronous programs (data parallel, tables sharded where they do not fit); "
                        "async-hetero: a recommender's embedding lookups and sparse updates on 'sparse' ranks, its dense "
                        "part on 'dense' ranks, joined by bounded queues (--max-staleness); auto: the planner's choice "
                        "from the cost model and the cluster (async-hetero only for models with .sparse_arch and "
                        ".dense_arch, e.g. builtin:dlrm, with --plan auto)")
    p.add_argument("--max-staleness", type=_staleness, default=None, metavar="K",
                   help="async-hetero: the sparse side runs at most K batches ahead of the gradients it has applied "
                        "(the lookups of step t see the table updates of steps up to t-K-1; 0: the synchronous step; "
                        f"default {DEFAULT_MAX_STALENESS})")
    p.add_argument("--dense-ranks", metavar="LIST", default=None,
                   help="async-hetero: the ranks that run the dense part, e.g. 1 or 2,3 (the others hold the tables); "
                        "default: the planner's choice (accelerators where the cluster has them)")


def _staleness(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if not 0 <= k <= 1_000_000:
        raise argparse.ArgumentTypeError(f"expected a whole number from 0 to 1000000, got {text!r}")
    return k


def resolve_mode(args, model, example, cluster, console, *, elastic=None, resuming: bool = False,
                 resume_kind: str | None = None, loss_fn=None):
    """The :class:`~adaptdist.compiler.planner.modes.ModeChoice` of the flags, or None when the model has no
    embedding and dense parts and the mode was not forced (other models: the compiled programs, as ever).

    ``--mode auto`` keeps ``sync`` where a flag asks for a synchronous plan (``--plan`` other than auto,
    ``--mesh``, a pipeline), an elastic run, or mixed precision. A resumed run (``resuming``) keeps the mode of
    its checkpoint (``resume_kind``: ``"async-hetero"`` for one of :mod:`adaptdist.runtime.hetero_checkpoint`,
    else ``"sync"``; None: no checkpoint, ``sync`` under auto).

    The synchronous candidate is the plan ``--mode sync`` will run (given ``loss_fn``, one device kind ``cpu``,
    and no flag that changes the captured graph or the programs' form: see :func:`_plan_sync_first`): planned (the
    ILP under ``--plan auto``, else the manual plan) and lowered here, priced by
    :func:`~adaptdist.cost_models.recsys.program_sync_cost` (the same terms as the asynchronous candidates'), and
    kept on ``args._sync_plan`` so that :func:`adaptdist.cli.common.resolve_plan` hands the same plan to the
    lowering of ``plan``/``train`` instead of planning again (an ILP tie could otherwise come out the other way).
    Otherwise it is :func:`~adaptdist.cost_models.recsys.sync_cost` (data parallel), and the mode lines say so.

    Raises:
        UsageError: ``async-hetero`` with a model, a flag or a cluster it cannot run with; a mode forced against
            the resumed checkpoint's.
    """
    from ..compiler.planner.modes import choose_mode, has_sparse_and_dense_parts, recsys_shape
    from ..hetero_layout import parse_dense_ranks

    mode = getattr(args, "mode", "auto")
    splittable = has_sparse_and_dense_parts(model)
    if not splittable and mode != "async-hetero":
        return None
    dense = parse_dense_ranks(args.dense_ranks) if getattr(args, "dense_ranks", None) else None
    sync_flags = [f for f, on in (("--plan " + str(getattr(args, "plan", "auto")), getattr(args, "plan", "auto") != "auto"),
                                   ("--mesh", bool(getattr(args, "mesh", None))),
                                   ("--microbatches", getattr(args, "microbatches", None) is not None),
                                   ("--stage-ranks", bool(getattr(args, "stage_ranks", None))),
                                   ("--nproc MIN:MAX", elastic is not None),
                                   ("--precision bf16", getattr(args, "precision", "fp32") != "fp32"),
                                   ("--activation-checkpointing", bool(getattr(args, "activation_checkpointing", False))),
                                   ("--trace", bool(getattr(args, "trace", False))),
                                   ("--max-grad-norm", getattr(args, "max_grad_norm", None) is not None))
                  if on]
    resumed_note = ""
    if resuming and resume_kind == "async-hetero":  # the checkpoint's mode: its state only fits that mode
        if mode == "sync":
            raise UsageError("--resume: the run's newest checkpoint is an --mode async-hetero one; resume it without "
                             "--mode sync (or start a new run)")
        mode, resumed_note = "async-hetero", "--resume of an async-hetero run"
    elif resuming:
        if mode == "async-hetero":
            raise UsageError("--resume: the run's newest checkpoint is a --mode sync one (or it has none); resume "
                             "it with --mode sync, or start a new --out for --mode async-hetero")
        sync_flags.append("--resume")
    if mode == "async-hetero" and sync_flags:
        raise UsageError(f"--mode async-hetero does not take {', '.join(sync_flags)} (they belong to the synchronous "
                         "programs); drop them, or use --mode sync")
    optimizer = str(getattr(args, "optimizer", "adamw")).replace("-", "_")
    if mode == "auto" and sync_flags:
        mode = "sync"
    if dense is not None and mode == "sync":
        raise UsageError("--dense-ranks names the dense ranks of --mode async-hetero; drop it for --mode sync")
    if getattr(args, "max_staleness", None) is not None and getattr(args, "mode", "auto") == "sync":
        raise UsageError("--max-staleness bounds the queues of --mode async-hetero; drop it for --mode sync")
    staleness = DEFAULT_MAX_STALENESS if getattr(args, "max_staleness", None) is None else args.max_staleness
    shape = recsys_shape(model, example, optimizer if optimizer in ("sgd", "adamw") else "adamw") if splittable \
        else None
    if shape is None:  # async-hetero forced on a model without the parts: choose_mode says why
        from ..cost_models.recsys import RecsysShape

        shape = RecsysShape((1,), 1, (1,), 0.0, 0.0, 0, 0, 1)
    sync = sync_plan = None
    if mode != "async-hetero" and loss_fn is not None and _plan_sync_first(args, cluster, elastic, sync_flags):
        sync, sync_plan = _priced_sync_plan(args, model, example, loss_fn, cluster, shape, optimizer)
    choice = choose_mode(shape, cluster, mode, staleness, dense, splittable=splittable, sync=sync,
                         sync_plan=sync_plan)
    if resumed_note:
        choice = dataclasses.replace(choice, reason=resumed_note)
    if sync_flags and getattr(args, "mode", "auto") == "auto":
        choice = dataclasses.replace(choice, reason=f"auto: {', '.join(sync_flags)} asks for the synchronous programs")
    return choice


_GRAPH_FLAGS = ("--microbatches", "--stage-ranks", "--nproc MIN:MAX", "--precision bf16",
                "--activation-checkpointing")


def _plan_sync_first(args, cluster, elastic, sync_flags: list[str]) -> bool:
    """Whether :func:`resolve_mode` plans and lowers the synchronous programs to price them: a cpu-only cluster (a
    cuda job captures on the device, :func:`adaptdist.cli.train.on_capture_device`), no elastic range, no pipeline
    flag and no flag that rewrites the model before capture (``_GRAPH_FLAGS``), no ``--consider-pp``."""
    return (tuple(cluster.device_kinds) == ("cpu",) and elastic is None and cluster.world_size > 1
            and not getattr(args, "consider_pp", False)
            and not any(f.startswith(_GRAPH_FLAGS) for f in sync_flags))


def _priced_sync_plan(args, model, example, loss_fn, cluster, shape, optimizer: str):
    """Plan (``--plan``, the ILP when auto) and lower the synchronous programs of ``model`` as ``plan`` and
    ``train`` do, and price them (:func:`~adaptdist.cost_models.recsys.program_sync_cost`); the plan is kept on
    ``args._sync_plan`` for :func:`adaptdist.cli.common.resolve_plan`. Returns ``(cost, text naming the plan)``."""
    from ..annotations import ManualPlan
    from ..compiler.device_placement import parse_batch_split
    from ..compiler.lowering import compile_model
    from ..cost_models.recsys import program_sync_cost
    from ..model_spec import ModelSpec
    from .common import lowering_options

    plan_arg = str(getattr(args, "plan", "auto"))
    opt = str(getattr(args, "optimizer", "adamw")).replace("-", "_")
    result = captured = None
    if plan_arg == "auto":
        from ..compiler.capture import capture
        from ..compiler.planner.summary import run_planner

        captured = capture(model, example, loss_fn)
        result = run_planner(captured, cluster, getattr(args, "mesh", None), opt, None,
                             replicate_fallback=bool(getattr(args, "replicate_fallback", False)), pipeline=False)
        plan = result.plan
    else:
        plan = ManualPlan.parse(plan_arg, ModelSpec.parse(args.model).module(), model)
    programs = compile_model(model, example, loss_fn, cluster.world_size, plan, lowering_options(args, cluster),
                             mesh=getattr(args, "mesh", None) if captured is None else None, captured=captured,
                             cluster=cluster, optimizer=opt,
                             batch_split=parse_batch_split(getattr(args, "batch_split", None)))
    from .pipeline_flags import is_pipeline

    if is_pipeline(programs):  # a saved pipeline plan file: priced as data parallel (sync_cost)
        return None, None
    args._sync_plan = SyncPlan(model, example, plan, captured, result, programs)
    p0 = programs[min(programs)]
    mesh = ",".join(f"{a}={n}" for a, n in p0.mesh.items())
    batch = f"batch split over {p0.plan.batch_axis}" if p0.plan.batch_axis else "batch replicated"
    return program_sync_cost(shape, cluster, programs), f"plan {p0.plan.name!r}: mesh {mesh}, {batch}"


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """The synchronous plan :func:`resolve_mode` priced: for ``model`` and ``example`` (the objects), the plan, the
    captured step and planner result (``--plan auto``; else None) and the lowered programs it priced."""

    model: object
    example: object
    plan: object
    captured: object
    result: object
    programs: dict


def print_mode(choice, console) -> None:
    """Print the chosen mode, each candidate's predicted step and each rank's role to ``console``."""
    from ..compiler.planner.modes import mode_lines

    for line in mode_lines(choice):
        console.print(line, highlight=False, markup=False)


def write_mode_json(path: str, choice) -> None:
    """Write ``choice.describe()`` (mode, roles, shards, predictions) as JSON to ``path``."""
    Path(path).write_text(json.dumps(choice.describe(), indent=1))
