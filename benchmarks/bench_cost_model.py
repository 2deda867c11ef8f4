"""Accuracy of adaptdist's cost model: predicted vs measured step time and peak memory, plan by plan.

For several plans of the built-in GPT (``adaptdist.models.gpt``; GPTConfig with 4 heads instead of 6, so that
tp splits them over 4 ranks) on 2 and 4 local ranks (gloo, CPU, torch threads per rank = usable cores //
ranks, at least 1), this prints

- predicted (``adaptdist.cost_models.estimate_programs`` on the compiled rank programs, with a
  cluster calibrated by ``adaptdist cluster profile`` -- run here right before each world size's
  measurement, unless ``--cluster FILE`` gives one) step time with its compute / communication / idle
  terms, and peak memory per rank; beside it the prediction of the roofline-only model
  (:class:`RooflineOnlyCluster`: the same cluster costed as before the cost model's CPU rules);
- measured: the same programs run by ``adaptdist.runtime.worker.StepRunner`` (AdamW lr 1e-3, the
  factory's example batch repeated), step time = slowest rank per step; median over all measured steps
  and the spread of per-round medians; peak memory per rank with
  ``adaptdist.runtime.memory.PeakMemory`` over one extra untimed step (parameters, optimizer state and
  batch alive at the start), the metric the cost model predicts;
- per plan the relative error; over plans the median absolute relative error (step time and memory)
  and Spearman's rank correlation of predicted vs measured step time over the plans whose measured
  times differ by more than 10% (see :func:`separated_subset`), with the Spearman over all plans and
  the fraction of plan pairs >10% apart that the model orders correctly beside it;
- a breakdown of each plan's measured step: optimizer step and program (timed apart, unprofiled), and
  the program's exposed communication (self CPU time of its ``_c10d_functional`` ops -- issue and
  ``wait_tensor`` -- under ``torch.profiler`` over a few steps), the rest being compute, beside the
  predicted terms, so that the error can be traced to compute, communication or idle time.

All plans of one world size run in one launch (one process group; each plan's mesh groups are built
once and re-registered under the names its collectives use when it runs). The plans alternate: round
``r`` runs them in order, round ``r + 1`` in reverse order, ``--steps`` measured steps per plan per
round after ``--warmup`` untimed steps per plan at the start, so slow drifts and bursts of outside load
fall on every plan alike and show up as spread.

Before anything is measured, and again before each further world size, the benchmark waits (up to
``--wait-s``) until the 1-minute load average falls below ``--max-load`` (other people's jobs share
this machine); it samples /proc/loadavg every
second during calibration and the timed launches and prints those figures (the benchmark's own ranks
account for about ``ranks x threads`` of it). The 1-minute average lags by a minute, so it also counts,
twice a second, other people's runnable tasks (/proc/*/stat, state R, outside this process tree) and
reports the run as DISTURBED when they averaged more than ``--max-outside`` in a calibration or
measurement phase.

    .venv/bin/python benchmarks/bench_cost_model.py [--worlds 2,4] [--batch-size 8] [--seq-len 64]
        [--rounds 4] [--steps 8] [--warmup 3] [--cluster FILE ...] [--max-load 1.5] [--wait-s 240]
        [--json FILE]

The workers live in this module; the ``__main__`` block re-imports this file as the module
``bench_cost_model`` (its directory on ``sys.path`` and ``PYTHONPATH``) so spawned ranks can unpickle them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

MIB = 2**20


@dataclass(frozen=True)
class PlanSpec:
    """One benchmarked plan: ``name`` (printed), ``plan`` (ManualPlan preset), ranks, mesh, bucket bytes."""

    name: str
    plan: str
    world: int
    mesh: str | None
    bucket_mb: float


def default_plans(worlds: tuple[int, ...]) -> list[PlanSpec]:
    """DP with 25 MiB and 1 MiB gradient buckets, FSDP-like, TP on every world size; DP x TP on 4 ranks."""
    out = []
    for w in worlds:
        out += [PlanSpec(f"dp/{w} 25MiB", "dp", w, None, 25.0),
                PlanSpec(f"dp/{w} 1MiB", "dp", w, None, 1.0),
                PlanSpec(f"fsdp/{w}", "fsdp", w, None, 25.0),
                PlanSpec(f"tp/{w}", "tp", w, None, 25.0)]
        if w == 4:
            out.append(PlanSpec("dp2xtp2/4", "dp,tp", 4, "dp=2,tp=2", 25.0))
    return out


# --------------------------------------------------------------------------- worker (one per rank)

def _comm_self_s(prof) -> float:
    """Seconds of the profiled steps spent in ``_c10d_functional`` ops (issuing a collective, or
    ``wait_tensor``) on this rank's main thread."""
    total_us = 0.0
    for e in prof.events():
        if e.name.startswith("_c10d_functional::"):
            total_us += e.self_cpu_time_total
    return total_us * 1e-6


