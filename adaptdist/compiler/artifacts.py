"""Offline compilation: ``adaptdist compile`` writes rank artifacts, ``adaptdist run`` trains with them.

An artifact directory (:func:`compile_artifacts`)::

    manifest.json                format version, adaptdist and torch versions, world size, mesh, the
                                 cluster's topology fingerprint, the model, batch and sequence size,
                                 and the sha256 of every other file
    plan.json                    the plan (automatic or manual), as ``adaptdist plan --out`` writes it
    example_batch.safetensors    the factory's example batch (data when the model file has no data())
    rank{r}/program.py           the rank's generated Python, local shapes as comments
    rank{r}/program.json         inputs, outputs, its rows of the batch
    rank{r}/graph.txt            its FX graph in FX's text form (the serialized graph)
    rank{r}/shards.json          per parameter: global shape, placement per mesh axis, and the index
                                 range of every dim this rank holds
    rank{r}/state.safetensors    its parameter shards at step 0
    report.html                  pictures: the mesh, placements per layer, predicted time and memory
                                 per rank

:func:`adaptdist.program.check_artifacts` (what ``adaptdist run`` does before anything runs) refuses, naming the file
and what differs: a missing file, a hash mismatch, another format or torch version, another world
size, or a cluster of another topology. Loading never unpickles: tensors are safetensors, and a
rank's program is its generated source, executed only after its hash matched. Artifacts are code:
the hashes catch corruption and mix-ups, not a malicious author; run artifacts only from sources you
trust.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import AdaptdistError, UsageError
from ..state_layout import shard_layout

log = logging.getLogger("adaptdist.compiler")


@dataclass
class CompileResult:
    """What :func:`compile_artifacts` wrote, and the seconds of each phase (capture, planning, lowering,
    codegen, estimate, writing)."""

    out_dir: Path
    programs: dict[int, Any]
    plan: Any
    phases_s: dict[str, float] = field(default_factory=dict)
    planner: Any = None
    pipeline: bool = False


ARTIFACT_NAMES = ("manifest.json", "example_batch.safetensors", "report.html")
"""Files ``compile -o`` overwrites besides ``rank{r}/`` (``plan.json`` too, but that one may be the ``--plan`` file
itself, put there on purpose: it is rewritten with the plan it holds)."""


def check_replaceable_artifacts(out: Path, flag: str = "-o") -> None:
    """Before any work: ``compile -o OUT`` overwrites ``rank{r}/`` and :data:`ARTIFACT_NAMES` only in a directory
    that is new, holds none of them, or holds an adaptdist artifact manifest (a previous compile).

    Raises:
        NotARunDirError: ``out`` holds some of those names but no adaptdist ``manifest.json``; nothing is written.
    """
    from ..errors import NotARunDirError

    if not out.is_dir():
        return
    found = [n for n in ARTIFACT_NAMES if (out / n).exists()]
    found += sorted(p.name + "/" for p in out.glob("rank*") if p.is_dir() and p.name[4:].isdigit())
    if not found:
        return
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = None
    if isinstance(manifest, dict) and "format_version" in manifest and "adaptdist_version" in manifest:
        return
    raise NotARunDirError(f"{flag} {str(out)!r} holds {', '.join(found)} but no manifest.json of adaptdist "
                          "artifacts: it is not a previous `adaptdist compile -o`, so nothing in it is overwritten; "
                          f"pass another {flag} (a new or empty directory), or move or remove those files yourself")


def compile_artifacts(spec: Any, cluster: Any, *, batch_size: int, seq_len: int, plan_arg: str, out_dir: str | Path,
                      optimizer: str = "adamw", mesh: str | None = None, console: Any = None,
                      options: Any = None, pipeline: Any = None, batch_split: Any = "auto",
                      consider_pp: bool | None = None, data_path: str | None = None) -> CompileResult:
    """Capture the model of ``spec``, plan it for ``cluster`` (``plan_arg``: ``auto``, a preset or a file), lower
    it with ``options`` (:class:`~adaptdist.lowering_options.LoweringOptions`; None: the defaults) placed on the
    cluster's devices (``batch_split``: see :func:`~.device_placement.place_on_devices`), and write the
    artifact directory (module docstring). With ``pipeline``
    (:class:`~adaptdist.compiler.pipeline_lowering.PipelineOptions`: ``--plan pp``, ``--mesh pp=...``; ``plan_arg``
    then names the plan inside the stages, ``pp``/``auto`` none), or a saved pipeline plan, the directory holds
    pipeline programs instead (:func:`adaptdist.stage_program_io.save_pipeline_programs`: the same
    manifest, and report.html with the pipeline section). ``consider_pp``: ``--plan auto`` weighs pipeline
    stages too (None: :data:`~.planner.summary.PIPELINE_IN_AUTO`). ``data_path``: ``--data``, for a model file
    whose factory sizes the model from its data (builtin:dlrm's tables); recorded in the manifest with every
    parameter's shape, so that ``adaptdist run --data`` of other data is refused clearly.

    Raises:
        AdaptdistError: a bad model, plan or cluster (from capture, the planner or the lowering); UsageError
            when ``out_dir`` is a file.
    """
    from safetensors.torch import save as save_tensors

    from ..annotations import ManualPlan
    from ..cost_models.estimate import estimate_programs
    from ..program import save_programs
    from .capture import capture
    from ..lowering_options import LoweringOptions
    from .lowering import compile_model
    from .planner.summary import print_summary, run_planner
    from .report import render_report

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {str(out)!r} exists and is not a directory; pass a directory path")
    phases: dict[str, float] = {}
    torch.manual_seed(0)
    model, example, loss_fn = spec.build(batch_size, seq_len, data_path=data_path)
    from ..throughput import throughput_unit

    sizes = {"data": data_path, "param_shapes": {k: list(v.shape) for k, v in model.state_dict().items()},
             "throughput_unit": throughput_unit(example, model)[0]}  # what `run` counts its throughput in
    t = time.perf_counter()
    captured = capture(model, example, loss_fn)
    phases["capture"] = time.perf_counter() - t
    t = time.perf_counter()
    planner = None
    if pipeline is not None:  # what --microbatches/--schedule leave open, the planner chooses (pipeline_auto.py)
        from .pipeline_auto import choose_pipeline_plan
        from .pipeline_lowering import mesh_preset

        decision = choose_pipeline_plan(
            captured, cluster, cluster.world_size, mesh=mesh, microbatches=pipeline.microbatches,
            schedule=pipeline.schedule, optimizer=optimizer, stage_ranks=getattr(pipeline, "stage_ranks", None),
            inner=mesh_preset(mesh, spec.module(), model) if plan_arg in ("pp", "auto")
            else ManualPlan.parse(plan_arg, spec.module(), model))
        if console is not None:
            from rich.markup import escape

            for line in decision.lines():
                console.print(escape(line))
        plan, mesh, pipeline = decision.plan, None, None
    elif plan_arg == "auto":
        options = options if options is not None else LoweringOptions()
        planner = run_planner(captured, cluster, mesh, optimizer, console, replicate_fallback=options.replicate_fallback,
                              pipeline=consider_pp)
        if console is not None:
            print_summary(console, planner)
        plan, mesh = planner.plan, None
    else:
        plan = ManualPlan.parse(plan_arg, spec.module(), model)
    phases["planning"] = time.perf_counter() - t
    timings: dict[str, float] = {}
    programs = compile_model(model, example, loss_fn, cluster.world_size, plan, options, mesh=mesh, captured=captured,
                             timings=timings, pipeline=pipeline, cluster=cluster, optimizer=optimizer,
                             batch_split=batch_split)
    phases.update(timings)
    from ..stage_program import PipelineRankProgram

    if isinstance(programs[0], PipelineRankProgram):
        return _write_pipeline_artifacts(programs, out, spec, cluster, example, batch_size, seq_len, optimizer,
                                         options, phases, render_report, sizes=sizes)
    t = time.perf_counter()
    from ..device_assignment import program_cluster

    estimate = estimate_programs(programs, program_cluster(programs[0].plan, cluster), optimizer)
    phases["estimate"] = time.perf_counter() - t
    t = time.perf_counter()
    extra_files: dict[str, str | bytes] = {
        "example_batch.safetensors": save_tensors({f"b{i}": x.detach().clone(memory_format=torch.contiguous_format)
                                                     for i, x in enumerate(example)})}
    for r, p in programs.items():
        extra_files[f"rank{r}/graph.txt"] = str(p.graph_module.graph)
        extra_files[f"rank{r}/shards.json"] = json.dumps(shard_layout(p), indent=1)
    model_file = Path(spec.file)
    import hashlib

    extra = {
        "cluster_fingerprint": cluster.topology_fingerprint(),
        "cluster_hosts": [[h.name, len(h.devices), h.device_kind] for h in cluster.hosts],
        "model": spec.text, "model_file": str(model_file),
        "model_file_sha256": hashlib.sha256(model_file.read_bytes()).hexdigest(),
        "batch_size": batch_size, "seq_len": seq_len, "optimizer": optimizer,
        "num_batch_inputs": len(example), **sizes,
    }
    extra["rng"] = options.rng  # how the runner seeds its ranks (LoweringOptions.rng)
    d = save_programs(programs, out, extra=extra, extra_files=extra_files)
    manifest = json.loads((d / "manifest.json").read_text())
    hosts = [program_cluster(programs[0].plan, cluster).device(r).host for r in range(cluster.world_size)]
    phases["writing"] = time.perf_counter() - t
    summary = ""
    if planner is not None:
        ev = planner.predicted
        summary = (f"automatic plan: {len(planner.tried)} mesh shapes tried; the planner's ILP objective "
                   f"{1e3 * ev.step_s:.3f} ms per step, {ev.memory_bytes / 2**20:,.1f} MiB per rank (see 'Predicted "
                   "step time' for how it differs from the cost model's estimate)")
    from .report import pipeline_view, rank_mapping_view

    plan = programs[0].plan
    device_names = [f"{cluster.device(r).kind}@{cluster.device(r).host}" for r in range(cluster.world_size)]
    report = render_report(title=f"adaptdist compile {spec.text}", manifest=manifest, plan=plan,
                           fqns=list(programs[0].input_fqns), hosts=hosts, estimate=estimate,
                           planner_summary=summary, phases_s=phases, param_fqns=list(programs[0].param_fqns),
                           planner_prediction=planner.predicted if planner is not None else None,
                           pipeline=pipeline_view(plan, cluster.world_size),
                           rank_mapping=rank_mapping_view(plan, device_names),
                           state_placements=programs[0].state_placements)
    (d / "report.html").write_text(report)
    from ..program import _sha256

    manifest["files"]["report.html"] = _sha256(d / "report.html")
    (d / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return CompileResult(d, programs, programs[0].plan, phases, planner)


def _write_pipeline_artifacts(programs: dict, out: Path, spec: Any, cluster: Any, example: tuple, batch_size: int,
                              seq_len: int, optimizer: str, options: Any, phases: dict[str, float],
                              render_report: Any = None, sizes: dict | None = None) -> CompileResult:
    """:func:`compile_artifacts`'s writing for pipeline programs: the manifest's same fields, the example batch, and
    ``report.html`` with the pipeline section (stages, predicted F/B/W, the predicted timeline of the schedule)."""
    import hashlib

    from safetensors.torch import save as save_tensors

    from ..lowering_options import LoweringOptions
    from ..stage_program_io import save_pipeline_programs

    t = time.perf_counter()
    model_file = Path(spec.file)
    options = options if options is not None else LoweringOptions()
    extra = {"cluster_fingerprint": cluster.topology_fingerprint(),
             "cluster_hosts": [[h.name, len(h.devices), h.device_kind] for h in cluster.hosts],
             "model": spec.text, "model_file": str(model_file),
             "model_file_sha256": hashlib.sha256(model_file.read_bytes()).hexdigest(),
             "batch_size": batch_size, "seq_len": seq_len, "optimizer": optimizer, "num_batch_inputs": len(example),
             "rng": options.rng, **(sizes or {})}
    files = {"example_batch.safetensors": save_tensors({f"b{i}": x.detach().clone(memory_format=torch.contiguous_format)
                                                        for i, x in enumerate(example)})}
    d = save_pipeline_programs(programs, out, extra=extra, extra_files=files)
    phases["writing"] = time.perf_counter() - t
    if render_report is not None:
        _pipeline_report(d, programs, spec, cluster, phases, render_report)
    return CompileResult(d, programs, programs[0].plan, phases, None, pipeline=True)


def _pipeline_report(d: Path, programs: dict, spec: Any, cluster: Any, phases: dict[str, float],
                     render_report: Any) -> None:
    """``report.html`` of pipeline programs (:func:`.report.pipeline_view` with every rank's compute actions of
    one step), listed in the manifest with its digest."""
    from ..program import _sha256
    from ..runtime.trace_view import pipeline_actions
    from .pipeline_report import pipeline_comm_rows, pipeline_rank_rows, stage_holders
    from .report import pipeline_view, rank_mapping_view

    manifest = json.loads((d / "manifest.json").read_text())
    plan = programs[0].plan
    view = pipeline_view(plan, cluster.world_size)
    if view is not None:
        try:
            if all("forward" in (st.predicted_s or {}) for st in plan.pipeline.stages):  # the planner's times
                view = dataclasses.replace(view, actions=pipeline_actions(plan.pipeline, cluster.world_size))
        except AdaptdistError:  # the table stands without the timeline
            pass
    hosts = [cluster.device(r).host for r in range(cluster.world_size)]
    device_names = [f"{cluster.device(r).kind}@{cluster.device(r).host}" for r in range(cluster.world_size)]
    fqns = list(dict.fromkeys(f for p in programs.values() for f in p.state))
    params = list(dict.fromkeys(f for p in programs.values() for f in p.param_fqns))
    placements = {f: pl for p in programs.values() for f, pl in p.state_placements.items()}
    report = render_report(title=f"adaptdist compile {spec.text}", manifest=manifest, plan=plan, fqns=fqns,
                           hosts=hosts, estimate=None, planner_summary="", phases_s=phases, param_fqns=params,
                           planner_prediction=None, pipeline=view,
                           rank_mapping=rank_mapping_view(plan, device_names), state_placements=placements,
                           pipeline_comm={r: pipeline_comm_rows(p) for r, p in programs.items()},
                           pipeline_ranks=pipeline_rank_rows(programs, manifest.get("optimizer", "adamw")),
                           stage_holders=stage_holders(programs))
    (d / "report.html").write_text(report)
    manifest["files"]["report.html"] = _sha256(d / "report.html")
    (d / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
