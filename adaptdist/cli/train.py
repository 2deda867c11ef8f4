"""``adaptdist train``: compile the plan, launch the ranks, train with periodic checkpoints, restart on failure,
resume a stopped run (``--resume DIR``), follow an elastic world size (``--nproc MIN:MAX``).

A run's directory (``--out``) holds ``run.json`` (the settings it was started with, and its state: running,
complete, interrupted, failed), ``programs/`` (the rank programs for the launch world size), ``programs_cache/``
(programs re-planned for other world sizes), ``checkpoints/step-XXXXXXXX/`` (:mod:`adaptdist.runtime.
checkpoint_store`), ``status/`` (each rank's record of each attempt), ``events.jsonl`` (restarts, re-plans,
resumes), and at the end ``model.safetensors`` and ``summary.json``. Outputs are written under temporary names
and renamed; ``run.json`` says ``complete`` only once everything was written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import shutil
import sys
import time
from pathlib import Path

from ..errors import RuntimeLaunchError, UsageError

RUN_FILE = "run.json"
RUN_FILE_VERSION = 1
RESTORED = ("model", "batch_size", "seq_len", "optimizer", "lr", "seed", "plan", "mesh", "data", "checkpoint_every",
            "keep", "max_grad_norm", "bucket_mb", "replicate_fallback", "async_checkpoint", "max_restarts",
            "collective_timeout_s", "batch_norm", "precision", "activation_checkpointing", "rng",
            "microbatches", "schedule", "batch_split", "stage_ranks", "mode", "max_staleness")
"""The settings ``--resume`` takes from the run (only ``--steps``, ``--nproc`` / ``--cluster`` and ``--out`` may
change)."""
MAY_CHANGE = ("steps", "nproc", "cluster", "out")
OUTPUTS = ("checkpoints", "checkpoint", "status", "events.jsonl", "model.safetensors", "summary.json", "programs",
           "programs_rebalanced",
           "programs_cache", RUN_FILE, "result.json", "example_batch.safetensors", "train_config.pkl",
           "trace", "trace.json", "timeline.png", "timeline.html")
"""What a run writes into ``--out``; a new run into the same directory removes the previous run's first."""


def nproc_range(text: str):
    """An argparse ``type=`` for ``train --nproc``: ``N`` (an int > 0) or ``MIN:MAX`` (an elastic range, a tuple)."""
    import argparse

    parts = text.split(":")
    if len(text) > 80:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX (integers), got {len(text)} characters")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX (integers), got {text!r}") from None
    if len(nums) > 2 or any(n < 1 for n in nums) or (len(nums) == 2 and nums[0] > nums[1]):
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    from ..arg_types import local_ranks

    local_ranks(str(nums[-1]))  # the stated limit (adaptdist/limits.py)
    return nums[0] if len(nums) == 1 else (nums[0], nums[1])


def _rebase_paths(args, run_cwd: str | None) -> None:
    """The run's relative file paths (model file, --data, a plan or cluster file), recorded as typed, made to name
    the same files from another working directory: each taken relative to ``run_cwd`` (the directory the run was
    started in) where it names a file there and none here."""
    if not run_cwd:
        return
    base = Path(run_cwd)

    def rebased(path: str) -> str:
        p = Path(path)
        return str(base / p) if not p.is_absolute() and not p.exists() and (base / p).exists() else path

    model = getattr(args, "model", None)
    if isinstance(model, str) and not model.startswith("builtin:"):
        file, sep, factory = model.rpartition(":")
        if sep and file:
            args.model = f"{rebased(file)}:{factory}"
    for key in ("data", "plan", "cluster"):
        value = getattr(args, key, None)
        if isinstance(value, str) and value:
            setattr(args, key, rebased(value))


def _restored_args(args, defaults: dict, keys: tuple[str, ...] = RESTORED, directory: str | None = None,
                   command: str = "adaptdist train") -> None:
    """``--resume DIR``: take the run's settings from ``DIR/run.json`` into ``args`` (in place).

    Raises:
        UsageError: DIR holds no run, or a flag other than --steps/--nproc/--cluster/--out was given a value that
            differs from the run's.
    """
    d = Path(directory if directory is not None else args.resume)
    f = d / RUN_FILE
    if not f.is_file():
        raise UsageError(f"--resume {str(d)!r}: no {RUN_FILE} there; pass the --out directory of a {command} run")
    try:
        run = json.loads(f.read_text())
        settings = run["settings"]
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--resume: {str(f)!r} cannot be read ({type(e).__name__}: {e})") from None
    for key in keys:
        given = getattr(args, key, None)
        recorded = settings.get(key, defaults.get(key))  # a setting newer than the run: its default
        if key == "stage_ranks" and isinstance(recorded, list):  # JSON's list of the parsed tuple
            recorded = tuple(recorded)
        if given != defaults.get(key) and given != recorded:
            shown = repr(recorded) if recorded is not None else ("not set (the default, 1f1b)" if key == "schedule"
                                                                  else "not set (its default)")
            raise UsageError(f"--resume continues the run in {str(d)!r} with its own settings: --{key.replace('_', '-')} "
                             f"was {shown} there, not {given!r}; only --steps, --nproc/--cluster, --out and "
                             "--threads-per-rank may change (start a new run with another --out to change it)")
        setattr(args, key, recorded)
    if args.steps == defaults.get("steps"):
        args.steps = settings.get("steps", args.steps)
    if hasattr(args, "nproc") and args.nproc is None and args.cluster is None:
        args.nproc = settings.get("nproc")
        args.cluster = settings.get("cluster")
    _rebase_paths(args, run.get("cwd"))
    if isinstance(getattr(args, "nproc", None), list):
        args.nproc = tuple(args.nproc)
    if isinstance(getattr(args, "nproc", None), int) and getattr(args, "mesh", None):
        args.mesh = _pipeline_mesh_for(args.mesh, args.nproc)
    if isinstance(getattr(args, "nproc", None), int) and getattr(args, "stage_ranks", None):
        args.stage_ranks = _stage_ranks_for(tuple(args.stage_ranks), args.nproc)