def plans_worker(cfg: dict) -> dict:
    """One rank: every plan of this world size, alternating rounds; returns per plan the step times,
    peak memory, and the breakdown (see the module docstring)."""
    from adaptdist import _torch_compat as compat
    from adaptdist.program import load_program
    from adaptdist.runtime.memory import PeakMemory
    from adaptdist.runtime.worker import StepRunner, register_mesh_groups
    from bench_dp import _load_batch

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["timeout_s"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        batch = _load_batch(cfg)
        names = [p["name"] for p in cfg["plans"]]
        runners, groups = {}, {}
        for p in cfg["plans"]:
            program = load_program(p["program_dir"], rank, world_size=world)
            mesh = register_mesh_groups(program, "gloo")
            groups[p["name"]] = {g: (mesh.get_group(axis) if len(program.mesh) > 1 else dist.group.WORLD)
                                 for axis, g in program.group_names.items()}
            runners[p["name"]] = StepRunner(program, "adamw", cfg["lr"])

        def activate(name: str) -> StepRunner:
            for g, pg in groups[name].items():
                compat.register_process_group(g, pg)
            dist.barrier()
            return runners[name]

        out = {n: {"rounds": [], "losses": []} for n in names}
        for n in names:
            r = activate(n)
            for _ in range(cfg["warmup"]):
                out[n]["losses"].append(r.step(batch))
        for rnd in range(cfg["rounds"]):
            for n in (names if rnd % 2 == 0 else names[::-1]):
                r = activate(n)
                times = []
                for _ in range(cfg["steps"]):
                    t0 = time.perf_counter()
                    out[n]["losses"].append(r.step(batch))
                    times.append(time.perf_counter() - t0)
                out[n]["rounds"].append(times)
        # breakdown: program vs optimizer timed apart (unprofiled), then exposed communication (profiled)
        for n in names:
            r = activate(n)
            prog_s, opt_s = [], []
            for _ in range(cfg["breakdown_steps"]):
                t0 = time.perf_counter()
                outs = r.program(*r.inputs, *r.program.local_batch(batch))
                t1 = time.perf_counter()
                for p, i in zip(r.params, r.grad_slots):
                    p.grad = outs[i]
                r.opt.step()
                for p in r.params:
                    p.grad = None
                t2 = time.perf_counter()
                prog_s.append(t1 - t0)
                opt_s.append(t2 - t1)
            dist.barrier()
            k = cfg["profile_steps"]
            saved_stderr, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)  # the profiler's start/stop lines (kineto) on every rank
            try:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    t0 = time.perf_counter()
                    for _ in range(k):
                        r.step(batch)
                    prof_step_s = (time.perf_counter() - t0) / k
            finally:
                os.dup2(saved_stderr, 2)
                os.close(saved_stderr)
                os.close(devnull)
            out[n]["program_s"] = statistics.median(prog_s)
            out[n]["optimizer_s"] = statistics.median(opt_s)
            out[n]["comm_exposed_s"] = _comm_self_s(prof) / k
            out[n]["profiled_step_s"] = prof_step_s
        for n in names:
            r = activate(n)
            with PeakMemory([r.state, r.opt.state_dict()["state"], batch]) as pm:
                r.step(batch)
            out[n]["peak_bytes"] = pm.report.peak_bytes
            out[n]["start_bytes"] = pm.report.start_bytes
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the model before the CPU rules

class RooflineOnlyCluster:
    """``cluster`` as the cost model saw a CPU cluster before it modelled CPU execution (commit 7d3380d):
    every device reported as a GPU (roofline max of arithmetic and memory time, collectives overlapped
    with computation on a second stream) and without a per-op overhead; same figures and links.
    Printed beside the current prediction to show what those rules change."""

    def __init__(self, cluster):
        self.cluster = cluster

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    def device(self, rank: int):
        import dataclasses

        return dataclasses.replace(self.cluster.device(rank), kind="cuda", cores=None, op_overhead_s=None)

    def link(self, a: int, b: int):
        return self.cluster.link(a, b)

    def collective_fit(self, collective: str, tier: str):
        return self.cluster.collective_fit(collective, tier)


