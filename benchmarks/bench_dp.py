"""adaptdist data parallelism vs torch DistributedDataParallel, measured in one run.

Same model (built-in GPT, default GPTConfig), same global batch, same number of
ranks (gloo on CPU), same threads per rank, same optimizer (AdamW, lr 1e-3,
weight_decay 0, i.e. adaptdist's ``make_optimizer("adamw")``), same data (the
factory's example batch, repeated); each rank takes its ``torch.chunk`` of the
global batch on both sides.

Each repetition launches adaptdist and DDP as separate ``launch_local`` jobs
(fresh processes each); the order alternates between repetitions (A,B then B,A)
so neither side always runs first. Warm-up steps are excluded. Per step, the
time is the slowest rank's. Reported: the median step time over all measured
steps of all repetitions, the spread (min/max of per-repetition medians), tokens/s
and their ratio, and peak memory per rank with ``adaptdist.runtime.memory.PeakMemory``
(one extra step inside the dispatch mode, after the timed steps, not timed) with
the process's max RSS beside it.

    .venv/bin/python benchmarks/bench_dp.py [--nproc 2] [--batch-size 16] [--seq-len 128]
        [--steps 30] [--warmup 3] [--reps 4] [--threads-per-rank 1] [--timeout-s 120] [--comm gloo|shm|both]

``--comm both`` runs adaptdist twice, its collectives on gloo and on the shared-memory kernels
(``LoweringOptions.comm``), beside DDP, and a ``no-comm`` side (each rank's DDP step on its rows without DDP:
the compute alone), so that DDP's exposed communication (DDP - no-comm) is measured too.

``--interleave`` runs every side in the same processes instead, one step of each in turn (``interleave.py``): on
a machine whose load changes between launches, its per-round speedups are the figures to quote.

The workers live in this module; the ``__main__`` block re-imports this file as
the module ``bench_dp`` (its directory is put on ``sys.path`` and ``PYTHONPATH``)
so that the spawned ranks can unpickle them by name.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- workers (one per rank)

def _setup(cfg: dict) -> tuple[int, int]:
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["timeout_s"]))
    return dist.get_rank(), dist.get_world_size()


def _load_batch(cfg: dict) -> tuple[torch.Tensor, ...]:
    from safetensors.torch import load_file

    t = load_file(cfg["batch_file"])
    return tuple(t[f"b{i}"] for i in range(len(t)))


def _time_steps(step, batch, n: int) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        loss = step(batch)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    return times, losses


def adaptdist_worker(cfg: dict) -> dict:
    """One rank of adaptdist DP: load_program + register groups + StepRunner (as run_worker does)."""
    from adaptdist.program import load_program
    from adaptdist.runtime.memory import PeakMemory
    from adaptdist.runtime.worker import StepRunner, register_mesh_groups

    rank, world = _setup(cfg)
    try:
        program = load_program(cfg["program_dir"], rank, world_size=world)
        register_mesh_groups(program, "gloo")
        runner = StepRunner(program, "adamw", cfg["lr"])
        batch = _load_batch(cfg)
        times, losses = _time_steps(runner.step, batch, cfg["warmup"] + cfg["steps"])
        dist.barrier()
        with PeakMemory([runner.state, runner.opt.state_dict()["state"], batch]) as pm:
            runner.step(batch)
        dist.barrier()
        return {"times": times, "losses": losses, "peak_bytes": pm.report.peak_bytes,
                "start_bytes": pm.report.start_bytes, "rss_peak_bytes": pm.report.rss_peak_bytes}
    finally:
        dist.destroy_process_group()


def adaptdist_gloo_worker(cfg: dict) -> dict:
    """adaptdist_worker on the programs lowered with ``--comm gloo``."""
    return adaptdist_worker(dict(cfg, program_dir=cfg["program_dirs"]["gloo"]))


def adaptdist_shm_worker(cfg: dict) -> dict:
    """adaptdist_worker on the programs lowered with ``--comm shm`` (the shared-memory kernels)."""
    return adaptdist_worker(dict(cfg, program_dir=cfg["program_dirs"]["shm"]))


def build_no_comm(cfg: dict, rank: int, world: int):
    """DDP's per-rank work without DDP (:func:`no_comm_worker`): ``(step, model, opt)``."""
    from adaptdist.models.gpt import factory
    from adaptdist.runtime.worker import make_optimizer

    torch.manual_seed(cfg["seed"])
    model, _, loss_fn = factory(cfg["batch_size"], cfg["seq_len"])
    opt = make_optimizer("adamw", list(model.parameters()), cfg["lr"])

    from interleave import chunked_step

    return chunked_step(model, opt, loss_fn, rank, world), model, opt


