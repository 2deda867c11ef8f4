"""adaptdist's FSDP-like plan vs torch FSDP2 (``fully_shard``), measured in one run.

Same model (built-in GPT, default GPTConfig), same global batch, same number of
ranks (gloo on CPU), same threads per rank, same optimizer (AdamW, lr 1e-3,
weight_decay 0, i.e. adaptdist's ``make_optimizer("adamw")``), same data (the
factory's example batch, repeated); each rank takes its ``torch.chunk`` of the
global batch on both sides.

- adaptdist: ``ManualPlan.parse("fsdp")``: the batch split on dim 0 and every parameter
  sharded on dim 0; parameters all-gathered where used and again in backward,
  gradients reduce-scattered; each rank's AdamW updates its own shards.
- FSDP2: ``fully_shard`` on each GPT block, then on the root model (torch's defaults:
  parameters sharded on dim 0, all-gathered per block, gradients reduce-scattered;
  the tied embedding/head weight belongs to the root's group).

Timing follows ``bench_dp.py`` (whose workers and helpers this file imports): each
repetition launches both sides as separate ``launch_local`` jobs (fresh processes),
the order alternates between repetitions, warm-up steps are excluded, per step the
time is the slowest rank's; reported: the median step time over all measured steps,
the spread of per-repetition medians, tokens/s and their ratio, and peak memory per
rank with ``adaptdist.runtime.memory.PeakMemory`` (one extra untimed step after the
timed ones) with the process's max RSS beside it.

Then a memory-only table: adaptdist's peak memory per rank for the ``fsdp`` plan vs
the ``dp`` plan at world sizes 1, 2 and 4 (one short launch each: one step, then the
measured step), to show whether the sharded plan's peak per rank falls as the world grows.

    .venv/bin/python benchmarks/bench_fsdp.py [--nproc 2] [--batch-size 16] [--seq-len 128]
        [--steps 20] [--warmup 3] [--reps 4] [--threads-per-rank 1] [--timeout-s 120]
        [--memory-worlds 1,2,4]

Peak memory of DTensor programs: ``PeakMemory``'s meter reads each tensor's storage, which
a DTensor (a wrapper subclass, no storage of its own) does not have, so the torch side's
ranks count a DTensor by its local shard (its inner tensor) — see ``dtensor_aware_peak_memory``.
Only the DTensor ops' outputs are seen that way, not temporaries made inside one DTensor op.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_dp import (_load_batch, _setup, _summarize, adaptdist_worker, add_common_args,  # noqa: E402
                      measure_torch_side)

MIB = 2**20


# --------------------------------------------------------------------------- shared with bench_tp.py

def dtensor_aware_peak_memory() -> None:
    """In this rank process only: make PeakMemory count a DTensor by its local tensor.

    ``adaptdist.runtime.memory._Meter.track`` calls ``untyped_storage().data_ptr()``, which
    raises on a wrapper tensor subclass such as DTensor or funcol's AsyncCollectiveTensor
    ("Attempted to access the data pointer on an invalid python storage"); such a tensor is
    counted by its inner tensors (``__tensor_flatten__``), i.e. a DTensor by its local shard.
    Same metric otherwise (live storage bytes, counted once per storage).
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    from adaptdist.runtime import memory

    orig = memory._Meter.track
    if getattr(orig, "_unwraps_dtensor", False):
        return

    def track(self, t):
        if is_traceable_wrapper_subclass(t):  # DTensor, funcol's AsyncCollectiveTensor: count the inner tensors
            for attr in t.__tensor_flatten__()[0]:
                track(self, getattr(t, attr))
        else:
            orig(self, t)

    track._unwraps_dtensor = True
    memory._Meter.track = track


def run_alternating(con, sides: dict, cfg: dict, args) -> tuple[dict[str, list], tuple, tuple, float]:
    """``args.reps`` repetitions, one ``launch_local`` per side each, order alternating (as bench_dp)."""
    from adaptdist.runtime.launch import launch_local

    names = list(sides)
    results: dict[str, list] = {n: [] for n in names}
    t_all = time.perf_counter()
    load_before = os.getloadavg()
    for rep in range(args.reps):
        order = names if rep % 2 == 0 else names[::-1]
        for side in order:
            t0 = time.perf_counter()
            res = launch_local(sides[side], (cfg,), args.nproc)
            times = sorted(max(res[r]["times"][i] for r in res) for i in range(args.warmup, args.warmup + args.steps))
            con.print(f"rep {rep + 1}/{args.reps} {side:9s}: median step {1e3 * statistics.median(times):7.1f} ms "
                      f"(launch total {time.perf_counter() - t0:.1f} s)")
            results[side].append(res)
    load_after = os.getloadavg()
    return results, load_before, load_after, time.perf_counter() - t_all


