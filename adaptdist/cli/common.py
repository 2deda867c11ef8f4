"""What several commands share: turning ``--plan`` into a plan object, ``--nproc``/``--cluster`` into a cluster,
the lowering flags into LoweringOptions, the check of data batches against the example batch."""

from __future__ import annotations

from pathlib import Path


def planned_sync(args, model, example):
    """``args._sync_plan`` when :func:`adaptdist.cli.modes.resolve_mode` planned the synchronous programs of this very
    ``model`` and ``example`` (the same objects), else None."""
    sp = getattr(args, "_sync_plan", None)
    return sp if sp is not None and sp.model is model and sp.example is example else None


def resolve_plan(args, spec, model, example, loss_fn, cluster, console, optimizer: str, layers: bool = True):
    """``--plan`` as a plan object, and the captured step when the planner captured it (else None):
    ``auto`` runs the planner for ``cluster`` (printing its summary), anything else is a manual plan."""
    from ..annotations import ManualPlan

    from ..compiler.planner.summary import print_summary

    sp = planned_sync(args, model, example)  # the plan the mode choice priced (--mode auto|sync of a recommender)
    if sp is not None:
        if sp.result is not None:
            print_summary(console, sp.result, layers=layers)
        return sp.plan, sp.captured
    if args.plan != "auto":
        return ManualPlan.parse(args.plan, spec.module(), model), None
    from ..compiler.capture import capture
    from ..compiler.planner.summary import run_planner

    captured = capture(model, example, loss_fn)
    result = run_planner(captured, cluster, args.mesh, optimizer, console,
                         replicate_fallback=bool(getattr(args, "replicate_fallback", False)),
                         pipeline=True if getattr(args, "consider_pp", False) else None)
    print_summary(console, result, layers=layers)
    return result.plan, captured



# the shared argparse types (numbers refused at parse time when not finite, out of range or absurd)
from ..arg_types import MAX_SEED, bounded, local_ranks, nonnegative_int, positive, seed, threads  # noqa: E402,F401


def prepare_out_dir(path: str, flag: str = "--out"):
    """Create the output directory ``path`` (and its parents) before any work; returns it as a Path.

    Raises:
        UsageError: ``path`` exists and is not a directory, or cannot be created (permissions, a read-only or
            virtual file system such as /proc); the message names ``flag``.
    """
    from pathlib import Path

    from ..errors import UsageError

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag} {str(out)!r} exists and is not a directory; pass a directory path")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create the output directory {flag} {str(out)!r}: {e.strerror or e}; pass a "
                         "writable directory path") from None
    _probe_write(out, flag, f"the output directory {flag} {str(out)!r}")
    return out


def _probe_write(directory, flag: str, what: str) -> None:
    """Create and remove a file in ``directory``: the one sure test that the run's files can be written there
    (permission bits say nothing to root, nor about a read-only mount or a full disk)."""
    import tempfile

    from ..errors import UsageError

    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".adaptdist-write-test-"):
            pass
    except OSError as e:
        raise UsageError(f"cannot write into {what}: {e.strerror or e}; pass a writable path") from None


def check_out_file(path: str | None, flag: str = "--out") -> None:
    """Before any work: ``path`` (a file a command writes at its end, e.g. ``plan --out plan.json``) must not be a
    directory and its directory must exist and take a new file.

    Raises:
        UsageError: names ``flag`` and the path.
    """
    from ..errors import UsageError

    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {str(p)!r} is a directory; pass a file path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{flag} {str(p)!r}: the directory {str(parent)!r} does not exist; create it or pass "
                         "another path")
    _probe_write(parent, flag, f"the directory of {flag} {str(p)!r}")


def check_comm(args) -> None:
    """Refuse ``--comm shm`` without adaptdist's shared-memory kernels before any capture or planning (the lowering
    would otherwise refuse it only after planning the whole model).

    Raises:
        ShmUnavailableError: ``--comm shm`` and the kernels are unavailable (names why and what to try).
    """
    if getattr(args, "comm", None) == "shm":
        from ..kernels import require

        require("--comm shm")