def no_comm_step(cfg: dict, rank: int, world: int):
    """The no-comm side's step (an ``interleave`` builder)."""
    return build_no_comm(cfg, rank, world)[0]


def no_comm_worker(cfg: dict) -> dict:
    """DDP's per-rank work without DDP: each rank's forward, backward and AdamW on its rows, no collectives (what
    DDP's step would cost with free communication)."""
    rank, world = _setup(cfg)
    try:
        step, model, opt = build_no_comm(cfg, rank, world)
        batch = _load_batch(cfg)
        return measure_torch_side(step, batch, cfg, model.parameters(), model, opt)
    finally:
        dist.destroy_process_group()


def sides_table(con, title: str, summaries: dict, torch_side: str) -> None:
    """One row per side (``summaries``: name -> :func:`_summarize`): median and fastest per-rep median step time,
    tokens/s, and throughput ratios to ``torch_side`` and (for adaptdist sides) shm / gloo."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("side", "median step (ms)", "fastest rep median (ms)", "tokens/s", f"x {torch_side}"):
        t.add_column(col, justify="right")
    ref = summaries[torch_side]["tokens_per_s"]
    for name, a in summaries.items():
        t.add_row(name, f"{1e3 * a['median_s']:.1f}", f"{1e3 * a['min_rep_s']:.1f}", f"{a['tokens_per_s']:,.0f}",
                  f"{a['tokens_per_s'] / ref:.3f}")
    con.print(t)
    if "adaptdist/shm" in summaries and "adaptdist/gloo" in summaries:
        s, g = summaries["adaptdist/shm"], summaries["adaptdist/gloo"]
        con.print(f"adaptdist shm / gloo throughput: {s['tokens_per_s'] / g['tokens_per_s']:.3f}x (all-steps median), "
                  f"{g['min_rep_s'] / s['min_rep_s']:.3f}x (fastest per-rep medians)")


def compile_comms(comm: str, compile_one) -> dict[str, str]:
    """``compile_one(comm) -> program dir`` for each transport ``--comm`` asks for (``both``: shm and gloo)."""
    comms = ("shm", "gloo") if comm == "both" else (comm,)
    return {c: compile_one(c) for c in comms}


def adaptdist_sides(program_dirs: dict[str, str]) -> dict:
    """The adaptdist side(s) of a benchmark: ``adaptdist`` (one transport) or ``adaptdist/shm`` and ``adaptdist/gloo``."""
    import bench_dp

    if len(program_dirs) == 1:
        return {"adaptdist": bench_dp.adaptdist_shm_worker if "shm" in program_dirs else bench_dp.adaptdist_gloo_worker}
    return {"adaptdist/shm": bench_dp.adaptdist_shm_worker, "adaptdist/gloo": bench_dp.adaptdist_gloo_worker}


def build_ddp(cfg: dict, rank: int, world: int):
    """torch DDP's step (:func:`ddp_worker`): ``(step, model, opt)``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from adaptdist.models.gpt import factory
    from adaptdist.runtime.worker import make_optimizer

    torch.manual_seed(cfg["seed"])
    model, _, loss_fn = factory(cfg["batch_size"], cfg["seq_len"])
    ddp = DDP(model, bucket_cap_mb=cfg["bucket_mb"])
    opt = make_optimizer("adamw", list(ddp.parameters()), cfg["lr"])

    from interleave import chunked_step

    return chunked_step(ddp, opt, loss_fn, rank, world), model, opt


def ddp_step(cfg: dict, rank: int, world: int):
    """The DDP side's step (an ``interleave`` builder)."""
    return build_ddp(cfg, rank, world)[0]


def ddp_worker(cfg: dict) -> dict:
    """One rank of torch DDP: same model and seed, standard loop on this rank's torch.chunk of the batch."""
    rank, world = _setup(cfg)
    try:
        step, model, opt = build_ddp(cfg, rank, world)
        batch = _load_batch(cfg)
        return measure_torch_side(step, batch, cfg, model.parameters(), model, opt)
    finally:
        dist.destroy_process_group()


