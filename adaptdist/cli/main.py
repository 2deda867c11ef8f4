"""The ``adaptdist`` command.

One grammar for every subcommand: the model is ``FILE.py:FACTORY`` (default
``builtin:gpt``), the machines ``--cluster FILE`` or ``--nproc N``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from ..errors import AdaptdistError, UsageError
from ..limits import MAX_BATCH_DIM, check_batch_items
from .common import _cluster, check_comm, lowering_options
from .common import local_ranks, nonnegative_int, positive as _positive, prepare_out_dir, resolve_plan, seed as _seed
from .common import bounded, check_out_file, threads as _threads


def _add_common(p: argparse.ArgumentParser, nproc_type=local_ranks, nproc_help: str = "") -> None:
    p.add_argument("model", nargs="?", default="builtin:gpt",
                   help="FILE.py:FACTORY, factory(batch_size, seq_len) -> (model, batch, loss_fn)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--cluster", metavar="FILE", help="cluster YAML or JSON file (see README: Cluster)")
    g.add_argument("--nproc", type=nproc_type, default=None,
                   help="number of local ranks; 2 when neither --nproc nor --cluster is given" + nproc_help)
    p.add_argument("--mesh", metavar="AXIS=N,...", default=None,
                   help="mesh axis sizes for a multi-axis plan, outermost first, e.g. dp=2,tp=2 (their product is "
                        "the number of ranks; sets --nproc when that is not given)")
    p.add_argument("--batch-size", type=_positive(int, MAX_BATCH_DIM, "adaptdist/limits.py"), default=16,
                   help="global batch size")
    p.add_argument("--seq-len", type=_positive(int, MAX_BATCH_DIM, "adaptdist/limits.py"), default=128,
                   help="sequence length")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logs (pass timings)")
    p.add_argument("--consider-pp", action="store_true",
                   help="--plan auto also weighs pipeline stages (the inter-stage planner) and takes a pipeline plan "
                        "where it is predicted faster; off by default: it can double the planning time on 4+ ranks")


def _add_comm(p: argparse.ArgumentParser) -> None:
    """``--comm auto|shm|gloo``: :attr:`~adaptdist.lowering_options.LoweringOptions.comm`."""
    p.add_argument("--comm", choices=("auto", "shm", "gloo"), default="auto",
                   help="how collectives travel: shm = adaptdist's shared-memory kernels on every mesh axis whose ranks "
                        "share a host (an error without the kernels), gloo = gloo everywhere, auto (default) = shm "
                        "where the kernels are loaded and an axis's ranks share a host")


def _add_lowering(p: argparse.ArgumentParser, fallback: bool = True) -> None:
    """The flags that set :class:`~adaptdist.lowering_options.LoweringOptions` (train, plan, compile; estimate has
    its own ``--bucket-mb`` in :mod:`adaptdist.cli.estimate`)."""
    from ..lowering_options import LoweringOptions

    p.add_argument("--bucket-mb", type=_positive(float), default=None,
                   help="gradient all_reduce / reduce_scatter bucket size, MiB (small buckets overlap with backward; "
                        f"default {LoweringOptions().bucket_mb:g})")
    if fallback:
        p.add_argument("--replicate-fallback", action="store_true",
                       help="ops with no sharding rule gather their inputs and run whole on every rank (one warning "
                            "lists them) instead of stopping with UnsupportedOpError; --plan auto plans them so too")
    _add_comm(p)
    p.add_argument("--rng", choices=("per-rank", "global"), default="per-rank",
                   help="random ops (dropout, rand_like, ...): per-rank draws each rank's own numbers from a seed of "
                        "its own (DDP's); global draws what one process draws on the whole batch (the same numbers on "
                        "any number of ranks; each rank draws the whole tensor: world size times the random numbers)")
    p.add_argument("--batch-norm", choices=("local", "sync"), default="local",
                   help="training-mode BatchNorm over the split batch: 'local' (DDP's semantics: each rank's statistics "
                        "from its own rows, rank 0's running buffers kept) or 'sync' (SyncBatchNorm's: statistics over "
                        "the global batch, one all_reduce per BatchNorm in forward and in backward); default local")
    p.add_argument("--batch-split", metavar="auto|even|ROWS", default="auto",
                   help="rows of the global batch per data-parallel rank: auto (in proportion to each device's "
                        "measured speed, within its memory; torch.chunk's even split on alike devices), even "
                        "(torch.chunk), or row counts per batch-axis coordinate, e.g. 4,2,2")
    p.add_argument("--debug-passes", action="store_true",
                   help="check the graph invariants of adaptdist/passes/README.md after every lowering pass")
    p.add_argument("--disable-pass", metavar="NAME", action="append", default=[], type=_skippable_pass,
                   help="skip this lowering pass (repeatable; for debugging speed or memory: only the passes that do not change the numbers, adaptdist/passes/pipeline.py SKIPPABLE)")


def _skippable_pass(text: str) -> str:
    """An argparse ``type=`` for ``--disable-pass``: a pass name of :data:`adaptdist.passes.pipeline.SKIPPABLE`,
    refused at parse time (before any capture, planning or change to --out)."""
    from ..passes.infra import pass_names
    from ..passes.pipeline import PASSES, SKIPPABLE

    if text not in SKIPPABLE:
        what = "sharding rules rely on it for the single-process numbers" if text in pass_names(PASSES) else \
            "not a lowering pass"
        raise argparse.ArgumentTypeError(f"cannot skip {text!r} ({what}); the passes that may be skipped (for "
                                         f"debugging speed or memory): {', '.join(sorted(SKIPPABLE))}")
    return text


def _add_fault_tolerance(p: argparse.ArgumentParser) -> None:
    """``train``'s checkpoint, restart and timeout flags (issue: fault-tolerant and elastic training)."""
    from ..runtime.timeouts import Timeouts

    p.add_argument("--checkpoint-every", type=_positive(int), default=100, metavar="N",
                   help="write a checkpoint every N steps (and at the end, and on SIGTERM/SIGINT)")
    p.add_argument("--keep", type=_positive(int), default=3, metavar="K", help="keep the newest K checkpoints")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="write periodic checkpoints with DCP's asynchronous save (in a thread while training goes on; "
                        "helps where cores are spare or storage is slow: benchmarks/bench_checkpoint.py)")
    p.add_argument("--max-restarts", type=nonnegative_int, default=0, metavar="R",
                   help="restart every rank from the newest good checkpoint up to R times when one dies or stalls "
                        "(torch's elastic agent)")
    p.add_argument("--collective-timeout-s", "--timeout-s", dest="collective_timeout_s", type=_positive(float),
                   default=Timeouts().collective_s,
                   help="a collective that waits longer than this fails, naming the rank that did not arrive "
                        "(the rendezvous and restart timeouts are derived from it: README, Fault tolerance)")
    p.add_argument("--resume", metavar="DIR", default=None,
                   help="continue the run in DIR (its --out) from its newest good checkpoint, with its settings; "
                        "only --steps, --nproc/--cluster and --out may change (another world size is re-planned)")
    p.add_argument("--join", metavar="DIR", default=None,
                   help="add one rank to the elastic job (--nproc MIN:MAX) running in DIR; the job re-plans for "
                        "the larger world size at the next rendezvous round")