# --------------------------------------------------------------------------- load average

def other_runnable_tasks(root_pid: int) -> int:
    """Processes in state R (running or runnable) on this machine that are not ``root_pid`` or its
    descendants: other people's work competing for the cores right now (from /proc/*/stat)."""
    parent, running = {}, []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                text = f.read()
        except OSError:
            continue
        rest = text[text.rfind(")") + 2:].split()
        pid = int(d)
        parent[pid] = int(rest[1])
        if rest[0] == "R":
            running.append(pid)

    def ours(pid: int) -> bool:
        seen = 0
        while pid > 1 and seen < 64:
            if pid == root_pid:
                return True
            pid, seen = parent.get(pid, 0), seen + 1
        return False

    return sum(1 for pid in running if not ours(pid))


class LoadSampler:
    """Samples, per phase, /proc/loadavg's 1-minute figure every ``interval_s`` seconds and the number of
    other people's runnable tasks (:func:`other_runnable_tasks`) every ``interval_s / 2`` in a thread."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.phase = "idle"
        self.samples: dict[str, list[float]] = {}
        self.others: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me, k = os.getpid(), 0
        while not self._stop.wait(self.interval_s / 2):
            self.others.setdefault(self.phase, []).append(other_runnable_tasks(me))
            k += 1
            if k % 2 == 0:
                self.samples.setdefault(self.phase, []).append(os.getloadavg()[0])

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def outside(self, phase: str) -> float:
        """Mean number of other people's runnable tasks during ``phase`` (0: the machine was ours)."""
        xs = self.others.get(phase, [])
        return statistics.fmean(xs) if xs else float("nan")

    def summary(self, phase: str) -> str:
        xs = self.samples.get(phase, [])
        if not xs:
            return "no samples"
        return (f"1-min load min {min(xs):.2f} / median {statistics.median(xs):.2f} / max {max(xs):.2f} "
                f"({len(xs)} samples); other people's runnable tasks {self.outside(phase):.2f} on average")


def wait_for_quiet(con, max_load: float, wait_s: float) -> tuple[float, float]:
    """Poll every 5 s until the 1-minute load average is below ``max_load`` and no other runnable task was
    seen in 10 samples over the last second (:func:`other_runnable_tasks`), or ``wait_s`` passed;
    returns (1-minute load when done, seconds waited)."""
    t0 = time.perf_counter()
    me = os.getpid()
    while True:
        load = os.getloadavg()[0]
        busy = 0
        for _ in range(10):
            busy += other_runnable_tasks(me) > 0
            time.sleep(0.1)
        if (load < max_load and busy == 0) or time.perf_counter() - t0 >= wait_s:
            return load, time.perf_counter() - t0
        con.print(f"  load {load:.2f} (limit {max_load}), other runnable tasks in {busy}/10 samples: waiting "
                  f"({time.perf_counter() - t0:.0f}/{wait_s:.0f} s)")
        time.sleep(4)


# --------------------------------------------------------------------------- statistics