def measure_torch_side(step, batch, cfg: dict, params, model, opt) -> dict:
    """Time ``cfg["warmup"] + cfg["steps"]`` calls of ``step(batch)`` (seconds per step, losses), then one
    more under :class:`PeakMemory`. ``opt.zero_grad`` first, so the tensors alive at the start are exactly
    ``params``, ``model``'s buffers, the optimizer state and the batch (a wrapper's own buffers are counted
    when first written). Returns times, losses and peak/start/RSS-peak bytes."""
    from adaptdist.runtime.memory import PeakMemory

    times, losses = _time_steps(step, batch, cfg["warmup"] + cfg["steps"])
    dist.barrier()
    opt.zero_grad(set_to_none=True)
    existing = [list(params), list(model.buffers()), opt.state_dict()["state"], batch]
    with PeakMemory(existing) as pm:
        step(batch)
    dist.barrier()
    return {"times": times, "losses": losses, "peak_bytes": pm.report.peak_bytes,
            "start_bytes": pm.report.start_bytes, "rss_peak_bytes": pm.report.rss_peak_bytes}


def add_common_args(ap: argparse.ArgumentParser, *, steps: int, batch_help: str, bucket_help: str) -> None:
    """The options every side-by-side benchmark shares (batch, timing, optimizer, seed, timeout, json)."""
    ap.add_argument("--batch-size", type=int, default=16, help=batch_help)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=steps, help="measured steps per side per repetition")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per launch, excluded")
    ap.add_argument("--reps", type=int, default=4, help="repetitions (each: one launch per side)")
    ap.add_argument("--threads-per-rank", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help=bucket_help)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="collective timeout (init_process_group)")
    ap.add_argument("--json", default=None, help="also write the raw per-rank, per-step times here")
    ap.add_argument("--comm", choices=("gloo", "shm", "both"), default="both",
                    help="adaptdist's transport: gloo, the shared-memory kernels, or both side by side")
    ap.add_argument("--interleave", action="store_true",
                    help="run every side in the same processes, one step of each in turn (benchmarks/interleave.py: "
                         "robust to a changing load; reports per-round speedups; no memory figures)")


# --------------------------------------------------------------------------- parent

def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (gloo, CPU)")
    add_common_args(ap, steps=30, batch_help="global batch size",
                    bucket_help="gradient bucket size, MiB, for both sides (DDP's bucket_cap_mb; its default is 25)")
    return ap.parse_args(argv)


def _summarize(results_per_rep: list[dict[int, dict]], warmup: int, tokens: int) -> dict:
    """Per-step time = max over ranks; median over all measured steps; spread of per-rep medians."""
    all_steps, rep_medians, first_losses, last_losses = [], [], [], []
    for res in results_per_rep:
        ranks = sorted(res)
        per_step = [max(res[r]["times"][i] for r in ranks) for i in range(len(res[ranks[0]]["times"]))]
        measured = per_step[warmup:]
        all_steps += measured
        rep_medians.append(statistics.median(measured))
        mean_loss = [statistics.fmean(res[r]["losses"][i] for r in ranks) for i in range(len(per_step))]
        first_losses.append(mean_loss[0])
        last_losses.append(mean_loss[-1])
    last = results_per_rep[-1]
    med = statistics.median(all_steps)
    return {
        "median_s": med, "min_rep_s": min(rep_medians), "max_rep_s": max(rep_medians),
        "tokens_per_s": tokens / med, "n_steps": len(all_steps),
        "first_loss": first_losses[-1], "last_loss": last_losses[-1],
        "peak_bytes": {r: last[r].get("peak_bytes") for r in sorted(last)},  # None: not measured (--interleave)
        "start_bytes": {r: last[r].get("start_bytes") for r in sorted(last)},
        "rss_bytes": {r: last[r].get("rss_peak_bytes") for r in sorted(last)},
    }


def _write_json(args, load_before, load_after, results: dict[str, list]) -> None:
    import json

    raw = {side: [{r: {"times": res[r]["times"], "losses": res[r]["losses"]} for r in res} for res in reps]
           for side, reps in results.items()}
    Path(args.json).write_text(json.dumps({"args": vars(args), "load_before": load_before,
                                           "load_after": load_after, "raw": raw}))