def _stage_ranks_for(sizes: tuple[int, ...], nproc: int) -> tuple[int, ...] | None:
    """A resumed ``--stage-ranks`` run on ``nproc`` ranks: the same sizes where they fit, scaled where ``nproc`` is
    a multiple of their sum (``2,1`` on 6 ranks: ``4,2``), one rank per stage where ``nproc`` is the number of
    stages; else None (the planner chooses the stages, as ``--plan pp``)."""
    if sum(sizes) == nproc:
        return sizes
    if nproc % sum(sizes) == 0:
        return tuple(n * (nproc // sum(sizes)) for n in sizes)
    if nproc == len(sizes):
        return (1,) * len(sizes)
    return None


def _pipeline_mesh_for(mesh: str, nproc: int) -> str:
    """A resumed pipeline run's ``--mesh pp=P,dp=D[,tp=T]`` on ``nproc`` ranks: the same stages and other axes,
    the data-parallel axis resized to fit (``pp=2,dp=2`` on 2 ranks: ``pp=2,dp=1``); ``mesh`` unchanged where it
    has no pp axis, already fits, or no dp size fits (the lowering then names the numbers)."""
    try:
        axes = [(a.strip(), int(n)) for a, n in (part.split("=") for part in mesh.split(","))]
    except ValueError:
        return mesh
    names = [a for a, _ in axes]
    if "pp" not in names or math.prod(n for _, n in axes) == nproc:
        return mesh
    fixed = math.prod(n for a, n in axes if a != "dp")
    if nproc % fixed:
        return mesh
    dp = nproc // fixed
    axes = [(a, dp if a == "dp" else n) for a, n in axes] if "dp" in names else axes + [("dp", dp)]
    return ",".join(f"{a}={n}" for a, n in axes)


def check_resumable(src: Path, steps: int, console):
    """Before anything is changed: the run in ``src`` has a usable checkpoint short of ``steps`` (or none at all,
    which the log says). Returns the newest good checkpoint or None.

    Raises:
        CheckpointError: checkpoints exist but none is usable (each one's reason is printed first).
        UsageError: the newest good checkpoint is at ``steps`` or beyond: nothing to train.
    """
    from ..errors import CheckpointError
    from ..runtime.checkpoint_store import latest_good, list_checkpoints

    root = src / "checkpoints"
    found = list_checkpoints(root)
    info = latest_good(root, lambda m: console.print(f"[yellow]{m}[/]"))
    if found and info is None:
        raise CheckpointError(f"--resume {str(src)!r}: none of its {len(found)} checkpoints is usable (see above); "
                              "nothing was changed. Restore a good checkpoint from a copy, or start a new run")
    if info is None:
        console.print(f"[yellow]{src} holds no checkpoint: the run starts again from step 0[/]")
    elif info.step >= steps:
        raise UsageError(f"--resume: the run in {str(src)!r} is at step {info.step} already (its newest good "
                         f"checkpoint); pass --steps greater than {info.step} to train on")
    return info


def lock_out_dir(out: Path):
    """Hold ``OUT/.lock`` (an exclusive flock, released when the process ends) so that a second run cannot write
    into a directory a running one uses. Returns the open lock file (keep it referenced).

    Raises:
        UsageError: another process holds the lock; names its pid.
    """
    import fcntl

    f = open(out / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise UsageError(f"{str(out)!r} is in use by another adaptdist run (pid {holder}); wait for it, stop it, or "
                         "pass another --out") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def _is_run_file(f: Path) -> bool:
    """``f`` is a ``run.json`` as :func:`write_run_file` writes it (the marker of an adaptdist run directory)."""
    try:
        run = json.loads(f.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(run, dict) and "version" in run and isinstance(run.get("settings"), dict)


def check_replaceable(out: Path, flag: str = "--out") -> list[str]:
    """Before anything is created or written: the names of :data:`OUTPUTS` in ``out`` that a new run would remove
    (empty when ``out`` does not exist or holds none of them).

    Raises:
        NotARunDirError: ``out`` holds some of those names but no adaptdist ``run.json``: it was never an
            adaptdist run (or its marker is gone), so it may hold the user's own files; nothing is removed.
    """
    from ..errors import NotARunDirError

    if not out.is_dir():
        return []
    found = [name for name in OUTPUTS if (out / name).exists()]
    if not found or _is_run_file(out / RUN_FILE):
        return found
    marker = (f"its {RUN_FILE} is not one adaptdist wrote" if (out / RUN_FILE).exists()
              else f"no {RUN_FILE}, the file every adaptdist run writes first")
    raise NotARunDirError(f"{flag} {str(out)!r} holds {', '.join(found)} but {marker}: it is not a previous "
                          f"adaptdist run, so nothing in it is replaced or removed; pass another {flag} (a new or "
                          "empty directory), or move or remove those files yourself")


def _to_be_created(out: Path) -> list[Path]:
    """What :func:`~adaptdist.cli.common.prepare_out_dir` and :func:`lock_out_dir` will create for ``out`` (the
    lock file, the directory and its missing parents, innermost first): :func:`_remove_created` takes them away
    again when the command is refused before the run begins."""
    made = [] if (out / ".lock").exists() else [out / ".lock"]
    p = out
    while not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    return made


def _remove_created(out: Path, created: list[Path]) -> None:
    """Undo :func:`_to_be_created`'s list, never removing a directory that is not empty."""
    for p in created:
        try:
            p.unlink() if p.name == ".lock" and p.parent == out else p.rmdir()
        except OSError:
            return


def _clear_previous_run(out: Path, console) -> None:
    """A new run into ``out``: remove what a previous adaptdist run wrote there (never anything else; a directory
    without the run's ``run.json`` is refused by :func:`check_replaceable`, which callers run before any work)."""
    found = check_replaceable(out)
    if not found:
        return
    console.print(f"[yellow]{out} holds a previous run ({', '.join(found)}): replacing it (use --resume {out} to "
                  "continue that run instead)[/]")
    for name in found:
        p = out / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def _take_checkpoints(src: Path, out: Path, console) -> None:
    """``--resume SRC --out OUT``: copy SRC's newest good checkpoint into OUT's checkpoints."""
    from ..runtime.checkpoint_store import latest_good

    info = latest_good(src / "checkpoints", lambda m: console.print(f"[yellow]{m}[/]"))
    if info is None:
        return
    dest = out / "checkpoints" / info.path.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(info.path, dest)


def write_run_file(out: Path, settings: dict, state: str) -> None:
    """``OUT/run.json`` with the run's ``settings`` and ``state`` (running, complete, interrupted, failed)."""
    tmp = out / f"{RUN_FILE}.{os.getpid()}.tmp"  # several hosts' launchers may write it
    tmp.write_text(json.dumps({"version": RUN_FILE_VERSION, "state": state, "settings": settings,
                               "cwd": os.getcwd()}, indent=1, default=list))  # (what relative paths there mean)
    tmp.replace(out / RUN_FILE)


def write_summary(out: Path, result: dict, wall_s: float, **fields) -> tuple[dict, str]:
    """``OUT/summary.json`` of a finished run from rank 0's ``result`` (losses, events; see ``run_worker``) and
    ``fields`` (throughput, ranks, plan, ...), written under a temporary name and renamed; then ``run.json``'s
    state ``complete``. Returns the summary and the loss text of :func:`~adaptdist.runtime.worker.loss_summary`."""
    from ..runtime.worker import loss_summary

    losses = result["losses"]
    loss_fields, loss_text = loss_summary(losses)
    events = result.get("events", [])
    summary = {"steps": len(losses), **loss_fields, "wall_s": wall_s, **fields, "losses": losses,
               "restarts": [e for e in events if e["event"] == "restart"],
               "resumes": [e for e in events if e["event"] == "resume"],
               "rebalances": [{k: v for k, v in e.items() if k not in ("event", "quiet")} for e in events
                              if e["event"] == "rebalance"], "complete": True}
    if result.get("transports") is not None:  # mesh axis -> shm | gloo | none (the collectives' transport)
        summary["transports"] = result["transports"]
    if result.get("shm_all_reduce") is not None:  # rank 0's large shm all_reduces, and those read in place
        summary["shm_all_reduce"] = result["shm_all_reduce"]
    tmp = out / f"summary.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(out / "summary.json")
    _set_state(out, "complete")
    return summary, loss_text


def _set_state(out: Path, state: str) -> None:
    """Set ``run.json``'s state, keeping the rest of the file (a multi-host run's job section too)."""
    f = out / RUN_FILE
    if f.is_file():
        run = json.loads(f.read_text())
        tmp = out / f"{RUN_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({**run, "state": state}, indent=1, default=list))
        tmp.replace(f)


def cmd_train(args, defaults: dict) -> int:
    """``adaptdist train``.

    Raises:
        AdaptdistError: any bad input (model, data, cluster, plan, resume directory); ``main`` prints it as one
            paragraph.
    """
    from ..console import report_console
    from ..model_spec import ModelSpec
    from ..runtime.timeouts import Timeouts
    from .common import _cluster, prepare_out_dir

    console = report_console(stderr=True)
    if args.join:
        return cmd_join(Path(args.join), console)
    resume_src = Path(args.resume) if args.resume else None
    if resume_src is not None:
        _restored_args(args, defaults)
        from .common import check_comm

        check_comm(args)  # the run's --comm, before any capture
        if args.out == defaults.get("out"):
            args.out = str(resume_src)
    elastic = args.nproc if isinstance(args.nproc, tuple) else None
    if elastic is not None:
        if args.cluster:
            raise UsageError("--nproc MIN:MAX starts local ranks; it takes no --cluster")
        if args.max_restarts == 0:
            console.print("[yellow]--nproc MIN:MAX with --max-restarts 0: a rank lost ends the job, and even a rank "
                          "joining may (torch's agents stop their workers to take it in, and a worker that sees its "
                          "peer go first fails); pass --max-restarts 1 or more[/]")
        args.nproc = elastic[1]
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
    timeouts = Timeouts.for_collective(args.collective_timeout_s)
    timeouts.check()
    cluster = _cluster(args)
    check_local_devices(cluster)
    from ..runtime.affinity import is_this_host

    if len(cluster.hosts) > 1 or not is_this_host(cluster.hosts[0].name):
        raise UsageError(f"{cluster!r}: `train` launches ranks on this machine only so far; describe one host "
                         "named localhost")
    nproc = cluster.world_size
    if getattr(args, "precision", "fp32") == "bf16" and getattr(args, "batch_norm", "local") == "sync":
        raise UsageError("--precision bf16 with --batch-norm sync is not supported yet (the synchronized BatchNorm "
                         "rewrite does not follow autocast's casts): use --batch-norm local, or --precision fp32")
    spec = ModelSpec.parse(args.model)
    if resume_src is None or Path(args.out).resolve() != resume_src.resolve():
        check_replaceable(Path(args.out))  # a folder that is not an adaptdist run is refused before any work
    # refused before anything is created (the --out folder, its .lock)
    resume_info = check_resumable(resume_src, args.steps, console) if resume_src is not None else None
    created = _to_be_created(Path(args.out))
    out = prepare_out_dir(args.out)
    lock = lock_out_dir(out)  # held until this process ends
    started = []
    try:
        resuming_here = resume_src is not None and out.resolve() == resume_src.resolve()
        import torch

        torch.manual_seed(args.seed)
        # a bad factory (or, for one that reads --data, bad data) fails before the previous run is touched
        built = spec.build(args.batch_size, args.seq_len, data_path=args.data)
        settings = {k: getattr(args, k, None) for k in (*RESTORED, "steps")}
        settings.update(nproc=list(elastic) if elastic else args.nproc, cluster=args.cluster,
                        mode=getattr(args, "mode", "auto"), max_staleness=getattr(args, "max_staleness", None),
                        dense_ranks=getattr(args, "dense_ranks", None))

        def begin() -> None:
            """Called by :func:`_train` once everything is checked and compiled, right before its first write: only
            then is the previous run in ``out`` replaced (a run that fails before leaves it whole)."""
            if not resuming_here:
                _clear_previous_run(out, console)
                if resume_src is not None:
                    _take_checkpoints(resume_src, out, console)
            # resuming in place: the stopped run's programs, weights and summary stay until their successors
            # replace them
            write_run_file(out, settings, "running")
            started.append(True)

        from .modes import resolve_mode

        resume_kind = None if resume_info is None else resume_info.meta.get("kind", "sync")
        choice = resolve_mode(args, built[0], built[1], cluster, console, elastic=elastic,
                              resuming=resume_src is not None, resume_kind=resume_kind, loss_fn=built[2])
        if resume_kind == "async-hetero":  # refused before anything is changed
            from ..runtime.hetero_checkpoint import check_meta

            tables = built[0].sparse_arch.tables
            check_meta(resume_info.meta, resume_info.path, args.optimizer, [t.weight.shape[0] for t in tables],
                       tables[0].embedding_dim)
        args._mode_choice = choice
        if len(cluster.device_kinds) > 1 and (choice is None or choice.mode != "async-hetero"):
            raise UsageError(f"{cluster!r} mixes cpu and cuda ranks: `train` runs such a cluster in --mode "
                             "async-hetero (cpu ranks hold the embedding tables, cuda ranks the dense part, their "
                             "messages crossing as CPU tensors); synchronous plans need one device kind: describe "
                             "only the cpu or only the cuda ranks")
        if choice is not None and choice.mode == "async-hetero":
            return train_async(args, spec, built, out, cluster, choice, timeouts, console, begin)
        if choice is not None:
            from .modes import print_mode

            print_mode(choice, console)
        return _train(args, spec, built, out, cluster, nproc, elastic, resume_src, settings, timeouts, console,
                      begin=begin)
    except BaseException:
        if started and json.loads((out / RUN_FILE).read_text()).get("state") == "running":
            _set_state(out, "failed")
        if not started:  # refused before the run began: leave no trace of this attempt
            lock.close()
            _remove_created(out, created)
        raise
    finally:
        lock.close()


def _train(args, spec, built: tuple, out: Path, cluster, nproc: int, elastic, resume_src, settings: dict, timeouts,
           console, begin=lambda: None) -> int:
    """The body of :func:`cmd_train` once the run directory is locked; ``built`` is the factory's
    ``(model, example_batch, loss_fn)``, made with ``--seed``. Checks the data, compiles, then calls ``begin()``
    (which replaces the previous run in ``out``) before it writes anything there."""
    import torch
    from safetensors.torch import save_file

    from ..compiler.lowering import compile_model
    from ..compiler.replan import ProgramSource
    from ..program import save_programs
    from ..runtime.launch import launch_local
    from ..runtime.preflight import check_host_memory
    from ..runtime.worker import DataSpec, TrainConfig, run_worker
    from .common import check_first_batch, lowering_options, resolve_plan

    model, example, loss_fn = built
    from ..compiler.training_features import apply_training_features

    features = dict(precision=getattr(args, "precision", "fp32"),
                    activation_checkpointing=bool(getattr(args, "activation_checkpointing", False)))
    model, loss_fn = apply_training_features(model, loss_fn, **features)
    module = spec.module()
    has_data = callable(getattr(module, "data", None))
    if args.data and not has_data:
        raise UsageError(f"--data was given but {spec.file} defines no data(batch_size, seq_len, path=...) function")
    from ..runtime.batch_check import batch_shapes

    data = DataSpec(str(spec.file), "data" if has_data else None, args.batch_size, args.seq_len,
                    path=args.data, seed=args.seed, batch_shapes=batch_shapes(example))
    if not has_data:  # (the example batch is saved below, once the previous run's outputs are gone)
        data = DataSpec(str(spec.file), None, args.batch_size, args.seq_len, batch_file=str(out / "example_batch.safetensors"))
        console.print(f"[yellow]{spec.file.name} defines no data() function: training on its example batch repeated[/]")
    else:
        check_first_batch(data, example, model, loss_fn, spec.text)  # fail here, clearly, on bad data

    n_params = sum(p.numel() for p in model.parameters())
    x0 = example[0]
    from ..throughput import throughput_unit

    unit, items_per_step = throughput_unit(example, model)
    tokens = unit == "tokens"
    console.print(f"model {spec.text}: {type(model).__name__}, {n_params:,} parameters; {cluster!r}"
                  f"{f' (elastic: {elastic[0]} to {elastic[1]} ranks)' if elastic else ''}; "
                  f"global batch {' x '.join(map(str, x0.shape)) if tokens else x0.shape[0]}")
    rows = x0.shape[0] if isinstance(x0, torch.Tensor) and x0.dim() else None
    if rows is not None and rows != args.batch_size and not has_data:
        console.print(f"[yellow]warning: {spec.text}({args.batch_size}, {args.seq_len}) returned an example batch of "
                      f"{rows} rows, not --batch-size {args.batch_size}: training on its {rows} rows (the factory "
                      "sizes the batch; pass batch_size on to it)[/]")
    t0 = time.perf_counter()
    from .pipeline_flags import compile_pipeline_or_none

    options = lowering_options(args, cluster)
    # captured where the ranks run (a cuda job's graph holds cuda kernels, e.g. its attention); `model` stays on cpu
    cmodel, cexample = on_capture_device(model, example, cluster)
    programs = compile_pipeline_or_none(args, spec, cmodel, cexample, loss_fn, nproc, options, cluster, console)
    if programs is None:
        plan, captured = resolve_plan(args, spec, cmodel, cexample, loss_fn, cluster, console, args.optimizer,
                                      layers=False)
        from ..compiler.device_placement import parse_batch_split, placement_line

        programs = compile_model(cmodel, cexample, loss_fn, nproc, plan, options,
                                 mesh=args.mesh if captured is None else None, captured=captured, cluster=cluster,
                                 optimizer=args.optimizer,
                                 batch_split=parse_batch_split(getattr(args, "batch_split", None)))
        if programs[0].plan.devices is not None:
            console.print(placement_line(programs[0].plan))
    from .pipeline_flags import is_pipeline

    pipeline = is_pipeline(programs)
    if pipeline and cluster.device_kinds != ("cpu",):
        raise UsageError(f"{cluster!r}: pipeline plans run on cpu ranks only so far; use --plan dp|fsdp|tp on cuda")
    if pipeline:  # pipeline programs (--plan pp, --mesh pp=..., or a saved pipeline plan)
        from .pipeline_flags import save_and_describe_pipeline

        plan = programs[0].plan
        if resume_src is not None:  # (before begin(): a checkpoint of another model leaves --out as it was)
            _check_checkpoint_fits(resume_src, spec.text, None, console, programs=programs)
    else:
        peak = check_host_memory(programs, args.optimizer, nproc, enforce=not args.skip_memory_check)
        if resume_src is not None:
            _check_checkpoint_fits(resume_src, spec.text, programs[0], console)
    source = None
    rebalance_after = _rebalance_after(args, programs, cluster, pipeline, console)
    if elastic or resume_src is not None or rebalance_after:  # one door for every other world size (and the rows)
        source = ProgramSource(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                               plan=args.plan, mesh=args.mesh, optimizer=args.optimizer,
                               cache_dir=str(out / "programs_cache"), base_world_size=nproc,
                               base_program_dir=str(out / "programs"), options=options,
                               compile_wait_s=timeouts.compile_wait_s, microbatches=getattr(args, "microbatches", None),
                               schedule=getattr(args, "schedule", None), data_path=args.data, **features)
        if elastic:
            source.check_elastic()
    begin()  # everything checked: only now is the previous run in --out replaced
    if not has_data:
        # a copy of each: safetensors refuses tensors that share memory, e.g. (x, x) for an autoencoder
        save_file({f"b{i}": t.detach().clone(memory_format=torch.contiguous_format) for i, t in enumerate(example)},
                  str(out / "example_batch.safetensors"))
    if pipeline:
        save_and_describe_pipeline(programs, out / "programs", console, time.perf_counter() - t0)
    else:
        save_programs(programs, out / "programs")
        mesh = ",".join(f"{a}={n}" for a, n in programs[0].mesh.items())
        digits = 0 if peak >= 10 * 2**20 else 2  # a small model's peak is not "0 MiB"
        console.print(f"compiled plan {plan.name!r} (mesh {mesh}) for {nproc} ranks in "
                      f"{time.perf_counter() - t0:.1f} s "
                      f"-> {out / 'programs'} (read rank0/program.py); predicted peak memory "
                      f"{peak / 2**20:,.{digits}f} MiB per rank")
    threads = args.threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    from ..runtime.worker import _next_attempt

    cfg = TrainConfig(first_attempt=_next_attempt(str(out)), program_dir=str(out / "programs"), out_dir=str(out), data=data, steps=args.steps, lr=args.lr,
                      optimizer=args.optimizer, seed=args.seed, threads_per_rank=threads,
                      timeout_s=timeouts.collective_s, backend=_backend(cluster),
                      items_per_step=items_per_step,
                      unit=unit, max_grad_norm=args.max_grad_norm, checkpoint_every=args.checkpoint_every,
                      keep=args.keep, model_name=spec.text, program_source=source,
                      async_checkpoint=bool(getattr(args, "async_checkpoint", False)),
                      run_meta={"cluster": _cluster_doc(cluster), "config": settings},
                      cpus_of_rank=_cpus_of_rank(cluster, programs[0].plan),
                      devices_of_rank=_devices_of_rank(cluster, programs[0].plan))
    cfg = dataclasses.replace(cfg, rng=options.rng)  # every rank seeds --seed alike under --rng global (worker.py)
    cfg = dataclasses.replace(cfg, trace=bool(getattr(args, "trace", False)), rebalance_after=rebalance_after,
                              rebalance_cluster=cluster if rebalance_after else None)
    t0 = time.perf_counter()
    launched_s = time.time()
    try:
        if elastic:
            result = _launch_elastic(cfg, out, elastic, args.max_restarts, timeouts)
        else:
            launch_local(run_worker, (cfg,), nproc, max_restarts=args.max_restarts, timeouts=timeouts)
            result = json.loads((out / "result.json").read_text())
    except BaseException as e:
        result = finished_anyway(e, out, args.steps, launched_s, console)
        if result is None:
            return _ended_early(e, out, console, steps=args.steps)
    wall = time.perf_counter() - t0
    evaluate = getattr(module, "evaluate", None)
    evaluation = None
    if callable(evaluate):  # the model file's metrics of the trained model (builtin:dlrm: the validation RMSE)
        _load_trained(model, out, programs, pipeline)
        evaluation = _call_evaluate(evaluate, model, args, console)
    summary, loss_text = write_summary(out, result, wall, **{f"{unit}_per_s": result["items_per_s"]},
                                       step_time_s=result["step_time_s"],
                                       mean_step_time_s=result.get("mean_step_time_s"),
                                       mean_interval_s=result.get("mean_interval_s"),
                                       cpu_step_s=result.get("cpu_step_s"),
                                       ranks=result.get("world_size", nproc),
                                       threads_per_rank=threads, plan=plan.name,
                                       **({"evaluation": evaluation[0]} if evaluation else {}),
                                       **_mode_fields(args, evaluation))
    if cfg.trace:
        from .trace_outputs import write_run_trace

        write_run_trace(out, programs, cluster, args.optimizer, plan.name, console)
    losses = summary["losses"]
    restarts = len(summary["restarts"])
    console.print(
        f"trained {len(losses)} steps on {summary['ranks']} ranks in {wall:.0f} s: {loss_text}, "
        f"{result['items_per_s']:,.0f} {unit}/s"
        f"{f'; {restarts} restart(s)' if restarts else ''}; "
        f"checkpoints {out / 'checkpoints'}, weights {out / 'model.safetensors'}"
    )
    if evaluation:
        console.print(f"evaluation: {evaluation[1]}")
    bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    if bad is not None:
        why = ("before any update, so no learning rate caused it: check the batch (NaN or inf inputs) and the "
               "model's initial weights" if bad == 0 and not summary.get("resumes") else "training diverged: lower --lr")
        console.print(f"[red]warning: the loss became {losses[bad]} at step {bad + 1}; {why}[/]")
    sample = getattr(module, "sample", None)
    if args.sample_bytes > 0 and callable(sample):
        if evaluation is None:
            _load_trained(model, out, programs, pipeline)
        text = sample(model, args.sample_bytes, seed=args.seed, **({"prompt": "\n"} if args.data else {}))
        print_sample(console, text)
    return 0


def print_sample(console, text: str) -> None:
    """The model file's generated ``text`` between two rules, its control characters escaped
    (:func:`~adaptdist.console.printable_text`: a byte-level model's sample may hold ESC or BEL bytes)."""
    from ..console import printable_text

    console.rule("sample")
    print(printable_text(text))
    console.rule()


def train_async(args, spec, built, out: Path, cluster, choice, timeouts, console, begin) -> int:
    """``adaptdist train --mode async-hetero``: launch the ranks of ``choice.layout``, then write
    ``model.safetensors`` and ``summary.json`` (mode, each rank's role, the staleness bound, the validation RMSE
    of a model file with ``evaluate``, samples/s).

    Raises:
        UsageError: a model file without ``data()``, a batch the dense ranks cannot split.
        RuntimeLaunchError: a rank failed (CollectiveTimeoutError names a dead or stalled peer).
    """
    from safetensors.torch import save_file

    from ..runtime.async_hetero import HeteroConfig, assemble, dense_slices, run_rank
    from ..runtime.faults import Fault
    from ..runtime.batch_check import batch_shapes
    from ..runtime.launch import launch_local
    from ..runtime.worker import DataSpec
    from .common import check_first_batch
    from .modes import print_mode

    model, example, loss_fn = built
    layout = choice.layout
    module = spec.module()
    if not callable(getattr(module, "data", None)):
        raise UsageError(f"--mode async-hetero trains on the model file's data(batch_size, seq_len, path=...); "
                         f"{spec.file} defines none")
    dense_slices(args.batch_size, len(layout.dense_ranks))  # UsageError now, not on every rank
    data = DataSpec(str(spec.file), "data", args.batch_size, args.seq_len, path=args.data, seed=args.seed,
                    batch_shapes=batch_shapes(example))
    check_first_batch(data, example, model, loss_fn, spec.text)
    nproc = cluster.world_size
    threads = args.threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    # the model is rebuilt on each rank from its spec (a model file's classes do not pickle) and given these weights
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = HeteroConfig(model=None, loss_fn=None, spec=(spec.text, args.batch_size, args.seq_len, args.data),
                       initial_state=initial, data=data, layout=layout, steps=args.steps,
                       optimizer=args.optimizer, lr=args.lr, timeout_s=timeouts.collective_s,
                       threads_per_rank=threads, cpus_of_rank=_cpus_of_rank(cluster, None),
                       devices_of_rank=_devices_of_rank(cluster, None),
                       backend=_backend(cluster),
                       checkpoint_root=str(out / "checkpoints"), checkpoint_every=args.checkpoint_every,
                       keep=args.keep, model_name=spec.text, fault=Fault.from_env())
    print_mode(choice, console)
    begin()
    t0 = time.perf_counter()
    # a restart (--max-restarts) or --resume starts every rank from the newest good checkpoint, on this layout
    results = launch_local(run_rank, (cfg,), nproc, max_restarts=args.max_restarts, timeouts=timeouts)
    wall = time.perf_counter() - t0
    first_dense = results[layout.dense_ranks[0]]
    assemble(model, layout, {r: results[r]["state"] for r in layout.sparse_ranks}, first_dense["state"])
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              str(out / "model.safetensors"))
    evaluate = getattr(module, "evaluate", None)
    evaluation = _call_evaluate(evaluate, model, args, console) if callable(evaluate) else None
    phases = {str(r): {k: v for k, v in results[r].items() if k.endswith("_s") and isinstance(v, float)}
              for r in range(nproc)}
    result = {"losses": first_dense["losses"], "events": []}
    fields = {"samples_per_s": first_dense["items_per_s"], "step_time_s": first_dense["step_time_s"],
              "mean_step_time_s": first_dense["mean_step_time_s"], "mean_interval_s": first_dense["mean_step_time_s"],
              "ranks": nproc, "threads_per_rank": threads, "plan": "async-hetero", **choice.describe(),
              "rank_seconds": phases, "start_step": first_dense.get("start_step", 0),
              "checkpoints": first_dense.get("checkpoints", [])}
    if evaluation:
        fields["evaluation"] = evaluation[0]
        if "validation_rmse" in evaluation[0]:
            fields["validation_rmse"] = evaluation[0]["validation_rmse"]
    summary, loss_text = write_summary(out, result, wall, **fields)
    start = first_dense.get("start_step", 0)
    console.print(f"trained {summary['steps']} steps in --mode async-hetero on {nproc} ranks (sparse "
                  f"{','.join(map(str, layout.sparse_ranks))}, dense {','.join(map(str, layout.dense_ranks))}, max "
                  f"staleness {layout.max_staleness}) in {wall:.0f} s: {loss_text}, {first_dense['items_per_s']:,.0f} "
                  f"samples/s{f' (resumed at step {start})' if start else ''}; checkpoints {out / 'checkpoints'}, "
                  f"weights {out / 'model.safetensors'}")
    if evaluation:
        console.print(f"evaluation: {evaluation[1]}")
    return 0


def _mode_fields(args, evaluation) -> dict:
    """summary.json's ``mode`` fields of a synchronous run of a recommender (``--mode``: issue 17): the mode, why,
    each rank's role (all ``sync``) and the validation RMSE; nothing for other models."""
    choice = getattr(args, "_mode_choice", None)
    if choice is None:
        return {}
    fields = {**choice.describe(), "roles": {str(r): "sync" for r in range(len(choice.cost.rank_s))},
              "max_staleness": None}
    if evaluation and "validation_rmse" in evaluation[0]:
        fields["validation_rmse"] = evaluation[0]["validation_rmse"]
    return fields


def _load_trained(model, out: Path, programs: dict, pipeline: bool) -> None:
    """Load the run's ``OUT/model.safetensors`` into ``model`` (the launcher's copy; tied weights are saved once)."""
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert pipeline or all(k in programs[0].tied for k in missing), missing


def _call_evaluate(evaluate, model, args, console) -> tuple[dict, str] | None:
    """The model file's ``evaluate(model, path=--data, batch_size=, steps=)`` (the keywords it takes) ->
    ``(fields for summary.json, one line for the log)``; None, with a warning, when it fails or returns something
    else (the run itself has finished: its weights and checkpoint are written, so it is not failed for that)."""
    import inspect

    params = inspect.signature(evaluate).parameters
    given = {"path": args.data, "batch_size": args.batch_size, "steps": args.steps}
    try:
        out = evaluate(model, **{k: v for k, v in given.items() if k in params})
    except Exception as e:  # noqa: BLE001 - a user's evaluate(); the trained run stands
        console.print(f"[yellow]warning: {args.model}: evaluate(model, ...) of the model file raised "
                      f"{type(e).__name__}: {e}; summary.json has no evaluation[/]")
        return None
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], dict) and isinstance(out[1], str)):
        console.print(f"[yellow]warning: {args.model}: evaluate(model, ...) must return (fields: dict, line: str), "
                      f"got {type(out).__name__}; summary.json has no evaluation[/]")
        return None
    try:
        json.dumps(out[0])
    except (TypeError, ValueError) as e:
        console.print(f"[yellow]warning: {args.model}: evaluate's fields cannot be written as JSON ({e}); "
                      "summary.json has no evaluation[/]")
        return None
    return out