def _add_training_features(p: argparse.ArgumentParser) -> None:
    """``--precision`` and ``--activation-checkpointing`` (:mod:`adaptdist.compiler.training_features`)."""
    from ..lowering_options import PRECISIONS  # not training_features: --help imports no torch

    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="bf16: forward and loss under torch.autocast('cpu', torch.bfloat16) (mixed precision: "
                        "parameters, gradients and optimizer state stay float32)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block (the model's nn.ModuleList children, e.g. the built-in GPT's blocks) in "
                        "the backward instead of keeping its activations; the memory estimate counts it")


def build_parser() -> argparse.ArgumentParser:
    """The ``adaptdist`` argument parser: subcommands ``train`` and ``plan`` with one shared grammar."""
    ap = argparse.ArgumentParser(prog="adaptdist", description="Automatic distributed training for PyTorch.")
    fmt = argparse.ArgumentDefaultsHelpFormatter
    sub = ap.add_subparsers(dest="command")
    t = sub.add_parser("train", help="compile the model and train it on local ranks", formatter_class=fmt)
    from .train import nproc_range

    _add_common(t, nproc_range, "; MIN:MAX: an elastic world size, one torchrun agent per rank (started at MAX), "
                                "re-planned and resharded when ranks leave or join")
    t.add_argument("--data", metavar="FILE|DIR",
                   help="the data the model file's data() reads: builtin:gpt/llama a UTF-8 text file (default: an "
                        "embedded corpus); builtin:dlrm a MovieLens folder (default: ../shared/data/movielens-small "
                        "where present, else a generated data set of its shape)")
    t.add_argument("--plan", default="auto", metavar="auto|dp|fsdp|tp|dp,tp|ep|pp|FILE",
                   help="pp: a pipeline, one stage per rank (--mesh pp=2,dp=2: stages on sub-meshes; --microbatches, "
                        "--schedule); auto: the planner chooses the mesh and every node's placement (an ILP on the cost "
                        "model; --mesh fixes the mesh); "
                        "dp: batch split, parameters replicated; fsdp: batch split, every parameter sharded on "
                        "dim 0; tp: the model file's TP_PLAN globs (Megatron column/row parallel), else a Hugging "
                        "Face model's own tensor-parallel plan; dp,tp: both on "
                        "a 2-D mesh (--mesh dp=2,tp=2); ep: expert parallelism, the batch split and the model "
                        "file's EP_PLAN globs (stacked [E, ...] expert weights sharded on the expert dim; tokens "
                        "move by all_to_all); FILE: a plan YAML of parameter globs per mesh axis, or a "
                        "saved plan.json (checked against the model's graph)")
    _add_lowering(t)
    _add_training_features(t)
    from .pipeline_flags import add_pipeline_flags

    add_pipeline_flags(t)
    from .modes import add_mode_flags

    add_mode_flags(t)
    t.add_argument("--steps", type=_positive(int), default=800, help="training steps")
    t.add_argument("--lr", type=_positive(float), default=2e-3, help="learning rate")
    t.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="adamw: torch.optim.AdamW with torch's defaults but --lr (weight_decay=0.01); sgd: plain SGD")
    t.add_argument("--max-grad-norm", type=_positive(float), default=None,
                   help="clip gradients to this global 2-norm (over all shards, as torch.nn.utils.clip_grad_norm_)")
    t.add_argument("--seed", type=_seed, default=0, help="random seed, 0..2**63-1")
    t.add_argument("--out", metavar="DIR", default="runs/latest", help="output directory")
    t.add_argument("--threads-per-rank", type=_threads, default=None,
                   help="torch threads per rank; None: cores // ranks, at least 1")
    _add_fault_tolerance(t)
    from .train_hosts import add_host_arguments

    add_host_arguments(t)
    t.add_argument("--sample-bytes", type=bounded(int, 0, 2**20), default=300, help="bytes of text to generate at the end (0: none)")
    t.add_argument("--dump-graphs", metavar="DIR",
                   help="write the graph before and after each lowering pass, with its op-count diff, to DIR")
    t.add_argument("--skip-memory-check", action="store_true",
                   help="launch even when the predicted peak memory of the local ranks exceeds this host's "
                        "available memory (the check then only warns)")
    t.add_argument("--rebalance-after", metavar="auto|off|N", default="auto",
                   help="after N steps the ranks measure each one's compute per step (step minus waits), re-split the "
                        "batch rows in proportion to the measured speeds (within memory) and go on with programs "
                        "lowered for them, once; auto: after 10 steps when the plan splits the batch unevenly for "
                        "unequal devices (--cluster with different speeds), else off")
    t.add_argument("--trace", action="store_true",
                   help="record what every rank does when (forward, backward, collectives, optimizer, idle) and "
                        "write OUT/trace.json (chrome://tracing, Perfetto), OUT/timeline.png and OUT/timeline.html, "
                        "measured beside the cost model's prediction")
    p = sub.add_parser("plan", help="compile a plan and print where every parameter lives (no training)",
                       formatter_class=fmt)
    _add_common(p)
    p.add_argument("--plan", default="auto", metavar="auto|dp|fsdp|tp|dp,tp|FILE", help="as for train")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "sgd-momentum"), default="adamw",
                   help="sizes the optimizer state the automatic plan must fit")
    _add_training_features(p)
    p.add_argument("--out", metavar="FILE", help="also write the plan as JSON here")
    p.add_argument("--data", metavar="FILE|DIR", help="as for train: the data a model file that sizes its model from "
                                                      "the data (builtin:dlrm) reads")
    _add_lowering(p)
    add_pipeline_flags(p)
    add_mode_flags(p)
    from .cluster import add_parser as add_cluster_parser

    add_cluster_parser(sub)  # adaptdist cluster detect|profile
    from .estimate import add_parser as add_estimate_parser

    add_estimate_parser(sub, _add_common)  # adaptdist estimate
    from .explain import add_parser as add_explain_parser

    add_explain_parser(sub, _add_common)  # adaptdist explain NODE
    from .launch import add_parser as add_launch_parser

    add_launch_parser(sub)  # adaptdist launch script.py
    c = sub.add_parser("compile", help="compile the model for a cluster into a directory of rank artifacts",
                       formatter_class=fmt)
    _add_common(c)
    c.add_argument("--plan", default="auto", metavar="auto|dp|fsdp|tp|dp,tp|FILE", help="as for train")
    c.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "sgd-momentum"), default="adamw",
                   help="sizes the optimizer state for the plan and the report")
    c.add_argument("-o", "--out", metavar="DIR", required=True, help="artifact directory to write")
    c.add_argument("--data", metavar="FILE|DIR", help="as for train: the data a model file that sizes its model from "
                                                      "the data (builtin:dlrm's tables) reads; `adaptdist run` then "
                                                      "defaults to it and refuses data that needs other sizes")
    _add_lowering(c)
    add_pipeline_flags(c)
    r = sub.add_parser("run", help="train with the artifacts of `adaptdist compile` on local ranks",
                       formatter_class=fmt)
    r.add_argument("artifacts", metavar="DIR", help="the -o directory of `adaptdist compile`")
    r.add_argument("--cluster", metavar="FILE", help="the cluster to run on (default: the manifest's number of "
                                                     "local ranks); must have the topology compiled for")
    r.add_argument("--data", metavar="FILE|DIR", help="the data for the model file's data(..., path=...): default the "
                                                      "compile's --data; data that needs other parameter sizes (e.g. "
                                                      "another MovieLens folder's table rows) is refused")
    r.add_argument("--steps", type=_positive(int), default=100, help="training steps")
    r.add_argument("--lr", type=_positive(float), default=2e-3, help="learning rate")
    r.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="adamw: torch.optim.AdamW with torch's defaults but --lr (weight_decay=0.01); sgd: plain SGD")
    r.add_argument("--seed", type=_seed, default=0, help="random seed, 0..2**63-1")
    r.add_argument("--out", metavar="DIR", default="runs/artifacts", help="checkpoint and summary directory")
    from ..runtime.timeouts import Timeouts

    r.add_argument("--checkpoint-every", type=_positive(int), default=100, metavar="N",
                   help="write a checkpoint every N steps (and at the end, and on SIGTERM/SIGINT)")
    r.add_argument("--keep", type=_positive(int), default=3, metavar="K", help="keep the newest K checkpoints")
    r.add_argument("--max-restarts", type=nonnegative_int, default=0, metavar="R",
                   help="restart every rank from the newest good checkpoint up to R times when one dies or stalls")
    r.add_argument("--collective-timeout-s", "--timeout-s", dest="collective_timeout_s", type=_positive(float),
                   default=Timeouts().collective_s, help="collective timeout, seconds (README: Fault tolerance)")
    r.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint in --out (a run of these artifacts stopped early, "
                        "or a finished one given a larger --steps)")
    r.add_argument("-v", "--verbose", action="store_true", help="debug logs")
    from .zoo import add_zoo_parser

    add_zoo_parser(sub)
    return ap