def prelude(args, batch_note: str = ""):
    """Shared start of every benchmark: console, worker environment, the run's header line.

    Returns ``(console, tokens per step)``. Workers find this directory through PYTHONPATH.
    """
    from rich.console import Console

    con = Console(width=130)
    os.environ["OMP_NUM_THREADS"] = str(args.threads_per_rank)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    tokens = args.batch_size * args.seq_len
    con.print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; {args.nproc} ranks (gloo), "
              f"[bold]{args.threads_per_rank} thread(s) per rank[/]; GPT (default GPTConfig), global batch "
              f"{args.batch_size} x {args.seq_len} = {tokens} tokens{batch_note}; AdamW lr {args.lr}; "
              f"{args.reps} reps x ({args.warmup} warm-up + {args.steps} measured) steps per side")
    return con, tokens


def example_batch(args, tmp: str):
    """The built-in GPT and its example batch (seeded), the batch saved for the workers.

    Returns ``(model, example, loss_fn, number of parameters, batch file path)``.
    """
    from safetensors.torch import save_file

    from adaptdist.models.gpt import factory

    torch.manual_seed(args.seed)
    model, example, loss_fn = factory(args.batch_size, args.seq_len)
    batch_file = str(Path(tmp) / "batch.safetensors")
    save_file({f"b{i}": t.contiguous() for i, t in enumerate(example)}, batch_file)
    return model, example, loss_fn, sum(p.numel() for p in model.parameters()), batch_file


