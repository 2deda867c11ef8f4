"""``--mode sync|async-hetero|auto``, ``--max-staleness K``, ``--dense-ranks LIST`` (issue 17): the execution mode
of ``adaptdist train`` and ``adaptdist plan``, and the training loop of ``--mode async-hetero``
(:mod:`adaptdist.runtime.async_hetero` on local gloo ranks)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..errors import UsageError


def add_mode_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("auto", "sync", "async-hetero"), default="auto",
                   help="sync: the compiled synchronous programs (data parallel, tables sharded where they do not fit); "
                        "async-hetero: a recommender's embedding lookups and sparse updates on 'sparse' ranks, its dense "
                        "part on 'dense' ranks, joined by bounded queues (--max-staleness); auto: the planner's choice "
                        "from the cost model and the cluster (async-hetero only for models with .sparse_arch and "
                        ".dense_arch, e.g. builtin:dlrm, with --plan auto)")
    p.add_argument("--max-staleness", type=_staleness, default=1, metavar="K",
                   help="async-hetero: the sparse side runs at most K batches ahead of the gradients it has applied "
                        "(the lookups of step t see the table updates of steps up to t-K-1; 0: the synchronous step)")
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


def resolve_mode(args, model, example, cluster, console, *, elastic=None, resuming: bool = False):
    """The :class:`~adaptdist.compiler.planner.modes.ModeChoice` of the flags, or None when the model has no
    embedding and dense parts and the mode was not forced (other models: the compiled programs, as ever).

    ``--mode auto`` keeps ``sync`` where a flag asks for a synchronous plan (``--plan`` other than auto,
    ``--mesh``, a pipeline), a resumed or elastic run, or mixed precision.

    Raises:
        UsageError: ``async-hetero`` with a model, a flag or a cluster it cannot run with.
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
                                   ("--nproc MIN:MAX", elastic is not None), ("--resume", resuming),
                                   ("--precision bf16", getattr(args, "precision", "fp32") != "fp32"),
                                   ("--activation-checkpointing", bool(getattr(args, "activation_checkpointing", False))),
                                   ("--trace", bool(getattr(args, "trace", False))),
                                   ("--max-grad-norm", getattr(args, "max_grad_norm", None) is not None))
                  if on]
    if mode == "async-hetero" and sync_flags:
        raise UsageError(f"--mode async-hetero does not take {', '.join(sync_flags)} (they belong to the synchronous "
                         "programs); drop them, or use --mode sync")
    if mode == "async-hetero" and cluster.device_kind != "cpu":
        raise UsageError(f"{cluster!r}: --mode async-hetero runs cpu (gloo) ranks only so far")
    optimizer = str(getattr(args, "optimizer", "adamw")).replace("-", "_")
    if mode == "auto" and sync_flags:
        mode = "sync"
    if dense is not None and mode == "sync":
        raise UsageError("--dense-ranks names the dense ranks of --mode async-hetero; drop it for --mode sync")
    shape = recsys_shape(model, example, optimizer if optimizer in ("sgd", "adamw") else "adamw") if splittable \
        else None
    if shape is None:  # async-hetero forced on a model without the parts: choose_mode says why
        from ..cost_models.recsys import RecsysShape

        shape = RecsysShape((1,), 1, (1,), 0.0, 0.0, 0, 0, 1)
    choice = choose_mode(shape, cluster, mode, args.max_staleness, dense, splittable=splittable)
    if sync_flags and getattr(args, "mode", "auto") == "auto":
        choice = type(choice)(choice.mode, choice.layout, choice.cost, choice.candidates,
                              f"auto: {', '.join(sync_flags)} asks for the synchronous programs")
    return choice


def print_mode(choice, console) -> None:
    from ..compiler.planner.modes import mode_lines

    for line in mode_lines(choice):
        console.print(line, highlight=False, markup=False)


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
    from ..runtime.batch_check import batch_shapes
    from ..runtime.launch import launch_local
    from ..runtime.worker import DataSpec
    from .common import check_batch
    from .train import _call_evaluate, _cpus_of_rank, write_summary

    model, example, loss_fn = built
    layout = choice.layout
    module = spec.module()
    if not callable(getattr(module, "data", None)):
        raise UsageError(f"--mode async-hetero trains on the model file's data(batch_size, seq_len, path=...); "
                         f"{spec.file} defines none")
    dense_slices(args.batch_size, len(layout.dense_ranks))  # UsageError now, not on every rank
    data = DataSpec(str(spec.file), "data", args.batch_size, args.seq_len, path=args.data, seed=args.seed,
                    batch_shapes=batch_shapes(example))
    from ..runtime.worker import global_batches

    check_batch(next(global_batches(data)), example, data)
    nproc = cluster.world_size
    threads = args.threads_per_rank or 1
    # the model is rebuilt on each rank from its spec (a model file's classes do not pickle) and given these weights
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = HeteroConfig(model=None, loss_fn=None, spec=(spec.text, args.batch_size, args.seq_len, args.data),
                       initial_state=initial, data=data, layout=layout, steps=args.steps,
                       optimizer=args.optimizer, lr=args.lr, timeout_s=timeouts.collective_s,
                       threads_per_rank=threads, cpus_of_rank=_cpus_of_rank(cluster, None))
    print_mode(choice, console)
    if args.max_restarts:
        console.print("[yellow]--mode async-hetero writes no checkpoints yet: --max-restarts is ignored (a failed "
                      "rank ends the run)[/]")
    begin()
    t0 = time.perf_counter()
    results = launch_local(run_rank, (cfg,), nproc, max_restarts=0, timeouts=timeouts)
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
              "ranks": nproc, "threads_per_rank": threads, "plan": "async-hetero", **choice.describe(),
              "rank_seconds": phases}
    if evaluation:
        fields["evaluation"] = evaluation[0]
        if "validation_rmse" in evaluation[0]:
            fields["validation_rmse"] = evaluation[0]["validation_rmse"]
    summary, loss_text = write_summary(out, result, wall, **fields)
    console.print(f"trained {summary['steps']} steps in --mode async-hetero on {nproc} ranks (sparse "
                  f"{','.join(map(str, layout.sparse_ranks))}, dense {','.join(map(str, layout.dense_ranks))}, max "
                  f"staleness {layout.max_staleness}) in {wall:.0f} s: {loss_text}, {first_dense['items_per_s']:,.0f} "
                  f"samples/s; weights {out / 'model.safetensors'}")
    if evaluation:
        console.print(f"evaluation: {evaluation[1]}")
    return 0


def write_mode_json(path: str, choice) -> None:
    Path(path).write_text(json.dumps(choice.describe(), indent=1))