def ranks_of(xs: list[float]) -> list[float]:
    """Ranks 1..n of ``xs`` (ties get their average rank)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (average ranks for ties)."""
    ra, rb = ranks_of(a), ranks_of(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va > 0 and vb > 0 else float("nan")


def separated_subset(measured: dict[str, float], rel: float = 0.10) -> list[str]:
    """Plans whose measured times are pairwise more than ``rel`` apart: from the fastest up, a plan is
    kept when its time exceeds the last kept one's by more than ``rel`` (so consecutive kept plans,
    hence all pairs of them, differ by more than ``rel``)."""
    kept: list[str] = []
    for n in sorted(measured, key=measured.get):
        if not kept or measured[n] > (1 + rel) * measured[kept[-1]]:
            kept.append(n)
    return kept


def concordance(pred: dict[str, float], meas: dict[str, float], rel: float = 0.10) -> tuple[int, int]:
    """Of the plan pairs whose measured times differ by more than ``rel``, how many the prediction
    orders the same way: (concordant, pairs)."""
    names = list(meas)
    good = total = 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            lo, hi = sorted((meas[a], meas[b]))
            if hi > (1 + rel) * lo:
                total += 1
                good += (pred[a] - pred[b]) * (meas[a] - meas[b]) > 0
    return good, total


# --------------------------------------------------------------------------- calibrate and measure (one world size)

def calibrate(con, sampler: LoadSampler, w: int, threads: int, cluster_out: str | None = None):
    """``adaptdist cluster profile --nproc w`` (:func:`adaptdist.calibrate.profile.profile_local`, CPU, ``threads``
    per rank) under the sampler phase ``calibrate/<w>``; prints its figures and returns the calibrated
    ``adaptdist.cluster.Cluster`` (also saved as ``cluster_out/cluster-<w>.yaml`` when given)."""
    from adaptdist.calibrate.profile import profile_local
    from adaptdist.cluster_file import save_cluster

    sampler.phase = f"calibrate/{w}"
    t0 = time.perf_counter()
    res = profile_local(w, "cpu", threads_per_rank=threads)
    d0 = res.cluster.device(0)
    ar = res.cluster.collective_fit("all_reduce", "intra_host")
    con.print(f"world {w}: `adaptdist cluster profile --nproc {w}` in {time.perf_counter() - t0:.1f} s: "
              f"matmul f32 {d0.peak_flops['float32'] / 1e9:.0f} GFLOP/s per rank, memory "
              f"{d0.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s per rank, op overhead "
              f"{(d0.op_overhead_s or 0) * 1e6:.1f} us, all_reduce alpha "
              f"{ar.alpha_s * 1e6:.0f} us, {ar.bandwidth_bytes_per_s / 1e9:.2f} GB/s; "
              f"{sampler.summary(sampler.phase)}")
    if cluster_out:
        Path(cluster_out).mkdir(parents=True, exist_ok=True)
        save_cluster(res.cluster, Path(cluster_out) / f"cluster-{w}.yaml",
                     "written by benchmarks/bench_cost_model.py (adaptdist cluster profile)")
    return res.cluster


def measure_plans(con, sampler: LoadSampler, w: int, plans, batch_file: str, threads: int, args) -> dict[str, dict]:
    """Run the saved rank programs of ``plans`` (``[(name, program_dir)]``, all for ``w`` ranks) in one launch of
    :func:`plans_worker` (alternating rounds; ``args`` gives lr, seed, timeout_s, rounds, steps, warmup,
    breakdown_steps, profile_steps) under the sampler phase ``measure/<w>``; returns per plan name the
    measurement: ``median_s`` (slowest rank per step, median over every measured step), ``round_medians_s``,
    peak and start bytes per rank, the breakdown of rank 0, and the mean first loss."""
    from adaptdist.runtime.launch import launch_local

    sampler.phase = f"measure/{w}"
    names = [n for n, _ in plans]
    cfg = {"plans": [{"name": n, "program_dir": str(d)} for n, d in plans],
           "batch_file": batch_file, "lr": args.lr, "seed": args.seed, "threads": threads,
           "timeout_s": args.timeout_s, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
           "breakdown_steps": args.breakdown_steps, "profile_steps": args.profile_steps}
    t0 = time.perf_counter()
    res = launch_local(plans_worker, (cfg,), w)
    meas = {}
    for n in names:
        per_round = []
        for k in range(args.rounds):
            per_round.append([max(res[r][n]["rounds"][k][i] for r in res) for i in range(args.steps)])
        all_steps = [t for rnd in per_round for t in rnd]
        meas[n] = {
            "median_s": statistics.median(all_steps),
            "round_medians_s": [statistics.median(x) for x in per_round],
            "peak_bytes": {r: res[r][n]["peak_bytes"] for r in sorted(res)},
            "start_bytes": {r: res[r][n]["start_bytes"] for r in sorted(res)},
            "program_s": res[0][n]["program_s"], "optimizer_s": res[0][n]["optimizer_s"],
            "comm_exposed_s": res[0][n]["comm_exposed_s"],
            "profiled_step_s": res[0][n]["profiled_step_s"],
            "first_loss": statistics.fmean(res[r][n]["losses"][0] for r in res),
        }
    con.print(f"world {w}: {len(names)} plans measured in {time.perf_counter() - t0:.1f} s (one launch); "
              f"{sampler.summary(sampler.phase)}")
    return meas


# --------------------------------------------------------------------------- parent

def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4", help="world sizes (comma-separated); plans per world size: "
                    "dp 25 MiB, dp 1 MiB, fsdp, tp, and dp=2,tp=2 on 4")
    ap.add_argument("--batch-size", type=int, default=8, help="global batch size")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4,
                    help="attention heads of the GPT (GPTConfig's other fields default): tp needs ranks | heads, "
                         "and the default 6 heads do not split over 4 ranks")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds over the plans")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per plan per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per plan before the first round")
    ap.add_argument("--breakdown-steps", type=int, default=5, help="steps timing program and optimizer apart")
    ap.add_argument("--profile-steps", type=int, default=3, help="profiled steps for the exposed communication")
    ap.add_argument("--threads-per-rank", type=int, default=None, help="default usable cores // ranks, at least 1")
    ap.add_argument("--cluster", action="append", default=[], metavar="FILE",
                    help="a calibrated cluster file to use for its world size instead of profiling (repeatable)")
    ap.add_argument("--cluster-out", default=None, metavar="DIR",
                    help="also save the clusters profiled here as DIR/cluster-<world>.yaml")
    ap.add_argument("--max-load", type=float, default=1.5, help="wait until the 1-minute load is below this")
    ap.add_argument("--wait-s", type=float, default=240.0, help="longest wait for --max-load, seconds")
    ap.add_argument("--max-outside", type=float, default=0.25,
                    help="mean number of other people's runnable tasks during calibration or measurement above "
                         "which the run is reported as disturbed")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--json", default=None, help="write predictions, measurements and errors here")
    return ap.parse_args(argv)