def main(argv=None) -> int:
    from rich.table import Table

    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.program import save_programs
    from adaptdist.runtime.launch import launch_local

    args = _parse(argv)
    con, tokens = prelude(args)

    with tempfile.TemporaryDirectory(prefix="bench_dp-") as tmp:
        model, example, loss_fn, n_params, batch_file = example_batch(args, tmp)
        t0 = time.perf_counter()

        def compile_one(comm: str) -> str:
            opts = LoweringOptions(grad_bucket_bytes=int(args.bucket_mb * 2**20), comm=comm,
                                   hosts=("localhost",) * args.nproc)
            d = Path(tmp) / f"programs_{comm}"
            save_programs(compile_model(model, example, loss_fn, args.nproc, options=opts), d)
            return str(d)

        program_dirs = compile_comms(args.comm, compile_one)
        con.print(f"{n_params / 1e6:.2f} M parameters; compiled adaptdist DP for {args.nproc} ranks "
                  f"({', '.join(program_dirs)}) in {time.perf_counter() - t0:.1f} s (not part of the timings)")
        cfg = {"program_dirs": program_dirs, "batch_file": batch_file, "lr": args.lr,
               "seed": args.seed, "threads": args.threads_per_rank, "timeout_s": args.timeout_s,
               "bucket_mb": args.bucket_mb,
               "steps": args.steps, "warmup": args.warmup, "batch_size": args.batch_size, "seq_len": args.seq_len}
        import bench_dp  # this file as an importable module, so spawn can unpickle the workers

        if args.interleave:
            from interleave import adaptdist_builders, report, run_interleaved

            builders = {**adaptdist_builders(program_dirs), "DDP": "bench_dp:ddp_step",
                        "no-comm": "bench_dp:no_comm_step"}
            results, load_before, load_after, wall = run_interleaved(con, builders, cfg, args.nproc, args.reps)
            con.print(f"all launches: {wall:.0f} s; load average (1/5/15 min) before "
                      f"{'/'.join(f'{x:.2f}' for x in load_before)}, after {'/'.join(f'{x:.2f}' for x in load_after)}")
            report(con, results, args, tokens, "DDP", _summarize, sides_table)
            if args.json:
                _write_json(args, load_before, load_after, results)
            return 0
        sides = {**adaptdist_sides(program_dirs), "DDP": bench_dp.ddp_worker, "no-comm": bench_dp.no_comm_worker}
        results: dict[str, list] = {side: [] for side in sides}
        t_all = time.perf_counter()
        load_before = os.getloadavg()
        names = list(sides)
        for rep in range(args.reps):
            order = names if rep % 2 == 0 else names[::-1]
            for side in order:
                t0 = time.perf_counter()
                res = launch_local(sides[side], (cfg,), args.nproc)
                times = sorted(max(res[r]["times"][i] for r in res) for i in range(args.warmup, args.warmup + args.steps))
                con.print(f"rep {rep + 1}/{args.reps} {side:14s}: median step {1e3 * statistics.median(times):7.1f} ms "
                          f"(launch total {time.perf_counter() - t0:.1f} s)")
                results[side].append(res)
        load_after = os.getloadavg()
        con.print(f"all launches: {time.perf_counter() - t_all:.0f} s; load average (1/5/15 min) before "
                  f"{'/'.join(f'{x:.2f}' for x in load_before)}, after {'/'.join(f'{x:.2f}' for x in load_after)} "
                  f"(this benchmark itself keeps ~{args.nproc * args.threads_per_rank} cores busy; more means other "
                  f"work on the machine)")
        if args.json:
            _write_json(args, load_before, load_after, results)

    summaries = {side: _summarize(res, args.warmup, tokens) for side, res in results.items()}
    sides_table(con, f"all sides — {args.nproc} ranks x {args.threads_per_rank} thread(s), global batch "
                     f"{args.batch_size}x{args.seq_len} (load average before/after: {load_before[0]:.1f}/"
                     f"{load_after[0]:.1f})", summaries, "DDP")
    d, free = summaries["DDP"], summaries["no-comm"]
    con.print(f"DDP's exposed communication: {1e3 * (d['median_s'] - free['median_s']):.1f} ms of its "
              f"{1e3 * d['median_s']:.1f} ms step ({(d['median_s'] - free['median_s']) / d['median_s']:.0%}; "
              f"fastest reps: {(d['min_rep_s'] - free['min_rep_s']) / d['min_rep_s']:.0%})")
    a = summaries["adaptdist/shm" if "adaptdist/shm" in summaries else next(iter(summaries))]
    mib = 2**20
    t = Table(title=f"adaptdist DP vs torch DDP — {args.nproc} ranks x {args.threads_per_rank} thread(s), "
                    f"global batch {args.batch_size}x{args.seq_len}")
    t.add_column("metric")
    t.add_column("adaptdist", justify="right")
    t.add_column("DDP", justify="right")
    t.add_column("adaptdist / DDP", justify="right")
    t.add_row("median step time (ms)", f"{1e3 * a['median_s']:.1f}", f"{1e3 * d['median_s']:.1f}",
              f"{a['median_s'] / d['median_s']:.3f}")
    t.add_row("spread: per-rep medians min-max (ms)", f"{1e3 * a['min_rep_s']:.1f}-{1e3 * a['max_rep_s']:.1f}",
              f"{1e3 * d['min_rep_s']:.1f}-{1e3 * d['max_rep_s']:.1f}", "")
    t.add_row("fastest per-rep median (ms; least disturbed by other load)", f"{1e3 * a['min_rep_s']:.1f}",
              f"{1e3 * d['min_rep_s']:.1f}", f"{a['min_rep_s'] / d['min_rep_s']:.3f}")
    ratio = a["tokens_per_s"] / d["tokens_per_s"]
    t.add_row("throughput (tokens/s)", f"{a['tokens_per_s']:,.0f}", f"{d['tokens_per_s']:,.0f}",
              f"[{'green' if ratio >= 0.9 else 'red'}]{ratio:.3f}[/]")
    for r in sorted(a["peak_bytes"]):
        t.add_row(f"peak live tensors, rank {r} (MiB)", f"{a['peak_bytes'][r] / mib:.1f}",
                  f"{d['peak_bytes'][r] / mib:.1f}", f"{a['peak_bytes'][r] / d['peak_bytes'][r]:.3f}")
        t.add_row(f"  of which alive at start, rank {r} (MiB)", f"{a['start_bytes'][r] / mib:.1f}",
                  f"{d['start_bytes'][r] / mib:.1f}", "")
        t.add_row(f"process max RSS, rank {r} (MiB)", f"{a['rss_bytes'][r] / mib:.0f}",
                  f"{d['rss_bytes'][r] / mib:.0f}", f"{a['rss_bytes'][r] / d['rss_bytes'][r]:.3f}")
    t.add_row("loss: first step -> last step (last rep)", f"{a['first_loss']:.4f} -> {a['last_loss']:.4f}",
              f"{d['first_loss']:.4f} -> {d['last_loss']:.4f}", "")
    con.print(t)
    con.print(f"measured steps per side: {a['n_steps']} (per step: slowest rank); memory from one extra step "
              f"of the last rep inside PeakMemory; RSS = the rank process's lifetime max.")
    con.print(f"target adaptdist >= 0.9x DDP throughput: [bold]{'MET' if ratio >= 0.9 else 'NOT MET'}[/] ({ratio:.3f}x "
              f"on the all-steps median; {d['min_rep_s'] / a['min_rep_s']:.3f}x on the fastest per-rep medians)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import bench_dp

    sys.exit(bench_dp.main())