def check_local_devices(cluster) -> None:
    """Before compiling: every cuda rank of ``cluster`` (whose ranks this machine launches) has its device here.

    Raises:
        DeviceUnavailableError: names the rank, host and device (:func:`~adaptdist.runtime.devices.check_device`).
    """
    if cluster.device_kinds == ("cpu",):
        return
    import torch

    from ..runtime.devices import check_device, rank_devices

    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    for device in rank_devices(cluster):
        check_device(device, available, count)


def on_capture_device(model, example: tuple, cluster) -> tuple:
    """``(model, example)`` as the compiler captures them for ``cluster``: themselves for cpu ranks; for a job
    with cuda ranks, copies on ``cuda`` (the current device: cuda:0 of this host), so that the graph holds
    cuda kernels (``aten._scaled_dot_product_flash_attention_for_cpu`` has no cuda kernel) and the rank programs
    name cuda devices (each rank retargets them to its own: :func:`~adaptdist.runtime.devices.program_on_device`)."""
    if "cuda" not in cluster.device_kinds:
        return model, example
    import copy

    return copy.deepcopy(model).to("cuda"), tuple(t.to("cuda") for t in example)


def _backend(cluster) -> str:
    """The ranks' ``init_process_group`` backend (:func:`~adaptdist.runtime.devices.process_group_backend`)."""
    from ..runtime.devices import process_group_backend

    return process_group_backend(cluster.device_kinds)