def print_load(con, load_before, load_after, wall, args) -> None:
    con.print(f"all launches: {wall:.0f} s; load average (1/5/15 min) before "
              f"{'/'.join(f'{x:.2f}' for x in load_before)}, after {'/'.join(f'{x:.2f}' for x in load_after)} "
              f"(this benchmark itself keeps ~{args.nproc * args.threads_per_rank} cores busy; more means other "
              f"work on the machine)")


def write_json(path, args, load_before, load_after, results) -> None:
    import json

    raw = {side: [{r: {"times": res[r]["times"], "losses": res[r]["losses"]} for r in res} for res in reps]
           for side, reps in results.items()}
    Path(path).write_text(json.dumps({"args": vars(args), "load_before": load_before,
                                      "load_after": load_after, "raw": raw}))


def comparison_table(con, title: str, other: str, a: dict, d: dict, target: float = 0.9) -> float:
    """bench_dp's table, with ``other`` as the torch side's name; returns the throughput ratio."""
    from rich.table import Table

    t = Table(title=title)
    t.add_column("metric")
    t.add_column("adaptdist", justify="right")
    t.add_column(other, justify="right")
    t.add_column(f"adaptdist / {other}", justify="right")
    t.add_row("median step time (ms)", f"{1e3 * a['median_s']:.1f}", f"{1e3 * d['median_s']:.1f}",
              f"{a['median_s'] / d['median_s']:.3f}")
    t.add_row("spread: per-rep medians min-max (ms)", f"{1e3 * a['min_rep_s']:.1f}-{1e3 * a['max_rep_s']:.1f}",
              f"{1e3 * d['min_rep_s']:.1f}-{1e3 * d['max_rep_s']:.1f}", "")
    t.add_row("fastest per-rep median (ms; least disturbed by other load)", f"{1e3 * a['min_rep_s']:.1f}",
              f"{1e3 * d['min_rep_s']:.1f}", f"{a['min_rep_s'] / d['min_rep_s']:.3f}")
    ratio = a["tokens_per_s"] / d["tokens_per_s"]
    t.add_row("throughput (tokens/s)", f"{a['tokens_per_s']:,.0f}", f"{d['tokens_per_s']:,.0f}",
              f"[{'green' if ratio >= target else 'red'}]{ratio:.3f}[/]")
    for r in sorted(a["peak_bytes"]):
        t.add_row(f"peak live tensors, rank {r} (MiB)", f"{a['peak_bytes'][r] / MIB:.1f}",
                  f"{d['peak_bytes'][r] / MIB:.1f}", f"{a['peak_bytes'][r] / d['peak_bytes'][r]:.3f}")
        t.add_row(f"  of which alive at start, rank {r} (MiB)", f"{a['start_bytes'][r] / MIB:.1f}",
                  f"{d['start_bytes'][r] / MIB:.1f}", "")
        t.add_row(f"process max RSS, rank {r} (MiB)", f"{a['rss_bytes'][r] / MIB:.0f}",
                  f"{d['rss_bytes'][r] / MIB:.0f}", f"{a['rss_bytes'][r] / d['rss_bytes'][r]:.3f}")
    t.add_row("loss: first step -> last step (last rep)", f"{a['first_loss']:.4f} -> {a['last_loss']:.4f}",
              f"{d['first_loss']:.4f} -> {d['last_loss']:.4f}", "")
    con.print(t)
    return ratio


def first_losses(results: dict[str, list]) -> dict[str, list[float]]:
    """Per side, the first step's loss (mean over ranks) of every repetition."""
    return {side: [statistics.fmean(res[r]["losses"][0] for r in res) for res in reps]
            for side, reps in results.items()}


def print_loss_check(con, results: dict[str, list], tol: float = 1e-4) -> bool:
    fl = first_losses(results)
    names = list(fl)
    a, d = fl[names[0]][0], fl[names[1]][0]
    ok = abs(a - d) <= tol * max(1.0, abs(d))
    same = all(abs(x - fl[n][0]) <= 1e-6 for n in names for x in fl[n])
    con.print(f"first-step loss (mean over ranks): {names[0]} {a:.6f}, {names[1]} {d:.6f}, |diff| {abs(a - d):.2e} "
              f"-> [bold]{'AGREE' if ok else 'DIFFER'}[/] (tolerance {tol:g} relative); "
              f"{'identical' if same else 'NOT identical'} across repetitions")
    return ok