MAX_LOWERED_RANKS = 16
"""``adaptdist plan`` lowers an automatic plan to show shards and collectives only up to this many ranks."""


def cmd_plan(args) -> int:
    """Print the plan's mesh, a per-parameter placement table and each rank's collectives."""
    import torch
    from rich.table import Table

    from ..compiler.consistency import collective_calls
    from ..console import report_console
    from ..compiler.lowering import compile_model
    from ..model_spec import ModelSpec

    console = report_console()
    check_out_file(args.out)
    cluster = _cluster(args)
    spec = ModelSpec.parse(args.model)
    torch.manual_seed(0)
    model, example, loss_fn = spec.build(args.batch_size, args.seq_len, data_path=getattr(args, "data", None))
    from ..compiler.training_features import apply_training_features

    model, loss_fn = apply_training_features(model, loss_fn, args.precision, args.activation_checkpointing)
    from .modes import print_mode, resolve_mode, write_mode_json

    choice = resolve_mode(args, model, example, cluster, console, loss_fn=loss_fn)
    if choice is not None:
        print_mode(choice, console)
        if choice.mode == "async-hetero":  # no compiled programs: the layout is the plan
            if args.out:
                write_mode_json(args.out, choice)
                console.print(f"wrote {args.out}")
            return 0
    from .pipeline_flags import compile_pipeline_or_none, print_pipeline_plan

    pipeline = compile_pipeline_or_none(args, spec, model, example, loss_fn, cluster.world_size,
                                        lowering_options(args, cluster), cluster, console)
    if pipeline is not None:
        return print_pipeline_plan(pipeline, spec, cluster, console, args.out)
    plan, captured = resolve_plan(args, spec, model, example, loss_fn, cluster, console,
                                  args.optimizer.replace("-", "_"))
    if captured is not None and cluster.world_size > MAX_LOWERED_RANKS:
        if args.out:
            Path(args.out).write_text(plan.to_json())
            console.print(f"wrote {args.out}")
        console.print(f"(not lowered: {cluster.world_size} ranks; `adaptdist plan` lowers automatic plans of up to "
                      f"{MAX_LOWERED_RANKS} ranks to list each rank's shards and collectives)")
        return 0
    from ..compiler.device_placement import device_table, parse_batch_split, placement_line
    from ..cost_models.estimate import estimate_programs
    from ..device_assignment import program_cluster
    from .pipeline_flags import is_pipeline

    programs = compile_model(model, example, loss_fn, cluster.world_size, plan, lowering_options(args, cluster),
                             mesh=args.mesh if captured is None else None, captured=captured, cluster=cluster,
                             optimizer=args.optimizer.replace("-", "_"),
                             batch_split=parse_batch_split(getattr(args, "batch_split", None)))
    if is_pipeline(programs):  # a saved pipeline plan file
        return print_pipeline_plan(programs, spec, cluster, console, args.out)
    p0 = programs[0]
    est = estimate_programs(programs, program_cluster(p0.plan, cluster), args.optimizer.replace("-", "_"))
    if captured is not None:
        console.print(f"adaptdist estimate of the lowered programs (overlap timeline, exact collectives): step "
                      f"{1e3 * est.step_s:.3f} ms, peak memory {est.peak_memory_bytes / 2**20:,.1f} MiB per rank")
    mesh = ",".join(f"{a}={n}" for a, n in p0.mesh.items())
    batch_axis = p0.plan.batch_axis
    console.print(f"plan {p0.plan.name!r} for {spec.text} on {cluster!r}: mesh {mesh}; batch "
                  f"{'split on dim 0 over ' + batch_axis if batch_axis else 'replicated'}")
    table = Table(title="parameters")
    one = cluster.world_size == 1  # one rank: one column of what it holds
    for col in ("parameter", "global shape", "placement", "rank 0 holds") + (
            () if one else (f"rank {cluster.world_size - 1} holds",)):
        table.add_column(col)
    last = programs[cluster.world_size - 1]
    for f in p0.input_fqns:
        pls = p0.state_placements.get(f)
        text = " ".join(f"{a}:{p}" for a, p in zip(p0.mesh, pls)) if pls else "R"
        table.add_row(f, str(p0.global_shapes[f]), text, str(list(p0.state[f].shape)),
                      *(() if one else (str(list(last.state[f].shape)),)))
    console.print(table)
    from ..compiler.expert_lists import expert_lines

    for line in expert_lines(p0.stacked, p0.notes):
        console.print(line)
    console.print(device_table(programs, cluster, est))
    console.print(placement_line(p0.plan))
    calls = collective_calls(p0)
    kinds: dict[tuple[str, str], list[int]] = {}
    for c in calls:
        kinds.setdefault((c.group.removeprefix("adaptdist:"), c.op), []).append(c.numel)
    console.print("collectives per step on rank 0: " + (", ".join(
        f"{len(v)} x {op} on {axis} ({sum(v) * 4 / 2**20:.2f} MiB of fp32 inputs)"
        for (axis, op), v in sorted(kinds.items())) or "none"))
    if args.out:
        Path(args.out).write_text(p0.plan.to_json())
        from ..compiler.device_placement import draw_devices

        picture = Path(args.out).with_suffix(".devices.png")
        draw_devices(programs, cluster, est, picture)
        console.print(f"wrote {args.out} and {picture} (each rank's device, rows and predicted time)")
    return 0