def _devices_of_rank(cluster, plan) -> tuple:
    """Each rank's :class:`~adaptdist.runtime.devices.RankDevice` (the device the plan's rank mapping puts it on);
    empty for an all-cpu cluster (every rank on cpu, as before)."""
    from ..runtime.devices import rank_devices

    if cluster.device_kinds == ("cpu",):
        return ()
    devices = plan.devices if plan is not None else None
    return rank_devices(cluster, devices.rank_to_device if devices is not None else None)


REBALANCE_AFTER_AUTO = 10
"""``--rebalance-after auto``: the steps measured before the re-balance (the first one not measured)."""


def _rebalance_after(args, programs: dict, cluster, pipeline: bool, console) -> int | None:
    """The steps after which the ranks re-balance the batch rows (:mod:`adaptdist.runtime.rebalance`), or None.
    ``--rebalance-after auto``: :data:`REBALANCE_AFTER_AUTO` when the plan splits the batch unevenly for unequal
    devices (the profile's speeds then decide the rows; the run measures them); ``off``; ``N`` (at least 2):
    after N steps whenever the plan splits a batch axis.

    Raises:
        UsageError: a value other than auto, off or an integer >= 2.
    """
    text = str(getattr(args, "rebalance_after", "auto") or "auto")
    if text == "off":
        return None
    if text != "auto":
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 2:
            raise UsageError(f"--rebalance-after {text}: give auto, off, or a number of steps >= 2 (the first step "
                             "is not measured)")
    plan = programs[0].plan
    splits = plan is not None and plan.batch_axis is not None and plan.mesh_spec.size(plan.batch_axis) > 1
    unsupported = ("a pipeline plan" if pipeline else "cuda ranks" if cluster.device_kinds != ("cpu",)
                   else "the plan splits no batch axis" if not splits else None)
    if text == "auto":
        uneven = plan is not None and plan.devices is not None and plan.devices.batch_rows is not None
        return REBALANCE_AFTER_AUTO if uneven and unsupported is None else None
    if unsupported is not None:
        console.print(f"[yellow]--rebalance-after {text}: no re-balance ({unsupported})[/]")
        return None
    return n