def compile_and_save(plan_text: str, world: int, batch_size: int, seq_len: int, seed: int,
                     out_dir: Path, bucket_bytes: int, mesh: str | None = None, comm: str = "gloo") -> float:
    """Build the model with ``seed``, compile ``plan_text`` for ``world`` ranks (on ``mesh``, e.g.
    ``"dp=2,tp=2"``, for a multi-axis plan; collectives on ``comm``: gloo or shm, every rank on this host), save;
    returns seconds."""
    from adaptdist.annotations import ManualPlan
    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.models import gpt
    from adaptdist.program import save_programs

    torch.manual_seed(seed)
    model, example, loss_fn = gpt.factory(batch_size, seq_len)
    t0 = time.perf_counter()
    programs = compile_model(model, example, loss_fn, world, ManualPlan.parse(plan_text, gpt),
                               options=LoweringOptions(grad_bucket_bytes=bucket_bytes, comm=comm,
                                                       hosts=("localhost",) * world), mesh=mesh)
    save_programs(programs, out_dir)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- workers (one per rank)

def build_fsdp2(cfg: dict, rank: int, world: int):
    """torch FSDP2's step (:func:`fsdp2_worker`): ``(step, model, opt)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from adaptdist.models.gpt import factory
    from adaptdist.runtime.worker import make_optimizer

    torch.manual_seed(cfg["seed"])
    model, _, loss_fn = factory(cfg["batch_size"], cfg["seq_len"])
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer("adamw", list(model.parameters()), cfg["lr"])

    from interleave import chunked_step

    return chunked_step(model, opt, loss_fn, rank, world), model, opt


def fsdp2_step(cfg: dict, rank: int, world: int):
    """The FSDP2 side's step (an ``interleave`` builder)."""
    return build_fsdp2(cfg, rank, world)[0]


def fsdp2_worker(cfg: dict) -> dict:
    """One rank of torch FSDP2: same model and seed, fully_shard per block then root, rank's torch.chunk."""
    rank, world = _setup(cfg)
    try:
        dtensor_aware_peak_memory()
        step, model, opt = build_fsdp2(cfg, rank, world)
        batch = _load_batch(cfg)
        return measure_torch_side(step, batch, cfg, model.parameters(), model, opt)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- parent

def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (gloo, CPU)")
    add_common_args(ap, steps=20, batch_help="global batch size", bucket_help="adaptdist's gradient bucket size, MiB")
    ap.add_argument("--memory-worlds", default="1,2,4",
                    help="world sizes of the fsdp-vs-dp memory table (comma-separated; empty: skip it)")
    return ap.parse_args(argv)


def memory_scaling(con, args, tmp: Path, batch_file: str, worlds: list[int]) -> None:
    """adaptdist's peak memory per rank, plan fsdp vs dp, at each world size: one launch of 2 steps each."""
    from rich.table import Table

    from adaptdist.runtime.launch import launch_local

    rows = {}
    t_all = time.perf_counter()
    load_before = os.getloadavg()
    for plan in ("fsdp", "dp"):
        for w in worlds:
            d = tmp / f"mem-{plan}-{w}"
            compile_and_save(plan, w, args.batch_size, args.seq_len, args.seed, d, int(args.bucket_mb * MIB))
            cfg = {"program_dir": str(d), "batch_file": batch_file, "lr": args.lr, "seed": args.seed,
                   "threads": args.threads_per_rank, "timeout_s": args.timeout_s, "steps": 0, "warmup": 1}
            res = launch_local(adaptdist_worker, (cfg,), w)
            rows[plan, w] = res
    con.print(f"memory launches: {time.perf_counter() - t_all:.0f} s; load average before "
              f"{'/'.join(f'{x:.2f}' for x in load_before)}, after {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    t = Table(title="adaptdist peak live tensors per rank (MiB; max over ranks), plan fsdp vs dp, "
                    f"global batch {args.batch_size}x{args.seq_len}")
    t.add_column("world size", justify="right")
    for plan in ("fsdp", "dp"):
        t.add_column(f"{plan}: peak", justify="right")
        t.add_column(f"{plan}: at start", justify="right")
        t.add_column(f"{plan}: RSS", justify="right")
    t.add_column("fsdp / dp peak", justify="right")
    for w in worlds:
        cells, peaks = [str(w)], {}
        for plan in ("fsdp", "dp"):
            res = rows[plan, w]
            peaks[plan] = max(res[r]["peak_bytes"] for r in res)
            cells += [f"{peaks[plan] / MIB:.1f}", f"{max(res[r]['start_bytes'] for r in res) / MIB:.1f}",
                      f"{max(res[r]['rss_peak_bytes'] for r in res) / MIB:.0f}"]
        cells.append(f"{peaks['fsdp'] / peaks['dp']:.3f}")
        t.add_row(*cells)
    con.print(t)
    f = [max(rows["fsdp", w][r]["peak_bytes"] for r in rows["fsdp", w]) for w in worlds]
    falls = all(b < a for a, b in zip(f, f[1:]))
    con.print(f"fsdp plan peak per rank {'falls' if falls else 'does NOT fall'} monotonically with the world size "
              f"({' -> '.join(f'{x / MIB:.1f}' for x in f)} MiB at {' -> '.join(map(str, worlds))} ranks); "
              "the batch is split too, so activations shrink as well as parameter/optimizer state.")


