"""``adaptdist estimate``: predicted step time and peak memory per rank, without running anything.

    adaptdist estimate [MODEL] [--plan dp|fsdp|tp|dp,tp|FILE] [--nproc N | --cluster FILE] [--mesh dp=2,tp=2]
                       [--batch-size B] [--seq-len L] [--optimizer adamw|adam|sgd|sgd-momentum]
                       [--algorithm ring|tree|auto] [--symbolic]

It compiles the plan exactly as ``train`` would (same bucket size) and costs every rank's
lowered program (:func:`adaptdist.cost_models.estimate.estimate_programs`); ``--symbolic`` also fits the costs
as formulas in B, T and the mesh-axis sizes (:mod:`adaptdist.cost_models.symbolic`) and prints them.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

from ..errors import UsageError
from .common import positive


def add_parser(sub: Any, add_common: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    """Add the ``estimate`` subcommand to ``sub`` (the CLI's subparsers); ``add_common`` adds the shared
    model / cluster / size arguments."""
    p = sub.add_parser("estimate", help="predict step time and peak memory per rank for a plan (runs nothing)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common(p)
    p.add_argument("--plan", default="auto", metavar="auto|dp|fsdp|tp|dp,tp|FILE", help="as for train")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "sgd-momentum"), default="adamw",
                   help="optimizer whose state and step are costed")
    p.add_argument("--bucket-mb", type=positive(float), default=None,
                   help="gradient bucket size, MiB (as for train; default: LoweringOptions', 2)")
    p.add_argument("--replicate-fallback", action="store_true", help="as for train")
    p.add_argument("--data", metavar="FILE|DIR", help="as for plan: the data a model file that sizes its model "
                                                      "from the data (builtin:dlrm) reads")
    p.add_argument("--comm", choices=("auto", "shm", "gloo"), default="auto",
                   help="as for train: shm-carried axes are costed with the shared-memory kernels' calibrated "
                        "alpha and beta (adaptdist cluster profile)")
    p.add_argument("--algorithm", choices=("ring", "tree", "auto"), default="ring",
                   help="collective algorithm of the alpha-beta model (auto: the faster per collective)")
    p.add_argument("--symbolic", action="store_true",
                   help="also fit the costs as formulas in B, T and the mesh-axis sizes (compiles a few more "
                        "sizes) and print them with predictions at other sizes")
    return p


def cmd_estimate(args: argparse.Namespace, cluster: Any) -> int:
    """Compile the plan for ``cluster`` and print the per-rank estimate table (and formulas with ``--symbolic``).

    Raises:
        AdaptdistError: bad model, plan, cluster or sizes (``adaptdist.cli.main`` prints it).
    """
    import torch

    from ..annotations import ManualPlan
    from ..compiler.lowering import compile_model
    from ..lowering_options import LoweringOptions
    from ..model_spec import ModelSpec
    from ..cost_models.estimate import collectives_summary, estimate_programs, estimate_table

    if args.bucket_mb is not None and args.bucket_mb <= 0:
        raise UsageError(f"--bucket-mb must be > 0, got {args.bucket_mb}")
    mesh_text = getattr(args, "mesh", None) or ""
    if args.plan == "pp" or any(part.split("=")[0].strip() == "pp" for part in mesh_text.split(",")):
        raise UsageError("adaptdist estimate does not support pipeline plans (--plan pp, --mesh pp=...) yet; "
                         "`adaptdist plan MODEL --plan pp` shows a pipeline's stages and traffic, "
                         "`adaptdist train --trace` its timeline")
    from ..console import report_console

    console = report_console()
    spec = ModelSpec.parse(args.model)
    module = spec.module()
    from ..comm_transport import rank_hosts

    options = LoweringOptions.from_mb(args.bucket_mb, replicate_fallback=args.replicate_fallback, front_end="cli",
                                      comm=args.comm, hosts=rank_hosts(cluster))
    optimizer = args.optimizer.replace("-", "_")
    if args.plan == "auto":
        from .common import resolve_plan

        torch.manual_seed(0)
        model, example, loss_fn = spec.build(args.batch_size, args.seq_len, data_path=getattr(args, "data", None))
        auto, captured = resolve_plan(args, spec, model, example, loss_fn, cluster, console, optimizer)
        programs = compile_model(model, example, loss_fn, cluster.world_size, auto, options, captured=captured,
                                 cluster=cluster, optimizer=optimizer)
        plan = ManualPlan(name="auto", mesh_axes=tuple(auto.mesh), batch_axis=auto.batch_axis,
                          params=tuple((f, tuple(map(repr, p))) for f, p in auto.param_placements.items()))
    else:
        hf = "tp" in args.plan.replace(" ", "").split(",") and getattr(module, "TP_PLAN", None) is None
        torch.manual_seed(0)
        model = spec.build(args.batch_size, args.seq_len, getattr(args, "data", None))[0] if hf else None
        plan = ManualPlan.parse(args.plan, module, model)  # tp without TP_PLAN: the model's own (Hugging Face) plan

    def compile_at(batch_size: int, seq_len: int, world_size: int, mesh: str | None, on=None):
        torch.manual_seed(0)
        model, example, loss_fn = spec.build(batch_size, seq_len, data_path=getattr(args, "data", None))
        return compile_model(model, example, loss_fn, world_size, plan, options, mesh=mesh, cluster=on,
                             optimizer=optimizer), example, model

    if args.plan != "auto":
        programs, example, model = compile_at(args.batch_size, args.seq_len, cluster.world_size, args.mesh, cluster)
    from ..device_assignment import program_cluster

    est = estimate_programs(programs, program_cluster(programs[0].plan, cluster), optimizer, args.algorithm)
    p0 = programs[0]
    mesh_text = ",".join(f"{a}={n}" for a, n in p0.mesh.items())
    calibrated = bool(getattr(cluster, "calibrated", False))
    console.print(f"estimate for plan {plan.name!r} of {spec.text} on {cluster!r}: mesh {mesh_text}, global batch "
                  f"{args.batch_size} x seq {args.seq_len}, {optimizer}, {args.algorithm} collectives, "
                  f"{'calibrated' if calibrated else 'estimated (uncalibrated)'} figures")
    console.print(estimate_table(est))
    slow = max(est.ranks.values(), key=lambda r: r.step_s)
    from ..throughput import throughput_unit

    unit, items = throughput_unit(example, model)
    console.print(f"predicted step {slow.step_s * 1e3:.3f} ms (slowest rank {slow.rank}: compute "
                  f"{slow.compute_s * 1e3:.3f} ms incl. optimizer {slow.optimizer_s * 1e3:.3f} ms, communication "
                  f"{slow.communication_s * 1e3:.3f} ms of which {slow.idle_s * 1e3:.3f} ms not hidden), "
                  f"{items / slow.step_s:,.0f} {unit}/s; peak memory {est.peak_memory_bytes / 2**20:.2f} MiB per rank")
    console.print(f"collectives per step on rank 0: {collectives_summary(est.ranks[0])}")
    from ..calibrate.local import uncalibrated_note

    note = uncalibrated_note(cluster)
    if note:
        console.print(f"[yellow]{note}[/]")
    over = [r for r in est.ranks.values() if r.memory.peak_bytes > r.device_memory_bytes]
    if over:
        console.print(f"[red]ranks {[r.rank for r in over]} need more memory than their device has "
                      f"({over[0].device_memory_bytes / 2**30:.1f} GiB): try --plan fsdp or more ranks[/]")
    if args.symbolic:
        _print_symbolic(console, args, cluster, plan, p0, compile_at, optimizer)
    return 0


def _short(expr: Any, limit: int = 400) -> str:
    """The expression as text, cut at ``limit`` characters with the number of Max pieces it has."""
    text = str(expr)
    if len(text) <= limit:
        return text
    import sympy

    pieces = max((len(m.args) for m in expr.atoms(sympy.Max)), default=0)
    return text[:limit] + f" ... (a Max of up to {pieces} pieces, {len(text):,} characters)"


def _print_symbolic(console, args, cluster, plan, p0, compile_at, optimizer: str) -> None:
    from rich.table import Table

    from ..plan import Plan
    from ..cost_models.symbolic import fit_symbolic_estimate

    if isinstance(plan, Plan):
        raise UsageError("--symbolic compiles other batch and mesh sizes, which a saved plan.json (made for one "
                         "graph) cannot describe; use a preset (dp, fsdp, tp, dp,tp) or a plan YAML file")
    multi = len(p0.mesh) > 1

    def at(point):
        mesh = ",".join(f"{a}={n}" for a, n in point.mesh) if multi else None
        return compile_at(point.batch_size, point.seq_len, math.prod(point.mesh_dict.values()), mesh)[0]

    with console.status("fitting costs over sample sizes"):
        sym = fit_symbolic_estimate(at, args.batch_size, args.seq_len, dict(p0.mesh), cluster, optimizer,
                                    args.algorithm)
    console.print(f"as formulas in B (global batch), T (sequence length) and {', '.join(p0.mesh)} (axis sizes), "
                  f"rank 0, fitted over {len(sym.points)} compiles:")
    console.print(f"  FLOPs per rank        = {_short(sym.flops)}")
    console.print(f"  communication bytes   = {_short(sym.communication_bytes)}")
    console.print(f"  parameters bytes      = {_short(sym.params_bytes)}")
    console.print(f"  optimizer state bytes = {_short(sym.optimizer_state_bytes)}")
    console.print(f"  peak memory bytes     = {_short(sym.peak_memory_bytes)}")
    if sym.fixed:
        console.print(f"[yellow]  held fixed (changing them regroups the lowering's nodes, or it fails): "
                      f"{', '.join(f'{n}={v}' for n, v in sym.fixed)}[/]")
    if sym.unfitted:
        console.print(f"[yellow]  sizes of {len(sym.unfitted)} nodes fit no formula (uneven shards?), kept at the "
                      f"base value: {', '.join(sym.unfitted[:6])}{' ...' if len(sym.unfitted) > 6 else ''}[/]")
    table = Table(title="predictions at other sizes (from the formulas, no compile)")
    for col in ("B", "T", *p0.mesh, "step ms", "compute ms", "comm ms", "idle ms", "peak MiB"):
        table.add_column(col, justify="right")
    base = dict(p0.mesh)
    rows = [(args.batch_size, args.seq_len, base), (2 * args.batch_size, args.seq_len, base),
            (args.batch_size, 2 * args.seq_len, base)]
    rows += [(2 * args.batch_size, args.seq_len, {a: n * (2 if a == axis else 1) for a, n in base.items()})
             for axis in base]
    fixed = dict(sym.fixed)
    for b, t, mesh in rows:
        values = {"B": b, "T": t, **mesh}
        if any(values[n] != v for n, v in fixed.items()) or (b, t, mesh) in rows[:rows.index((b, t, mesh))]:
            continue
        v = sym.evaluate(b, t, mesh)
        table.add_row(str(b), str(t), *(str(mesh[a]) for a in base), f"{v['step_s'] * 1e3:.3f}",
                      f"{v['compute_s'] * 1e3:.3f}", f"{v['communication_s'] * 1e3:.3f}",
                      f"{v['idle_s'] * 1e3:.3f}", f"{v['peak_memory_bytes'] / 2**20:.2f}")
    console.print(table)