def _cpus_of_rank(cluster, plan) -> tuple:
    """Each rank's ``cpus`` from the cluster file (the device the plan's rank mapping puts it on)."""
    from ..runtime.affinity import cpus_of_ranks

    devices = plan.devices if plan is not None else None
    return cpus_of_ranks(cluster, devices.rank_to_device if devices is not None else None)


def _check_checkpoint_fits(out: Path, model: str, program, console, programs: dict | None = None) -> None:
    """Before launching: the checkpoint a resumed run will load must be of this model (else the ranks would each
    refuse it, and restarting could not help). Pipeline ``programs``: the state of all of them.

    Raises:
        CheckpointError: names both models and the first state that differs.
    """
    from ..runtime.checkpoint_store import check_same_model, latest_good
    from ..runtime.train_state import state_shapes

    info = latest_good(out / "checkpoints", lambda m: console.print(f"[yellow]{m}[/]"))
    if info is not None:
        if programs is not None:
            from .pipeline_flags import state_shapes_of

            check_same_model(info.meta, info.path, model, state_shapes_of(programs))
        else:
            check_same_model(info.meta, info.path, model, state_shapes(program))


def _cluster_doc(cluster) -> dict:
    from ..cluster_file import cluster_to_dict

    return cluster_to_dict(cluster)