def main(argv=None) -> int:
    from bench_dp import example_batch, prelude

    args = _parse(argv)
    con, tokens = prelude(args)

    with tempfile.TemporaryDirectory(prefix="bench_fsdp-") as tmp:
        model, example, _, n_params, batch_file = example_batch(args, tmp)
        from bench_dp import adaptdist_sides, compile_comms, sides_table

        t0 = time.perf_counter()
        program_dirs = compile_comms(args.comm, lambda c: str(Path(tmp) / f"programs_{c}") if compile_and_save(
            "fsdp", args.nproc, args.batch_size, args.seq_len, args.seed, Path(tmp) / f"programs_{c}",
            int(args.bucket_mb * MIB), comm=c) is not None else "")
        con.print(f"{n_params / 1e6:.2f} M parameters; compiled adaptdist plan 'fsdp' for {args.nproc} ranks "
                  f"({', '.join(program_dirs)}) in {time.perf_counter() - t0:.1f} s (not part of the timings)")
        cfg = {"program_dirs": program_dirs, "batch_file": batch_file, "lr": args.lr,
               "seed": args.seed, "threads": args.threads_per_rank, "timeout_s": args.timeout_s,
               "steps": args.steps, "warmup": args.warmup, "batch_size": args.batch_size, "seq_len": args.seq_len}
        import bench_dp
        import bench_fsdp  # this file as an importable module, so spawn can unpickle the workers

        if args.interleave:
            from interleave import adaptdist_builders, report, run_interleaved

            results, load_before, load_after, wall = run_interleaved(
                con, {**adaptdist_builders(program_dirs), "FSDP2": "bench_fsdp:fsdp2_step"}, cfg, args.nproc, args.reps)
            print_load(con, load_before, load_after, wall, args)
            report(con, results, args, tokens, "FSDP2", _summarize, sides_table)
            if args.json:
                write_json(args.json, args, load_before, load_after, results)
            return 0
        sides = {**adaptdist_sides(program_dirs), "FSDP2": bench_fsdp.fsdp2_worker}
        results, load_before, load_after, wall = run_alternating(con, sides, cfg, args)
        print_load(con, load_before, load_after, wall, args)
        if args.json:
            write_json(args.json, args, load_before, load_after, results)

        summaries = {side: _summarize(res, args.warmup, tokens) for side, res in results.items()}
        sides_table(con, f"all sides (load average before/after: {load_before[0]:.1f}/{load_after[0]:.1f})",
                    summaries, "FSDP2")
        a, d = summaries[next(iter(summaries))], summaries["FSDP2"]
        ratio = comparison_table(con, f"adaptdist fsdp plan vs torch FSDP2 — {args.nproc} ranks x "
                                      f"{args.threads_per_rank} thread(s), global batch {args.batch_size}x{args.seq_len}",
                                 "FSDP2", a, d)
        con.print(f"measured steps per side: {a['n_steps']} (per step: slowest rank); memory from one extra step "
                  f"of the last rep inside PeakMemory (FSDP2: DTensors counted by their local shard); "
                  f"RSS = the rank process's lifetime max.")
        print_loss_check(con, results)
        con.print(f"target adaptdist >= 0.9x FSDP2 throughput: [bold]{'MET' if ratio >= 0.9 else 'NOT MET'}[/] "
                  f"({ratio:.3f}x on the all-steps median; {d['min_rep_s'] / a['min_rep_s']:.3f}x on the fastest "
                  f"per-rep medians)")

        worlds = [int(w) for w in args.memory_worlds.split(",") if w.strip()]
        if worlds:
            memory_scaling(con, args, Path(tmp), batch_file, worlds)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import bench_fsdp

    sys.exit(bench_fsdp.main())