def _ms(s: float) -> str:
    return f"{1e3 * s:.1f}"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def main(argv=None) -> int:
    from rich.console import Console
    from rich.table import Table

    from adaptdist.annotations import ManualPlan
    from adaptdist.calibrate.hardware import usable_cores
    from adaptdist.calibrate.local import load_cluster
    from adaptdist.cluster_file import cluster_to_dict
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.lowering_options import LoweringOptions
    from adaptdist.cost_models import estimate_programs
    from adaptdist.models import gpt
    from adaptdist.program import save_programs
    from safetensors.torch import save_file

    args = _parse(argv)
    worlds = tuple(int(w) for w in args.worlds.split(",") if w)
    plans = default_plans(worlds)
    con = Console(width=140)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    cores = usable_cores()
    threads = {w: args.threads_per_rank or max(1, cores // w) for w in worlds}
    t_start = time.perf_counter()
    con.print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; torch {torch.__version__}; {cores} usable cores; GPT "
              f"(GPTConfig with {args.heads} heads), global batch {args.batch_size} x {args.seq_len}; AdamW lr "
              f"{args.lr}; worlds "
              f"{worlds}, threads per rank {threads}; {args.rounds} rounds x {args.steps} steps per plan")
    load0, waited = wait_for_quiet(con, args.max_load, args.wait_s)
    con.print(f"load average before the run: {' / '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15 min) "
              f"after waiting {waited:.0f} s{'' if load0 < args.max_load else ' [red](still above --max-load)[/]'}")
    given = {}
    for f in args.cluster:
        c = load_cluster(f)
        given[c.world_size] = (c, f)

    with LoadSampler() as sampler, tempfile.TemporaryDirectory(prefix="bench_cost_model-") as tmp:
        # ---- compile (no cluster needed yet)
        sampler.phase = "compile"
        config = gpt.GPTConfig(num_heads=args.heads)
        torch.manual_seed(args.seed)
        model, example, _ = gpt.factory(args.batch_size, args.seq_len, config)
        n_params = sum(p.numel() for p in model.parameters())
        batch_file = str(Path(tmp) / "batch.safetensors")
        save_file({f"b{i}": t.contiguous() for i, t in enumerate(example)}, batch_file)
        compiled, dirs = {}, {}
        t0 = time.perf_counter()
        for p in plans:
            torch.manual_seed(args.seed)
            model, example, loss_fn = gpt.factory(args.batch_size, args.seq_len, config)
            compiled[p.name] = compile_model(model, example, loss_fn, p.world, ManualPlan.parse(p.plan, gpt),
                                               options=LoweringOptions(grad_bucket_bytes=int(p.bucket_mb * MIB)), mesh=p.mesh)
            dirs[p.name] = Path(tmp) / p.name.replace("/", "_").replace(" ", "_")
            save_programs(compiled[p.name], dirs[p.name])
        con.print(f"{n_params / 1e6:.2f} M parameters; compiled {len(plans)} plans in {time.perf_counter() - t0:.1f} s")

        # ---- per world size: calibrate, then measure at once (the same machine state for both)
        clusters, meas = {}, {}
        for w in worlds:
            if w != worlds[0]:  # our own previous ranks raised the 1-minute average: let it fall again
                sampler.phase = "idle"
                load, waited = wait_for_quiet(con, args.max_load, args.wait_s)
                con.print(f"world {w}: load {load:.2f} after waiting {waited:.0f} s")
            if w in given:
                clusters[w] = given[w][0]
                con.print(f"world {w}: cluster from {given[w][1]} ({clusters[w]!r})")
            else:
                clusters[w] = calibrate(con, sampler, w, threads[w], args.cluster_out)
            ps = [p for p in plans if p.world == w]
            meas.update(measure_plans(con, sampler, w, [(p.name, dirs[p.name]) for p in ps], batch_file, threads[w],
                                      args))
        sampler.phase = "report"

    # ---- predict
    pred = {}
    for p in plans:
        programs = compiled[p.name]
        est = estimate_programs(programs, clusters[p.world], "adamw")
        slow = max(est.ranks.values(), key=lambda r: r.step_s)
        colls = sum(1 for n in programs[0].graph_module.graph.nodes
                    if str(n.target).startswith("_c10d_functional.") and "wait_tensor" not in str(n.target))
        before = estimate_programs(programs, RooflineOnlyCluster(clusters[p.world]), "adamw")
        pred[p.name] = {
            "step_s": est.step_s, "before_step_s": before.step_s, "compute_s": slow.compute_s,
            "optimizer_s": slow.optimizer_s,
            "communication_s": slow.communication_s, "idle_s": slow.idle_s,
            "peak_bytes": {r: int(e.memory.peak_bytes) for r, e in est.ranks.items()},
            "nodes": len(programs[0].graph_module.graph.nodes), "collectives": colls, "gflop": slow.flops / 1e9,
        }

    # ---- report
    names = [p.name for p in plans]
    step_err = {n: pred[n]["step_s"] / meas[n]["median_s"] - 1 for n in names}
    before_err = {n: pred[n]["before_step_s"] / meas[n]["median_s"] - 1 for n in names}
    mem_err = {n: max(pred[n]["peak_bytes"].values()) / max(meas[n]["peak_bytes"].values()) - 1 for n in names}
    mem_err_rank = {n: max(abs(pred[n]["peak_bytes"][r] / meas[n]["peak_bytes"][r] - 1) for r in meas[n]["peak_bytes"])
                    for n in names}
    t = Table(title=f"cost model vs measured — GPT, global batch {args.batch_size}x{args.seq_len}, AdamW, gloo")
    for col in ("plan", "pred step ms", "meas step ms", "spread (round medians)", "err", "roofline-only ms (err)",
                "pred peak MiB", "meas peak MiB", "err", "worst rank err"):
        t.add_column(col, justify="left" if col == "plan" else "right")
    for n in names:
        m = meas[n]
        t.add_row(n, _ms(pred[n]["step_s"]), _ms(m["median_s"]),
                  f"{_ms(min(m['round_medians_s']))}-{_ms(max(m['round_medians_s']))}", _pct(step_err[n]),
                  f"{_ms(pred[n]['before_step_s'])} ({_pct(before_err[n])})",
                  f"{max(pred[n]['peak_bytes'].values()) / MIB:.2f}", f"{max(m['peak_bytes'].values()) / MIB:.2f}",
                  _pct(mem_err[n]), f"{100 * mem_err_rank[n]:.1f}%")
    con.print(t)

    b = Table(title="where the time goes (ms; predicted: slowest rank; measured: rank 0, program and optimizer "
                    "timed apart, exposed communication = self CPU of _c10d_functional ops under the profiler)")
    for col in ("plan", "nodes", "colls", "GFLOP", "pred fwd+bwd", "meas fwd+bwd", "pred optim", "meas optim",
                "pred comm (total)", "pred idle", "meas exposed comm", "pred step", "meas step"):
        b.add_column(col, justify="left" if col == "plan" else "right")
    for n in names:
        pr, m = pred[n], meas[n]
        meas_compute = m["program_s"] - m["comm_exposed_s"]
        b.add_row(n, str(pr["nodes"]), str(pr["collectives"]), f"{pr['gflop']:.2f}",
                  _ms(pr["compute_s"] - pr["optimizer_s"]), _ms(meas_compute), _ms(pr["optimizer_s"]),
                  _ms(m["optimizer_s"]), _ms(pr["communication_s"]), _ms(pr["idle_s"]), _ms(m["comm_exposed_s"]),
                  _ms(pr["step_s"]), _ms(m["program_s"] + m["optimizer_s"]))
    con.print(b)

    med_step = statistics.median(abs(step_err[n]) for n in names)
    med_mem = statistics.median(abs(mem_err[n]) for n in names)
    meas_t = {n: meas[n]["median_s"] for n in names}
    pred_t = {n: pred[n]["step_s"] for n in names}
    sub = separated_subset(meas_t)
    rho = spearman([pred_t[n] for n in sub], [meas_t[n] for n in sub])
    rho_all = spearman([pred_t[n] for n in names], [meas_t[n] for n in names])
    good, pairs = concordance(pred_t, meas_t)
    before_t = {n: pred[n]["before_step_s"] for n in names}
    med_before = statistics.median(abs(before_err[n]) for n in names)
    rho_before = spearman([before_t[n] for n in sub], [meas_t[n] for n in sub])
    good_b, _ = concordance(before_t, meas_t)
    ok = lambda c: "[green]MET[/]" if c else "[red]NOT MET[/]"  # noqa: E731
    con.print(f"step time: median |relative error| {100 * med_step:.1f}% (target <= 20%: {ok(med_step <= 0.2)}); "
              f"Spearman over the {len(sub)} plans >10% apart ({', '.join(sub)}): {rho:.3f} (target >= 0.9: "
              f"{ok(rho >= 0.9)}); over all {len(names)} plans {rho_all:.3f}; pairs >10% apart ordered right "
              f"{good}/{pairs}")
    con.print(f"  roofline-only model (devices costed as before the CPU rules: max of arithmetic and memory, "
              f"overlapped collectives, no op overhead): median |relative error| {100 * med_before:.1f}%, Spearman "
              f"over the same plans {rho_before:.3f}, pairs ordered right {good_b}/{pairs}")
    con.print(f"peak memory: median |relative error| {100 * med_mem:.2f}% (worst plan "
              f"{100 * max(abs(v) for v in mem_err.values()):.2f}%, worst single rank "
              f"{100 * max(mem_err_rank.values()):.2f}%; target <= 10%: {ok(med_mem <= 0.1)})")
    con.print("load average (1-min) by phase: " + "; ".join(f"{ph}: {sampler.summary(ph)}" for ph in sampler.samples
                                                             if ph not in ("idle", "report")))
    disturbed = [ph for ph in sampler.others if ph.startswith(("calibrate/", "measure/"))
                 and sampler.outside(ph) > args.max_outside]
    if disturbed:
        con.print(f"[red]DISTURBED: other people's work was runnable during {', '.join(disturbed)} (more than "
                  f"{args.max_outside} tasks on average): these figures are not the machine's; run again[/]")
    else:
        con.print(f"outside load: at most {max(sampler.outside(ph) for ph in sampler.others if ph != 'idle'):.2f} "
                  f"other runnable tasks on average in any phase (limit {args.max_outside}): undisturbed")
    con.print(f"now {' / '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15 min); total "
              f"{time.perf_counter() - t_start:.0f} s. "
              f"The benchmark's own ranks keep ~min(ranks, cores) cores busy while measuring.")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "pred": pred, "meas": meas, "step_err": step_err, "mem_err": mem_err,
            "median_step_err": med_step, "median_mem_err": med_mem, "spearman_separated": rho,
            "before_err": before_err, "median_before_err": med_before, "spearman_before": rho_before,
            "separated": sub, "spearman_all": rho_all, "concordant_pairs": [good, pairs],
            "load": sampler.samples, "other_runnable": sampler.others, "disturbed": disturbed,
            "clusters": {w: cluster_to_dict(clusters[w]) for w in worlds}}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import bench_cost_model

    sys.exit(bench_cost_model.main())