ELASTIC_FILE = "elastic.json"
"""Written by the launcher of an elastic job: the agent command, so ``adaptdist train --join OUT`` adds a rank."""


class _Terminated(Exception):
    """SIGTERM reached the launcher of an elastic job."""


def _launch_elastic(cfg, out: Path, elastic: tuple[int, int], max_restarts: int, timeouts) -> dict:
    """Run ``cfg`` on one elastic agent per rank (``--nproc MIN:MAX``), started at MAX ranks; Ctrl-C and SIGTERM
    are passed on to every agent (each its own session, so only this process got them).

    Raises:
        RunInterruptedError: stopped by SIGINT/SIGTERM (the ranks wrote a checkpoint).
        RuntimeLaunchError: the job failed past its restarts; names the rank and why.
    """
    import signal

    from ..errors import RunInterruptedError
    from ..runtime.launch import launch_elastic_local
    from ..runtime.rank_status import last_failure

    cfg_file = out / "train_config.pkl"
    cfg_file.write_bytes(pickle.dumps(cfg))  # our own file, read by our own ranks
    job = launch_elastic_local("adaptdist.cli.elastic_worker", [str(cfg_file)], elastic[0], elastic[1],
                               max_restarts=max_restarts, timeouts=timeouts)

    def on_term(signum, frame):
        raise _Terminated()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        (out / ELASTIC_FILE).write_text(json.dumps({"command": job.command, "launcher_pid": os.getpid(),
                                                    "min": elastic[0], "max": elastic[1]}))
        try:
            code = job.wait(float("inf"))
        except KeyboardInterrupt:
            job.stop(signal.SIGINT)
            raise RunInterruptedError("Ctrl-C: passed on to every rank", int(signal.SIGINT)) from None
        except _Terminated:
            job.stop(signal.SIGTERM)
            raise RunInterruptedError("SIGTERM: passed on to every rank", int(signal.SIGTERM)) from None
    finally:
        signal.signal(signal.SIGTERM, old)
        job.close()
        (out / ELASTIC_FILE).unlink(missing_ok=True)
    result = out / "result.json"
    if code != 0 or not result.is_file():
        raise RuntimeLaunchError(f"the elastic job ended with exit code {code}: "
                                 f"{last_failure(out) or 'no rank left a record of why'}")
    return json.loads(result.read_text())