def lowering_options(args, cluster=None):
    """The :class:`~adaptdist.lowering_options.LoweringOptions` of a command's flags (``--bucket-mb``,
    ``--replicate-fallback``, ``--dump-graphs``, ``--comm``, ...); ``cluster`` (the ranks the programs will run on)
    gives each rank's host, which decides the mesh axes ``--comm auto|shm`` puts on shared memory.

    Raises:
        UsageError: a bucket size that is not > 0; ``--comm shm`` for a cluster with cuda ranks.
    """
    from ..comm_transport import rank_hosts
    from ..errors import UsageError
    from ..lowering_options import LoweringOptions

    comm = getattr(args, "comm", None) or "auto"
    if comm == "shm" and cluster is not None and "cuda" in getattr(cluster, "device_kinds", ()):
        raise UsageError(f"--comm shm: adaptdist's shared-memory collectives move CPU tensors, and {cluster!r} has cuda "
                         "ranks (their collectives take nccl); use --comm auto")
    return LoweringOptions.from_mb(comm=comm, hosts=rank_hosts(cluster),
                                   bucket_mb=getattr(args, "bucket_mb", None),
                                   replicate_fallback=bool(getattr(args, "replicate_fallback", False)),
                                   dump_dir=getattr(args, "dump_graphs", None),
                                   debug=bool(getattr(args, "debug_passes", False)),
                                   disabled_passes=tuple(getattr(args, "disable_pass", None) or ()), front_end="cli",
                                   rng=getattr(args, "rng", None) or "per-rank",
                                   batch_norm=getattr(args, "batch_norm", None) or "local")


def _cluster(args):
    """The cluster a command runs or plans for (``--cluster``, ``--nproc``, a saved plan's mesh), its one-host
    collectives costed as ``--comm`` carries them (:func:`~adaptdist.comm_transport.cluster_for_comm`)."""
    from ..comm_transport import cluster_for_comm

    return cluster_for_comm(_cluster_of_flags(args), getattr(args, "comm", None) or "gloo")


def _cluster_of_flags(args):
    from ..calibrate.local import load_cluster, local_cluster

    if args.cluster:
        return load_cluster(args.cluster)
    if args.nproc is None and getattr(args, "mesh", None):
        from ..mesh import Mesh

        return local_cluster(Mesh.parse(args.mesh).world_size)
    plan_file = Path(getattr(args, "plan", "") or "")
    if args.nproc is None and plan_file.suffix == ".json" and plan_file.is_file():
        from ..plan import Plan

        return local_cluster(Plan.load(plan_file).world_size)  # a saved plan brings its mesh
    return local_cluster(2 if args.nproc is None else args.nproc)


def check_first_batch(data, example, model, loss_fn, factory: str) -> None:
    """:func:`check_batch` on the first batch of ``data`` (a :class:`~adaptdist.runtime.worker.DataSpec` with a
    ``data()`` function), drawn unchecked so that a mismatch can name the batch the model does not take."""
    import dataclasses

    from ..runtime.worker import global_batches

    check_batch(next(global_batches(dataclasses.replace(data, batch_shapes=None))), example, data, model, loss_fn,
                factory)


def check_batch(batch, example, data, model=None, loss_fn=None, factory: str = "the factory") -> None:
    """The data's first batch must look like the factory's example batch (count, shapes, dtypes); the ranks check
    every later one alike (:mod:`adaptdist.runtime.batch_check`, one message for both). Given ``model`` and
    ``loss_fn``, a mismatch names the batch the model does not take (:func:`adaptdist.cli.batch_fit.blame`).

    Raises:
        DataError: names the step, the element and what differs.
        UsageError: the model does not take the example batch of ``factory`` (``FILE.py:FACTORY``): names it,
            both batches' shapes and the model's error.
    """
    from ..errors import DataError
    from ..runtime.batch_check import batch_shapes, check_batch as check

    src = f"{data.module_file}:{data.function}" if data.function else "the example batch"
    try:
        check(batch, batch_shapes(example), src, step=1, compiled=f"the example batch of {factory}",
              sizes=f"--batch-size {data.batch_size} --seq-len {data.seq_len}")
    except DataError as e:
        if model is None or loss_fn is None or not isinstance(batch, (tuple, list)):
            raise
        from .batch_fit import blame

        raise blame(e, batch, example, model, loss_fn, factory, f"{src}()") from None