def cmd_train(args) -> int:
    """``adaptdist train``: see :mod:`adaptdist.cli.train` (one host) and :mod:`adaptdist.cli.train_hosts`
    (``--nnodes``: several hosts)."""
    if getattr(args, "nnodes", None) is not None and not args.join:
        if getattr(args, "mode", "auto") == "async-hetero":
            raise UsageError("--mode async-hetero runs on one host's local ranks so far; drop --nnodes, or use "
                             "--mode sync")
        from ..console import report_console
        from .train_hosts import cmd_train_hosts

        return cmd_train_hosts(args, args._defaults, report_console(stderr=True))
    from .train import cmd_train as run

    return run(args, args._defaults)


def cmd_estimate(args) -> int:
    """``adaptdist estimate``: predicted step time and memory per rank; see :mod:`adaptdist.cli.estimate`."""
    from .estimate import cmd_estimate as run

    return run(args, _cluster(args))


def cmd_compile(args) -> int:
    """``adaptdist compile``: write rank artifacts (see :mod:`adaptdist.compiler.artifacts`)."""
    from ..console import report_console
    from ..compiler.device_placement import parse_batch_split

    from ..compiler.artifacts import check_replaceable_artifacts, compile_artifacts
    from ..model_spec import ModelSpec
    from .pipeline_flags import pipeline_request

    console = report_console()
    cluster = _cluster(args)
    spec = ModelSpec.parse(args.model)
    check_replaceable_artifacts(Path(args.out))  # a folder that is not adaptdist artifacts is refused first
    prepare_out_dir(args.out, "-o")
    t0 = time.perf_counter()
    res = compile_artifacts(spec, cluster, batch_size=args.batch_size, seq_len=args.seq_len, plan_arg=args.plan,
                            out_dir=args.out, optimizer=args.optimizer.replace("-", "_"), mesh=args.mesh,
                            console=console, options=lowering_options(args, cluster),
                            pipeline=pipeline_request(args), consider_pp=True if args.consider_pp else None,
                            batch_split=parse_batch_split(getattr(args, "batch_split", None)),
                            data_path=args.data)
    mesh = ",".join(f"{a}={n}" for a, n in res.plan.mesh.items())
    if getattr(res, "pipeline", False):
        from .pipeline_flags import pipeline_mesh_text

        mesh = pipeline_mesh_text(res.programs)
    console.print(f"compiled {spec.text} for {cluster!r} (mesh {mesh}) in {time.perf_counter() - t0:.1f} s: "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in res.phases_s.items()))
    console.print(f"wrote {res.out_dir}: manifest.json, plan.json, rank0..{len(res.programs) - 1}/program.py"
                  f", report.html; train with: adaptdist run {res.out_dir}")
    return 0