def cmd_join(out: Path, console) -> int:
    """``adaptdist train --join OUT``: start one more rank (its own torchrun agent) for the elastic job running
    in OUT; it joins at the next rendezvous round and the job re-plans for the larger world size.

    Raises:
        UsageError: no elastic job is running in OUT.
    """
    import subprocess

    f = out / ELASTIC_FILE
    if not f.is_file():
        raise UsageError(f"--join {str(out)!r}: no elastic job runs there (no {ELASTIC_FILE}); start one with "
                         "adaptdist train --nproc MIN:MAX --out DIR")
    job = json.loads(f.read_text())
    console.print(f"joining the elastic job in {out} (launcher pid {job['launcher_pid']}, {job['min']} to "
                  f"{job['max']} ranks)")
    from ..runtime.launch import LOCAL_RUN_ENV

    # the job's agents run with LOCAL_RUN_ENV (workers' store made by rank 0 on loopback): without it this
    # agent's worker would look for torch's agent store and never meet the others in init_process_group
    env = {**LOCAL_RUN_ENV, **os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(job["command"], env=env)


def finished_anyway(e: BaseException, out: Path, steps: int, launched_s: float, console) -> dict | None:
    """Rank 0's result when the run finished although the launcher was interrupted (``e``: SIGINT/SIGTERM after
    the last step, while the ranks wrote their last files: they finish then), else None: ``OUT/result.json``
    written since ``launched_s`` (``time.time()``) with all ``steps`` losses."""
    from ..runtime.stop import interrupted_exit_code

    f = out / "result.json"
    if interrupted_exit_code(e) is None or not f.is_file() or f.stat().st_mtime < launched_s:
        return None
    try:
        result = json.loads(f.read_text())
    except ValueError:
        return None
    if len(result.get("losses", [])) != steps:
        return None
    import signal

    name = signal.Signals(interrupted_exit_code(e) - 128).name
    console.print(f"[yellow]interrupted ({name}) after the last step: the run had trained all {steps} steps and "
                  "written its weights and checkpoint; finishing it[/]")
    return result


def _ended_early(e: BaseException, out: Path, console, resume: str | None = None, steps: int | None = None) -> int:
    """A run that did not finish: say what happened, where its newest checkpoint is and the exact command to
    resume (with ``steps``, the run's ``--steps``: a checkpoint at that step already says so and how to train on
    instead); record the state in run.json. Returns the exit code (130/143 for SIGINT/SIGTERM), or re-raises."""
    from ..runtime.checkpoint_store import latest_good

    from ..runtime.stop import interrupted_exit_code

    code = interrupted_exit_code(e)
    info = latest_good(out / "checkpoints")
    where = f"checkpoint at {info.path}" if info else "no checkpoint yet"
    resume = resume or f"adaptdist train --resume {out}"
    if code is not None:
        import signal

        _set_state(out, "interrupted")
        step = info.step if info else 0
        if steps is not None and step >= steps:  # all trained, the last files not all written: nothing to resume
            print(f"adaptdist: interrupted ({signal.Signals(code - 128).name}) after the last step ({step}), {where} "
                  f"(the weights may be missing); to train on from it: {resume} --steps N (N > {step})",
                  file=sys.stderr)
            return code
        print(f"adaptdist: interrupted ({signal.Signals(code - 128).name}) at step {step}, {where}; resume with: "
              f"{resume}", file=sys.stderr)
        return code
    _set_state(out, "failed")
    if isinstance(e, RuntimeLaunchError):
        raise RuntimeLaunchError(f"{e}; {where}" + (f"; resume with: {resume}" if info else "")) from None
    raise e