def cmd_run(args) -> int:
    """``adaptdist run DIR``: check the artifacts against this cluster, then train with them on local ranks."""
    from ..console import report_console
    from safetensors.torch import load_file

    from ..calibrate.local import load_cluster, local_cluster
    from ..program import check_artifacts, check_model_file, read_manifest
    from ..runtime.launch import launch_local
    from ..runtime.run_artifacts import check_data_fits, data_spec
    from ..runtime.timeouts import Timeouts
    from ..runtime.worker import TrainConfig, _next_attempt, run_worker
    from .train import (RUN_FILE, _clear_previous_run, _ended_early, _restored_args, check_replaceable,
                        check_resumable, lock_out_dir, write_run_file, write_summary)

    RUN_RESTORED = ("lr", "optimizer", "seed", "data", "checkpoint_every", "keep", "max_restarts",
                    "collective_timeout_s")

    console = report_console(stderr=True)
    d = Path(args.artifacts)
    if not d.is_dir():
        raise UsageError(f"{str(d)!r} is not a directory; pass the -o directory of `adaptdist compile`")
    if not args.resume:
        check_replaceable(Path(args.out))  # a folder that is not an adaptdist run is refused before any work
    else:  # a refused --resume creates nothing
        _restored_args(args, args._defaults, RUN_RESTORED, args.out, "adaptdist run")
        run_file = Path(args.out) / RUN_FILE
        if Path(json.loads(run_file.read_text())["settings"].get("artifacts", "")).resolve() != d.resolve():
            raise UsageError(f"--resume: the run in {args.out!r} trained other artifacts than {str(d)!r}")
        check_resumable(Path(args.out), args.steps, console)
    out = prepare_out_dir(args.out)
    manifest = read_manifest(d)
    cluster = load_cluster(args.cluster) if args.cluster else local_cluster(manifest["world_size"])
    manifest = check_artifacts(d, cluster)
    check_model_file(manifest, d)
    if len(cluster.hosts) > 1:
        raise UsageError(f"{cluster!r} has several hosts: on each host run `torchrun --nnodes "
                         f"{len(cluster.hosts)} --nproc-per-node N --rdzv-endpoint HOST:PORT -m "
                         f"adaptdist.runtime.run_artifacts {d}`; `adaptdist run` starts local ranks only")
    if cluster.device_kind != "cpu":
        raise UsageError(f"{cluster!r}: `run` starts cpu (gloo) ranks only so far (artifacts are compiled on cpu); "
                         "`adaptdist train --cluster FILE` compiles for and trains on cuda ranks")
    timeouts = Timeouts.for_collective(args.collective_timeout_s)
    timeouts.check()
    if args.data is None:
        args.data = manifest.get("data")  # the data the artifacts were compiled for
    check_data_fits(manifest, d, args.data)
    data = data_spec(manifest, d, args.data, args.seed)
    if data.function:
        from ..runtime.worker import global_batches

        next(global_batches(data))  # a first batch unlike the compiled one: DataError now (the ranks check the rest)
    example = load_file(str(d / "example_batch.safetensors"))
    lock = lock_out_dir(out)  # held until this process ends
    if not args.resume:  # (everything checked: only now is the previous run in --out replaced)
        _clear_previous_run(out, console)
    write_run_file(out, {**{k: getattr(args, k) for k in (*RUN_RESTORED, "steps")}, "artifacts": str(d)}, "running")
    from ..throughput import manifest_unit

    unit, items = manifest_unit(manifest, [example["b0"]])
    world = manifest["world_size"]
    threads = max(1, (os.cpu_count() or 1) // world)
    # the attempts before this launch (a resumed run's) are not its restarts: count from the next one, as train does
    cfg = TrainConfig(first_attempt=_next_attempt(str(out)), program_dir=str(d), out_dir=str(out), data=data,
                      steps=args.steps, lr=args.lr,
                      optimizer=args.optimizer, seed=args.seed, threads_per_rank=threads,
                      timeout_s=timeouts.collective_s, backend=cluster.backend, items_per_step=items, unit=unit,
                      checkpoint_every=args.checkpoint_every, keep=args.keep, model_name=str(manifest.get("model")),
                      run_meta={"artifacts": str(d)}, rng=manifest.get("rng", "per-rank"),
                      cpus_of_rank=_artifact_cpus(d, cluster))
    console.print(f"running {d} ({manifest.get('model')}, mesh {manifest['mesh']}) on {cluster!r} for {args.steps} "
                  f"steps; data from {data.module_file + ':data' if data.function else 'the example batch'}")
    t0 = time.perf_counter()
    launched_s = time.time()
    try:
        launch_local(run_worker, (cfg,), world, max_restarts=args.max_restarts, timeouts=timeouts)
    except BaseException as e:
        from .train import finished_anyway

        if finished_anyway(e, out, args.steps, launched_s, console) is None:  # (else: finished after all)
            return _ended_early(e, out, console, resume=f"adaptdist run {d} --out {out} --resume", steps=args.steps)
    result = json.loads((out / "result.json").read_text())
    wall = time.perf_counter() - t0
    summary, loss_text = write_summary(out, result, wall)
    losses = summary["losses"]
    lock.close()
    console.print(f"trained {len(losses)} steps on {world} ranks in {wall:.0f} s: {loss_text}; checkpoints "
                  f"{out / 'checkpoints'}")
    return 0


def _artifact_cpus(d: Path, cluster) -> tuple:
    """Each rank's ``cpus`` (the cluster file's, of the device the artifacts' plan maps it to), for the worker."""
    from ..plan import Plan
    from ..runtime.affinity import cpus_of_ranks

    plan = Plan.load(d / "plan.json") if (d / "plan.json").is_file() else None
    devices = plan.devices if plan is not None else None
    return cpus_of_ranks(cluster, devices.rank_to_device if devices is not None else None)


def cmd_explain(args) -> int:
    """``adaptdist explain NODE``: see :mod:`adaptdist.cli.explain`."""
    from .explain import cmd_explain as run

    return run(args, _cluster(args))


def cmd_zoo(args) -> int:
    """``adaptdist zoo``: see :mod:`adaptdist.cli.zoo`."""
    from .zoo import cmd_zoo as run

    return run(args)


def cmd_cluster(args) -> int:
    """``adaptdist cluster detect|profile``: see :mod:`adaptdist.cli.cluster`."""
    from .cluster import cmd_cluster as run

    return run(args)


def cmd_launch(args) -> int:
    """``adaptdist launch script.py``: see :mod:`adaptdist.cli.launch`."""
    from .launch import cmd_launch as run

    return run(args)


def _parse(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``ap.parse_args(argv)``, but an unknown flag is reported by its subcommand's parser (``adaptdist train
    --plna`` prints train's usage, not the top-level list of subcommands); exits with code 2 as argparse does."""
    args, unknown = ap.parse_known_args(argv)
    if unknown:
        commands = next((a.choices for a in ap._actions if isinstance(a, argparse._SubParsersAction)), {})
        commands.get(args.command, ap).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``adaptdist`` command; returns the exit code (2 for a user error, with no traceback)."""
    ap = build_parser()
    args = _parse(ap, argv)
    if args.command is None:
        args = _parse(ap, ["train", *(argv or [])])
    if args.command in ("train", "run"):  # --resume tells given flags from defaults
        args._defaults = vars(ap.parse_args(["train"] if args.command == "train" else ["run", "DIR"]))
    logging.basicConfig(level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        check_batch_items(getattr(args, "batch_size", None), getattr(args, "seq_len", None))
        from .mesh_axes import check_mesh_axes

        check_mesh_axes(getattr(args, "mesh", None), getattr(args, "plan", None))  # before any work or --out change
        check_comm(args)
        commands = {"train": cmd_train, "plan": cmd_plan, "cluster": cmd_cluster, "estimate": cmd_estimate,
                    "explain": cmd_explain, "compile": cmd_compile, "run": cmd_run, "launch": cmd_launch,
                    "zoo": cmd_zoo}
        return commands[args.command](args)
    except AdaptdistError as e:
        if os.environ.get("ADAPTDIST_TRACEBACK") == "1":  # where it was raised and its cause, for a bug report
            traceback.print_exc()
        print(f"adaptdist: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("adaptdist: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
